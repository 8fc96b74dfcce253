#!/usr/bin/env bash
# Session-22 GPU calls (after staging MLX-CUDA: ../shared/tools/mlx-cuda-for-device.sh's parts; the last part's setup.sh first).
#   bash scripts/gpu_s22.sh layer     # GPU parity (-m gpu: turboquant's kernels, the coded path's direct second step), then
#                                     # one layer's decode step through the cache at 8k/32k, queued as a model's forward
#                                     # (B = 1: 32 layers deep; B = 8: 8 deep, since 32 stock caches of 1.08 GB do not fit an H100),
#                                     # and evaluated step by step (--layer-depth 1). (In session 22 the parity ran apart: -k second.)
#   bash scripts/gpu_s22.sh targets   # `veloxquant benchmark --generate --rounds 3` (B = 1, 8k and 32k, 128 decoded tokens)
#   bash scripts/gpu_s22.sh ncu       # GPU time per kernel (ncu gpu__time_duration.sum) of B = 1 decode steps at 32k after a
#                                     # real prefill (2 layers of the Llama-3.1-8B shape; scripts/profile_b1.py), per spec
#   bash scripts/gpu_s22.sh sweep     # the tensor-core kernels' threadgroup target at B = 1 through 32 queued layers
#                                     # (scripts/sweep_split_depth.py, 32k; SWEEP8=1: 8k too), after the 32-deep layer table with
#                                     # host time; then ncu of affine's decode at 32k
#   bash scripts/gpu_s22.sh rounds    # the 32-deep B = 1 layer table, the methods interleaved over 5 rounds (--rounds 5)
#   bash scripts/gpu_s22.sh tq        # turboquant's per-lane codebook-pair tables vs one shared table (scripts/tq_switch_ab.py --switch lc)
set -u
case "${1:-}" in layer|targets|ncu|sweep|rounds|tq) ;; *) echo "usage: bash scripts/gpu_s22.sh layer|targets|ncu|sweep|rounds|tq (see the comments at the top)"; exit 2 ;; esac
TAG=s22 . scripts/gpu_common.sh
case "$1" in
  layer)
     timeout ${TT:-120} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_coded_decode.py -k "tq or second" 2>&1 | tail -n 6 | tee $OUT/gpu_tests_s22.txt
     timeout ${TL:-240} python3 -m veloxquant.cli benchmark --skip-decode --layer --layer-depth 32 --seq-lens 8192,32768 --batches 1 \
       --out $OUT/layer_depth32_b1_s22.json 2>&1 | grep -v Warning | tail -n 9
     timeout ${TL8:-200} python3 -m veloxquant.cli benchmark --skip-decode --layer --layer-depth 8 --seq-lens 8192,32768 --batches 8 \
       --out $OUT/layer_depth8_b8_s22.json 2>&1 | grep -v Warning | tail -n 9
     timeout ${TL1:-120} python3 -m veloxquant.cli benchmark --skip-decode --layer --seq-lens 8192,32768 --batches 1,8 \
       --out $OUT/layer_s22.json 2>&1 | grep -v Warning | tail -n 15 ;;
  targets)
     timeout ${TG:-400} python3 -m veloxquant.cli benchmark --skip-decode --generate --contexts 8192,32768 --gen-batches 1 \
       --decode-tokens 128 --rounds ${ROUNDS:-3} --out $OUT/generate_b1_s22.json 2>&1 | grep -v Warning | tail -n 12 ;;
  ncu) for s in "stock" "affine:key_bits=4,value_bits=4" "turboquant:key_bits=3,value_bits=3"; do
       timeout ${TN:-140} /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --csv python3 scripts/profile_b1.py /tmp/x.json \
         --contexts ${CTX:-32768} --specs "$s" --steps 3 --rounds 1 --layers 2 --prefill 2048 > "$OUT/ncu_${s%%:*}_s22.csv" 2>/dev/null
       echo "$s rc $? $(wc -l < $OUT/ncu_${s%%:*}_s22.csv) lines"; done ;;
  sweep) timeout ${TD:-90} python3 -m veloxquant.cli benchmark --skip-decode --layer --layer-depth 32 --seq-lens 8192,32768 --batches 1 \
         --out $OUT/layer_depth32_b1_host_s22.json 2>&1 | grep -v Warning | tail -n 8
       timeout ${TS:-200} python3 scripts/sweep_split_depth.py $OUT/sweep_split_depth_32k_s22.json --targets ${TARGETS:-264,528,1056,2112} 2>&1 | grep -v Warning | tail -n 9
       [ -n "${SWEEP8:-}" ] && timeout ${TS8:-100} python3 scripts/sweep_split_depth.py $OUT/sweep_split_depth_8k_s22.json --S 8192 --targets 264,1056 2>&1 | grep -v Warning | tail -n 5
       s="affine:key_bits=4,value_bits=4"
       timeout ${TN:-100} /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --csv python3 scripts/profile_b1.py /tmp/x.json \
         --contexts 32768 --specs "$s" --steps 3 --rounds 1 --layers 2 --prefill 2048 > "$OUT/ncu_affine_s22.csv" 2>/dev/null; echo "ncu rc $?" ;;
  rounds) timeout ${TR:-240} python3 -m veloxquant.cli benchmark --skip-decode --layer --layer-depth 32 --seq-lens 8192,32768 --batches 1 \
         --rounds ${ROUNDS:-5} --out $OUT/layer_depth32_rounds_s22.json 2>&1 | grep -v Warning | tail -n 9 ;;
  tq) timeout ${TA:-300} python3 scripts/tq_switch_ab.py $OUT/tq_table_ab_s22.json --switch lc --rounds ${ROUNDS:-2} --seq-lens ${SEQ:-8192,32768} 2>&1 | grep -v Warning | cut -c1-200 ;;
esac
