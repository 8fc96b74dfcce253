#!/usr/bin/env bash
# Session-19 GPU calls (after staging MLX-CUDA: ../shared/tools/mlx-cuda-for-device.sh's parts; the last part's setup.sh first).
#   bash scripts/gpu_s19.sh tq        # turboquant's decode kernel with a copy of the codebook-pair tables per lane:
#                                     # GPU parity (-m gpu), then the A/B against one shared table (scripts/tq_switch_ab.py --switch lc);
#                                     # then the host time of a B = 1 layer (scripts/host_costs.py) and where polar's coded
#                                     # decode spends its time at B = 1 (scripts/profile_coded.py)
#   bash scripts/gpu_s19.sh targets   # `veloxquant benchmark --generate --rounds 3` (B = 1, 8k and 32k) and `--layer` (B = 1, 8)
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu_s19_versions.txt
python3 -c "import mlx.core as mx, importlib.metadata as m; print('mlx', mx.__version__, 'mlx-lm', m.version('mlx-lm'), mx.default_device())" | tee -a $OUT/gpu_s19_versions.txt
case "$1" in
  tq) timeout ${TT:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_coded_decode.py -k "tq or second" 2>&1 | tail -n 6 | tee $OUT/gpu_tests_s19.txt
      timeout ${TA:-300} python3 scripts/tq_switch_ab.py $OUT/tq_table_ab_s19.json --switch lc --rounds ${ROUNDS:-2} --seq-lens ${SEQ:-8192,32768} 2>&1 | grep -v Warning | cut -c1-200
      timeout ${TH:-60} python3 scripts/host_costs.py $OUT/host_costs_s19.json --context 32768 2>&1 | grep -v Warning | tail -n 16
      [ -n "${SKIP_CODED:-}" ] || timeout ${TC:-100} python3 scripts/profile_coded.py $OUT/profile_coded_s19.json 32768 1 "polar;kivi" 2>&1 | grep -v Warning | tail -n 4 ;;
  targets)
     timeout ${TG:-330} python3 -m veloxquant.cli benchmark --skip-decode --generate --contexts 8192,32768 --gen-batches 1 \
       --decode-tokens 128 --rounds ${ROUNDS:-3} --out $OUT/generate_b1_s19.json 2>&1 | grep -v Warning | tail -n 12
     timeout ${TL:-160} python3 -m veloxquant.cli benchmark --skip-decode --layer --seq-lens 8192,32768 --batches 1,8 \
       --out $OUT/layer_s19.json 2>&1 | grep -v Warning | tail -n 14 ;;
esac
