#!/usr/bin/env bash
# Session-24 GPU calls (after staging MLX-CUDA: ../shared/tools/mlx-cuda-for-device.sh's parts; the last part's setup.sh first).
#   bash scripts/gpu_s24.sh next      # one call of at most ~560 s, in priority order: (1) GPU parity of the decode step replayed
#                                     # through mx.compile (gpu.REPLAY_DECODE) and of turboquant's butterfly query rotation;
#                                     # (2) B = 1 decode of the 32-layer model queued as generate_step does, 8k and 32k, each
#                                     # method launch by launch and replayed, stock beside them, three interleaved rounds, with
#                                     # the host / wait split (scripts/profile_b1.py, specs ending in @replay); (3) the launch
#                                     # host cost (scripts/launch_host_cost.py)
#   bash scripts/gpu_s24.sh targets   # `veloxquant benchmark --generate --rounds 3` (B = 1, 8k and 32k, 128 decoded tokens) with
#                                     # gpu.REPLAY_DECODE on: the end-to-end targets as a user runs them
#   bash scripts/gpu_s24.sh tiles     # the generic coded path (methods without a kernel of their own) through the cache at 32k,
#                                     # B = 1 and 8, launch by launch and replayed, stock beside each row (scripts/bench_tiles.py --replay)
#   bash scripts/gpu_s24.sh rest      # session 23's pending measurements: FWHT A/B (one round), queued layer tables
set -u
case "${1:-}" in next|targets|tiles|rest) ;; *) echo "usage: bash scripts/gpu_s24.sh next|targets|tiles|rest (see the comments at the top)"; exit 2 ;; esac
TAG=s24 . scripts/gpu_common.sh
AFF="affine:key_bits=4,value_bits=4"; TQ="turboquant:key_bits=3,value_bits=3"
case "$1" in
  next)
     timeout ${TT:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fast_path.py tests/test_kernels.py \
       -k "replayed_decode_matches or tq_decode_parity or fwht" 2>&1 | tail -n 6 | tee $OUT/gpu_tests_s24.txt
     timeout ${TP:-260} python3 scripts/profile_b1.py $OUT/b1_replay_ab_s24.json --contexts 8192,32768 --steps 64 --rounds 3 --no-build \
       --specs "stock;$AFF;$AFF@replay;$TQ;$TQ@replay" 2>&1 | grep -v Warning | grep -v layout | cut -c1-230 | tail -n 32
     timeout ${TH:-80} python3 scripts/launch_host_cost.py $OUT/launch_host_cost_s24.json 2>&1 | grep -v Warning | cut -c1-200 | tail -n 14 ;;
  targets)
     timeout ${TG:-540} python3 -c "import sys, veloxquant.gpu as g; g.REPLAY_DECODE = True; from veloxquant.cli import main; sys.exit(main())" \
       benchmark --skip-decode --generate --contexts 8192,32768 --gen-batches 1 --decode-tokens 128 --rounds ${ROUNDS:-3} \
       --out $OUT/generate_b1_replay_s24.json 2>&1 | grep -v Warning | tail -n 12 ;;
  tiles) timeout ${TB:-400} python3 scripts/bench_tiles.py $OUT/tiles_replay_s24.json 32768 1,8 --replay \
         "--methods=${M:-polar;kivi;gear;turboquant_rvq;qjl;rabitq;q4_0}" 2>&1 | grep -v Warning | tail -n 30 ;;
  rest) TT=110 TA=200 ROUNDS=1 bash scripts/gpu_s23.sh fwht; TL=150 TL8=120 TK=60 ROUNDS=3 ROUNDS8=2 bash scripts/gpu_s23.sh layer ;;
esac
