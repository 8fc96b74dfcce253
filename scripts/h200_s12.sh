#!/usr/bin/env bash
# Session-12 H200 runs (after .mlxcuda setup; PYTHONPATH=/tmp/site:$PWD). Part "layout": B = 1 decode of stock,
# turboquant 3/3 and affine 4/4 with caches filled (a) by random K/V in one update and (b) by a real prefill in
# 2,048-token chunks, side by side per fill, with the cache layout and the attention path each decode step took.
set -uo pipefail
case "$1" in
layout)
  S="stock;turboquant:key_bits=3,value_bits=3;affine:key_bits=4,value_bits=4"
  python3 scripts/profile_b1.py $OUT/profile_b1_filled_s12.json --contexts 32768,8192 --specs "$S" --rounds 2 --steps 128 2>&1 | grep -v '^{' | tail -20
  python3 scripts/profile_b1.py $OUT/profile_b1_prefill_s12.json --contexts 32768,8192 --specs "$S" --rounds 2 --steps 128 --prefill 2048 2>&1 | grep -v '^{' | tail -20
  python3 - <<'PY'
import json, os
for f in ("filled", "prefill"):
    r = json.load(open(f"{os.environ['OUT']}/profile_b1_{f}_s12.json"))
    for row in r["rows"]: print(f, row["ctx"], row["round"], row["spec"][:24], round(row["tok_s"], 1))
PY
  ;;
esac
# The other session-12 measurements (each one call, after the setup):
#   python3 scripts/profile_host.py $OUT/host_profile_s12.txt --context 32768      (cProfile of decode steps)
#   python3 scripts/host_costs.py $OUT/host_costs_s12.json --context 32768         (host µs per piece of a layer)
#   ncu --metrics gpu__time_duration.sum --csv python3 scripts/profile_b1.py /tmp/x.json --contexts 32768 --specs SPEC --steps 3 --rounds 1 --layers 2 [--merge-warps W]
#   python3 scripts/stream_check.py $OUT/stream_check_s12.json --context 32768     (default vs new stream, then benchmark_generate)
#   python3 scripts/profile_generate.py $OUT/profile_generate_s12.txt --context 32768   (generate_step in a fresh process)
#   python3 scripts/token_times.py $OUT/token_times_s12.json --context 32768       (per-token intervals after the shared warm-up)
# Next: python3 scripts/warmup_bisect.py $OUT/warmup_bisect.json --context 32768   (which state carries the slowdown)
