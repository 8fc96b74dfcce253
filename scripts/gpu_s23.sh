#!/usr/bin/env bash
# Session-23 GPU calls (after staging MLX-CUDA: ../shared/tools/mlx-cuda-for-device.sh's parts; the last part's setup.sh first).
#   bash scripts/gpu_s23.sh targets   # GPU parity of turboquant's kernels (-m gpu -k tq), then the end-to-end targets:
#                                     # `veloxquant benchmark --generate --rounds 3` (B = 1, 8k and 32k, 128 decoded tokens)
#   bash scripts/gpu_s23.sh layer     # one layer's decode step through the cache, queued as a model's forward and waiting for
#                                     # each token's predecessor as generate_step does: B = 1 32 layers deep and B = 8 8 deep,
#                                     # the methods interleaved over rounds; then the kernels alone (fp16 SDPA beside them)
#   bash scripts/gpu_s23.sh split     # B = 1 decode of the 32-layer model queued as generate_step does, 8k and 32k: per token the
#                                     # host time (graph + enqueue) and the wait for the previous token (scripts/profile_b1.py)
#   bash scripts/gpu_s23.sh host      # host cost (graph building / queueing) of one custom-kernel launch, through mx.compile, and of
#                                     # one B = 1 decode layer per cache kind (scripts/launch_host_cost.py)
#   bash scripts/gpu_s23.sh tiles     # the methods without a kernel of their own (and q4_0) through the cache at 32k, B = 1 and 8,
#                                     # stock beside each (scripts/bench_tiles.py)
#   bash scripts/gpu_s23.sh fwht      # GPU parity of turboquant's decode with the queries rotated by butterflies (HAD = 1), then
#                                     # its A/B against R's product (scripts/tq_switch_ab.py --switch fwht)
#   bash scripts/gpu_s23.sh nsys      # nsys profile of B = 1 decode steps at 32k (scripts/profile_b1.py), if nsys is installed
#   bash scripts/gpu_s23.sh next      # one call of at most ~560 s in priority order: host (launch costs), fwht (parity + A/B, one
#                                     # round), split (with the build / queue split of the host part, one round)
set -u
case "${1:-}" in targets|layer|split|host|tiles|fwht|nsys|next) ;; *) echo "usage: bash scripts/gpu_s23.sh targets|layer|split|host|tiles|fwht|nsys|next (see the comments at the top)"; exit 2 ;; esac
TAG=s23 . scripts/gpu_common.sh
case "$1" in
  targets)
     timeout ${TT:-100} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py -k tq 2>&1 | tail -n 4 | tee $OUT/gpu_tests_s23.txt
     timeout ${TG:-420} python3 -m veloxquant.cli benchmark --skip-decode --generate --contexts 8192,32768 --gen-batches 1 \
       --decode-tokens 128 --rounds ${ROUNDS:-3} --out $OUT/generate_b1_s23.json 2>&1 | grep -v Warning | tail -n 12 ;;
  layer)
     timeout ${TL:-230} python3 -m veloxquant.cli benchmark --skip-decode --layer --layer-depth 32 --seq-lens 8192,32768 --batches 1 \
       --rounds ${ROUNDS:-5} --out $OUT/layer_depth32_rounds_s23.json 2>&1 | grep -v Warning | tail -n 9
     timeout ${TL8:-200} python3 -m veloxquant.cli benchmark --skip-decode --layer --layer-depth 8 --seq-lens 32768 --batches 8 \
       --rounds ${ROUNDS8:-3} --out $OUT/layer_depth8_b8_rounds_s23.json 2>&1 | grep -v Warning | tail -n 7
     timeout ${TK:-120} python3 -m veloxquant.cli benchmark --seq-lens 8192,32768 --batches 1,8 --head-dims 128 --bits 4 --repeats 30 \
       --out $OUT/decode_kernels_s23.json 2>&1 | grep -v Warning | tail -n 14 ;;
  split) timeout ${TP:-200} python3 scripts/profile_b1.py $OUT/b1_split_s23.json --contexts 8192,32768 --steps 64 --rounds 3 2>&1 \
         | grep -v Warning | grep -v layout | cut -c1-220 | tail -n 24 ;;
  host) timeout ${TH:-150} python3 scripts/launch_host_cost.py $OUT/launch_host_cost_s23.json 2>&1 | grep -v Warning | cut -c1-200 | tail -n 14 ;;
  tiles) timeout ${TB:-200} python3 scripts/bench_tiles.py $OUT/tiles_coded_s23.json 32768 1,8 \
         "--methods=${M:-q4_0;kivi;polar;gear;turboquant_rvq;qjl;rabitq}" 2>&1 | grep -v Warning | tail -n 16 ;;
  fwht) timeout ${TT:-150} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py -k "tq_decode_parity or fwht" 2>&1 | tail -n 4 | tee $OUT/gpu_tests_fwht_s23.txt
       timeout ${TA:-300} python3 scripts/tq_switch_ab.py $OUT/tq_fwht_ab_s23.json --switch fwht --rounds ${ROUNDS:-2} --batches ${BS:-1,8} 2>&1 | grep -v Warning | cut -c1-160 | tail -n 22 ;;
  next) export OUT; TH=70 bash $0 host; TT=110 TA=200 ROUNDS=1 bash $0 fwht
        timeout ${TP:-150} python3 scripts/profile_b1.py $OUT/b1_split2_s23.json --contexts 8192,32768 --steps 64 --rounds 1 --no-build 2>&1 \
          | grep -v Warning | grep -v layout | cut -c1-260 | tail -n 8 ;;
  nsys) NS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
     [ -z "$NS" ] && { echo "no nsys on this machine"; exit 0; }
     for s in "stock" "affine:key_bits=4,value_bits=4"; do
       timeout ${TN:-150} $NS profile -t cuda,nvtx,osrt --sample=none -o $OUT/nsys_${s%%:*}_s23 python3 scripts/profile_b1.py /tmp/x.json \
         --contexts 32768 --specs "$s" --steps 32 --rounds 1 --layers 32 --no-build > $OUT/nsys_${s%%:*}_s23.log 2>&1
       $NS stats -r cuda_gpu_kern_sum,cuda_api_sum --format csv -o $OUT/nsys_${s%%:*}_s23 $OUT/nsys_${s%%:*}_s23.nsys-rep >/dev/null 2>&1
       echo "$s: $(ls $OUT | grep nsys_${s%%:*} | tr '\n' ' ')"; rm -f $OUT/nsys_${s%%:*}_s23.nsys-rep $OUT/nsys_${s%%:*}_s23.sqlite; done ;;
esac
