#!/usr/bin/env bash
# Session-18 GPU calls (after staging MLX-CUDA: ../shared/tools/mlx-cuda-for-device.sh's parts; the last part's setup.sh first).
#   bash scripts/gpu_s18.sh targets   # `veloxquant benchmark --generate --rounds 3` (B = 1, 8k and 32k) and `--layer` (B = 1, 8)
#   bash scripts/gpu_s18.sh peak      # where the 8k peak is reached (scripts/peak_trace.py), as shipped and with a
#                                     # 512 MB prefill score budget; then the coded-path parity (-m gpu) and one layer at 32k
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu_s18_versions.txt
python3 -c "import mlx.core as mx, importlib.metadata as m; print('mlx', mx.__version__, 'mlx-lm', m.version('mlx-lm'), mx.default_device())" | tee -a $OUT/gpu_s18_versions.txt
case "$1" in
  targets)
     timeout ${TG:-300} python3 -m veloxquant.cli benchmark --skip-decode --generate --contexts 8192,32768 --gen-batches 1 \
       --decode-tokens 128 --rounds ${ROUNDS:-3} --out $OUT/generate_b1_s18.json 2>&1 | grep -v Warning | tail -n 12
     timeout ${TL:-160} python3 -m veloxquant.cli benchmark --skip-decode --layer --seq-lens 8192,32768 --batches 1,8 \
       --out $OUT/layer_s18.json 2>&1 | grep -v Warning | tail -n 14 ;;
  peak)
     timeout ${TP:-100} python3 scripts/peak_trace.py $OUT/peak_trace_s18.json --context 8192 2>&1 | grep -v Warning | cut -c1-900
     timeout ${TP:-100} python3 scripts/peak_trace.py $OUT/peak_trace_s18_budget512m.json --context 8192 --score-budget 536870912 \
       --specs "affine:key_bits=4,value_bits=4;turboquant:key_bits=3,value_bits=3" 2>&1 | grep -v Warning | cut -c1-900
     timeout ${T:-90} python3 -m pytest -q -p no:cacheprovider -x -m gpu tests/test_coded_decode.py 2>&1 | tail -n 8 | tee $OUT/gpu_tests_s18.txt
     timeout ${TB:-170} python3 scripts/bench_tiles.py $OUT/tiles_coded_s18.json 32768 1,8 "--methods=${M:-kivi;polar;gear;turboquant_rvq;qjl;rabitq}" ;;
esac
# after the checksum change (see scripts/prefill_state_ab.py):
#   bash scripts/gpu_s18.sh ab       # the state checksum's cost (compiled / op by op / none), then --layer (the SDPA-cache setting at import)
case "$1" in
  ab) timeout ${TA:-330} python3 scripts/prefill_state_ab.py $OUT/prefill_state_ab_s18.json --rounds ${ROUNDS:-2} 2>&1 | grep -v Warning | cut -c1-200
      timeout ${TL:-150} python3 -m veloxquant.cli benchmark --skip-decode --layer --seq-lens 8192,32768 --batches 1,8 \
        --out $OUT/layer_s18.json 2>&1 | grep -v Warning | tail -n 14 ;;
esac
#   bash scripts/gpu_s18.sh final    # after the generation loop's state reads went unsealed: the 8k peak trace with
#                                    # VQCache.prefill_sync, then unsealed against sealed reads (prefill, decode, peak; stock beside)
case "$1" in
  final) timeout ${TP:-60} python3 scripts/peak_trace.py $OUT/peak_trace_s18_sync.json --context 8192 --prefill-sync \
           --specs "affine:key_bits=4,value_bits=4;turboquant:key_bits=3,value_bits=3" 2>&1 | grep -v Warning | cut -c1-700
         timeout ${TA:-220} python3 scripts/prefill_state_ab.py $OUT/prefill_state_ab_s18_final.json --rounds 2 2>&1 | grep -v Warning | cut -c1-200 ;;
esac
