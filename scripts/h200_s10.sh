#!/usr/bin/env bash
# Session-10 H200 runs on the one-pass merge kernel and turboquant's in-kernel query rotation (after .mlxcuda setup;
# PYTHONPATH=/tmp/site:$PWD). "tests": GPU parity of every decode kernel, the padded batch, nvcc of every checked-in
# instantiation; "b1": B = 1 end to end through generate_step (8k, 32k); "b8": B = 8 at 32k through BatchGenerator.
set -uo pipefail
case "$1" in
tests)
  timeout ${T:-400} python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_tiled_decode.py tests/test_vq.py \
    tests/test_kernel_safety.py 2>&1 | tail -40 > $OUT/gpu_tests_s10.txt
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_batch.py -k padded 2>&1 | tail -20 >> $OUT/gpu_tests_s10.txt
  tail -6 $OUT/gpu_tests_s10.txt
  if command -v nvcc >/dev/null; then python3 -c "
import veloxquant, veloxquant.gpu as g
for x in g.nvcc_check_all(): print('nvcc sm_90 ok:', x)" > $OUT/nvcc_s10.txt 2>&1; tail -3 $OUT/nvcc_s10.txt; else echo "no nvcc"; fi ;;
b1)
  python3 - <<'PY'
import json, os
from veloxquant import bench
rows = bench.benchmark_generate(contexts=(8192, 32768), batches=(1,), decode_tokens=256, progress=False, warm_each=False)
json.dump(rows, open(os.environ["OUT"] + "/generate_h200_b1_s10.json", "w"), indent=1, default=float)
bench.print_generate(rows)
PY
  ;;
b8)
  timeout 560 python3 scripts/bench_batch.py $OUT/generate_h200_b8_32k_s10.json --contexts 32768 --reference-contexts "" --warm-each 0 ;;
esac
