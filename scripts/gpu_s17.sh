#!/usr/bin/env bash
# Session-17 GPU calls (after staging MLX-CUDA: ../shared/tools/mlx-cuda-for-device.sh's parts; the last part's setup.sh first).
#   bash scripts/gpu_s17.sh 1   # why B = 1 decode slows after benchmark_generate's shared warm-up (scripts/warmup_bisect.py)
#   bash scripts/gpu_s17.sh 2   # the same (quick) under a larger CUDA graph cache and with CUDA graphs off
#   bash scripts/gpu_s17.sh 3   # parity (-m gpu) of the decode over codes inside one kernel; one layer at 32k, B = 1 and 8,
#                               # each method on the coded kernel, stock beside each (scripts/bench_tiles.py)
#   bash scripts/gpu_s17.sh 4   # the GPU targets: `veloxquant benchmark --generate --rounds 3` (B = 1, 8k and 32k) and `--layer` (B = 1, 8)
#   bash scripts/gpu_s17.sh 7   # B = 1 at 32k with two rounds and the 8k peak trace (the shortest call)
#   bash scripts/gpu_s17.sh 6   # 4 and the peak trace, with shorter limits (a short device budget)
#   bash scripts/gpu_s17.sh 5   # 4, where the 8k peak is reached (scripts/peak_trace.py), then 3
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu_s17_versions.txt
python3 -c "import mlx.core as mx, importlib.metadata as m; print('mlx', mx.__version__, 'mlx-lm', m.version('mlx-lm'), mx.default_device())" | tee -a $OUT/gpu_s17_versions.txt
case "$1" in
  1) timeout ${TW:-300} python3 scripts/warmup_bisect.py $OUT/warmup_bisect_s17.json --context 32768 2>&1 | grep -v Warning | cut -c1-600 ;;
  2) timeout ${TQ:-150} python3 scripts/warmup_bisect.py $OUT/warmup_bisect_s17_alternate.json --context 32768 --alternate 4 2>&1 | grep -v Warning | cut -c1-250
     # the warm-up effect under MLX's CUDA graph settings (each in its own process): a larger graph cache, no graphs
     MLX_CUDA_GRAPH_CACHE_SIZE=4000 timeout ${TQ:-150} python3 scripts/warmup_bisect.py $OUT/warmup_bisect_s17_cache4000.json --context 32768 --alternate 4 2>&1 | grep -v Warning | cut -c1-250
     MLX_USE_CUDA_GRAPHS=0 timeout ${TQ:-150} python3 scripts/warmup_bisect.py $OUT/warmup_bisect_s17_nographs.json --context 32768 --alternate 4 2>&1 | grep -v Warning | cut -c1-250 ;;
  3) timeout ${T:-100} python3 -m pytest -q -p no:cacheprovider -x -m gpu tests/test_coded_decode.py 2>&1 | tail -n 8 | tee $OUT/gpu_tests_s17.txt
     timeout ${TB:-300} python3 scripts/bench_tiles.py $OUT/tiles_coded_h200_s17.json 32768 1,8 "--methods=${M:-kivi;polar;gear;turboquant_rvq;qjl;rabitq}" ;;
  7) # the shortest: B = 1 at 32k, two rounds, then the 8k peak trace
     timeout ${TG:-110} python3 -m veloxquant.cli benchmark --skip-decode --generate --contexts 32768 --gen-batches 1 \
       --decode-tokens 128 --rounds 2 --out $OUT/generate_b1_32k_s17.json 2>&1 | grep -v Warning | tail -n 6
     timeout ${TP:-60} python3 scripts/peak_trace.py $OUT/peak_trace_s17.json --context 8192 2>&1 | grep -v Warning | cut -c1-700 ;;
  6) TG=${TG:-170} TL=${TL:-50} bash $0 4; timeout ${TP:-70} python3 scripts/peak_trace.py $OUT/peak_trace_s17.json --context 8192 2>&1 | grep -v Warning | cut -c1-700 ;;
  5) bash $0 4; timeout ${TP:-120} python3 scripts/peak_trace.py $OUT/peak_trace_s17.json --context 8192 2>&1 | grep -v Warning | cut -c1-700; bash $0 3 ;;
  4) # the GPU targets, end to end and one layer through the cache, stock beside each (H200 protocol of the benchmark notebook)
     timeout ${TG:-330} python3 -m veloxquant.cli benchmark --skip-decode --generate --contexts 8192,32768 --gen-batches 1 \
       --decode-tokens 128 --rounds ${ROUNDS:-3} --out $OUT/generate_b1_s17.json 2>&1 | grep -v Warning | tail -n 12
     timeout ${TL:-200} python3 -m veloxquant.cli benchmark --skip-decode --layer --seq-lens 8192,32768 --batches 1,8 \
       --out $OUT/layer_s17.json 2>&1 | grep -v Warning | tail -n 14 ;;
esac
