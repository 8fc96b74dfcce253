#!/usr/bin/env bash
# Session-25 GPU calls (after staging MLX-CUDA: ../shared/tools/mlx-cuda-for-device.sh's parts; the last part's setup.sh first).
#   bash scripts/gpu_s25.sh targets   # GPU parity of the replayed decode step (exact equality), then the end-to-end B = 1 targets as
#                                     # a user runs them: `veloxquant benchmark --generate` (8k and 32k, 128 decoded tokens) with
#                                     # gpu.REPLAY_DECODE off, then on, then off again, in one call on one machine
#   bash scripts/gpu_s25.sh layer     # one layer's decode step through the cache (B = 8 32k 8 deep, then B = 1 32 deep), the kernels
#                                     # alone beside fp16 SDPA, then the generic coded path at 32k (scripts/bench_tiles.py)
#   bash scripts/gpu_s25.sh parts     # where a custom-kernel launch's host cost goes (scripts/launch_cost_parts.py)
#   bash scripts/gpu_s25.sh build     # where a B = 1 token's graph build goes: cProfile per spec (scripts/profile_build.py), 8k and 32k
#   bash scripts/gpu_s25.sh host      # GPU parity of DecodeStep's prepared and baked launches, the launch-cost parts, then B = 1 decode of
#                                     # the 32-layer model (scripts/profile_b1.py): each method without the prepared launches (@cold),
#                                     # with them (the default) and baked (@bake), stock beside them, rounds interleaved; then the
#                                     # end-to-end benchmark once with the defaults
set -u
case "${1:-}" in targets|layer|parts|host|build) ;; *) echo "usage: bash scripts/gpu_s25.sh targets|layer|parts|host|build (see the comments at the top)"; exit 2 ;; esac
TAG=s25 . scripts/gpu_common.sh
AFF="affine:key_bits=4,value_bits=4"; TQ="turboquant:key_bits=3,value_bits=3"
gen() {  # $1: replay flag (0/1), $2: output tag
  timeout ${TG:-170} python3 -c "import sys, veloxquant.gpu as g; g.REPLAY_DECODE = bool($1); from veloxquant.cli import main; sys.exit(main())" \
    benchmark --skip-decode --generate --contexts 8192,32768 --gen-batches 1 --decode-tokens 128 --rounds ${ROUNDS:-2} \
    --out $OUT/generate_b1_$2_s25.json 2>&1 | grep -v Warning | tail -n 7; }
case "$1" in
  targets)
     timeout ${TT:-100} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fast_path.py -k "replayed_decode_matches" 2>&1 \
       | tail -n 4 | tee $OUT/gpu_tests_s25.txt
     gen 0 noreplay_a; gen 1 replay_a; gen 0 noreplay_b ;;
  layer)
     timeout ${TL8:-150} python3 -m veloxquant.cli benchmark --skip-decode --layer --layer-depth 8 --seq-lens 32768 --batches 8 \
       --rounds ${ROUNDS8:-3} --out $OUT/layer_depth8_b8_s25.json 2>&1 | grep -v Warning | tail -n 7
     timeout ${TK:-90} python3 -m veloxquant.cli benchmark --seq-lens 8192,32768 --batches 1,8 --head-dims 128 --bits 4 --repeats 30 \
       --out $OUT/decode_kernels_s25.json 2>&1 | grep -v Warning | tail -n 14
     timeout ${TB:-200} python3 scripts/bench_tiles.py $OUT/tiles_coded_s25.json 32768 1,8 \
       "--methods=${M:-polar;kivi;gear;turboquant_rvq;qjl;rabitq}" 2>&1 | grep -v Warning | tail -n 16
     timeout ${TL:-120} python3 -m veloxquant.cli benchmark --skip-decode --layer --layer-depth 32 --seq-lens 8192,32768 --batches 1 \
       --rounds ${ROUNDS:-3} --out $OUT/layer_depth32_b1_s25.json 2>&1 | grep -v Warning | tail -n 9 ;;
  host)
     timeout ${TT:-110} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fast_path.py -k "prepared_and_baked or replayed_decode_matches" 2>&1 \
       | tail -n 4 | tee $OUT/gpu_tests_host_s25.txt
     timeout ${TP:-60} python3 scripts/launch_cost_parts.py $OUT/launch_cost_parts_s25.json 2>&1 | grep -v Warning | tail -n 10
     timeout ${TB1:-240} python3 scripts/profile_b1.py $OUT/b1_prepared_ab_s25.json --contexts 8192,32768 --steps 64 --rounds ${ROUNDS:-3} --no-build \
       --specs "stock;$AFF@cold;$AFF;$AFF@bake;$TQ@cold;$TQ;$TQ@bake" 2>&1 | grep -v Warning | grep -v layout | cut -c1-200 | tail -n 42
     ROUNDS=1 TG=${TG:-130} gen 0 prepared ;;
  build) for C in 8192 32768; do timeout ${TPB:-100} python3 scripts/profile_build.py $OUT/profile_build_${C}_s25.json --context $C 2>&1 \
           | grep -v Warning | tail -n 60; done ;;
  parts) timeout ${TP:-120} python3 scripts/launch_cost_parts.py $OUT/launch_cost_parts_s25.json 2>&1 | grep -v Warning | tail -n 12 ;;
esac
