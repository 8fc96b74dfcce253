#!/usr/bin/env bash
# Session-8 H200 runs after the decode kernels' chunk size became a runtime input (after .mlxcuda setup;
# PYTHONPATH=/tmp/site:$PWD). Part "tests": GPU parity of every decode kernel; part "bench": B = 1 end to end with no
# per-shape warm-up (the shared warm-up only), then B = 8 at 32k through BatchGenerator in 128-token prefill steps. TAG (default s8) names the
# output files, so a later session reruns the same protocol with TAG=s10; T: the parity run's time limit in s.
set -uo pipefail
export TAG=${TAG:-s8}
case "$1" in
tests)
  timeout ${T:-330} python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_tiled_decode.py tests/test_vq.py \
    tests/test_kernel_safety.py 2>&1 | tail -40 > $OUT/gpu_tests_${TAG}.txt
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_batch.py -k padded 2>&1 | tail -20 >> $OUT/gpu_tests_${TAG}.txt
  tail -5 $OUT/gpu_tests_${TAG}.txt
  if command -v nvcc >/dev/null; then python3 -c "
import veloxquant, veloxquant.gpu as g
for x in g.nvcc_check_all(): print('nvcc sm_90 ok:', x)" > $OUT/nvcc_${TAG}.txt 2>&1; tail -3 $OUT/nvcc_${TAG}.txt; else echo "no nvcc"; fi ;;
b1)
  python3 - <<'PY'
import json, os
from veloxquant import bench
rows = bench.benchmark_generate(contexts=(8192, 32768), batches=(1,), decode_tokens=256, progress=False, warm_each=False)
json.dump(rows, open(os.environ["OUT"] + "/generate_h200_b1_" + os.environ["TAG"] + ".json", "w"), indent=1, default=float)
bench.print_generate(rows)
PY
  ;;
b8)
  timeout 560 python3 scripts/bench_batch.py $OUT/generate_h200_b8_32k_${TAG}.json --contexts 32768 --reference-contexts "" --warm-each 0 --step 128 ;;  # 512-token steps: out of memory (stock itself peaks at 138 GB)
esac
