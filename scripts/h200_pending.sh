#!/usr/bin/env bash
# The GPU measurements that the last CPU-only session could not make, in two device calls after the kernel-only staging
# (../shared/tools/mlx-cuda-for-device.sh: .mlxcuda/p1, then `bash .mlxcuda/p2/setup.sh && export PYTHONPATH=/tmp/site:$PWD`):
#   bash scripts/h200_pending.sh 1   # parity: padded-batch fused decode and decoded-history batch prefill (pytest), then
#                                    # where end-to-end prefill time goes (generate_step's loop, first vs second pass)
#   bash scripts/h200_pending.sh 2   # B = 8 end to end at 32k through BatchGenerator (needs > 280 s)
# Results go to $OUT (the device call's output folder).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
case "${1:-1}" in
  1) python3 -m pytest -q -m "gpu or not gpu" tests/test_batch.py -k "padded" 2>&1 | tail -n 15 | tee "$OUT/batch_gpu_tests.txt"
     timeout 420 python3 scripts/profile_prefill.py "$OUT/profile_prefill_h200.json" 8192,32768 2>&1 | tail -n 60 ;;
  2) timeout 560 python3 scripts/bench_batch.py "$OUT/generate_h200_b8_32k.json" --contexts 32768 --reference-contexts "" 2>&1 | tail -n 20 ;;
esac
