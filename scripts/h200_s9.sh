#!/usr/bin/env bash
# Session-9 H200 runs after the one-pass merge kernel and turboquant's in-kernel query rotation (after .mlxcuda setup;
# PYTHONPATH=/tmp/site:$PWD). "tests": GPU parity of the decode kernels that go through the merge; "prof": kernel times
# of one decode step under ncu (2 layers), B = 1 pipelined decode (filled caches), host build time, prefill pieces.
set -uo pipefail
case "$1" in
tests)
  timeout ${T:-300} python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_tiled_decode.py tests/test_vq.py \
    -k "parity or merge or tiled or end_to_end or generation" 2>&1 | tail -25 > $OUT/gpu_tests_s9.txt; tail -4 $OUT/gpu_tests_s9.txt ;;
prof)
  for s in "affine:key_bits=4,value_bits=4" "turboquant:key_bits=3,value_bits=3"; do
    timeout 150 /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --csv python3 scripts/profile_b1.py /tmp/x.json \
      --contexts 8192 --specs "$s" --steps 3 --rounds 1 --layers 2 > "$OUT/ncu_${s%%:*}.csv" 2>/dev/null; done
  python3 scripts/profile_b1.py $OUT/b1_s9.json --contexts 8192,32768 --steps 128 --rounds ${R:-3} 2>&1 | tail -24
  python3 scripts/profile_prefill_pieces.py $OUT/prefill_pieces_s9.json 2>&1 | tail -10 ;;
esac
