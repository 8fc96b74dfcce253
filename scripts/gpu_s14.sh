#!/usr/bin/env bash
# Session-14 GPU calls (after staging MLX-CUDA: ../shared/tools/mlx-cuda-for-device.sh's parts; the last part's setup.sh first).
#   bash scripts/gpu_s14.sh 1   # parity (-m gpu): the block formats on affine's kernel, the tile path, the affine kernels;
#                               # then one layer at 32k: q4_0 / q8_0 on the kernel vs over tiles, stock beside each (bench_tiles)
#   bash scripts/gpu_s14.sh 2   # where the decode over tiles spends its time (scripts/profile_tiles.py), 32k, B = 1 and 8
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu_s14_versions.txt
python3 -c "import mlx.core as mx, importlib.metadata as m; print('mlx', mx.__version__, 'mlx-lm', m.version('mlx-lm'), mx.default_device())" | tee -a $OUT/gpu_s14_versions.txt
case "$1" in
  1) timeout ${T:-280} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_block_kernels.py tests/test_tiled_decode.py \
       tests/test_kernels.py -k "block or tile or affine or Tiled or tiled" 2>&1 | tail -n 25 | tee $OUT/gpu_tests_s14.txt
     timeout 250 python3 scripts/bench_tiles.py $OUT/tiles_blockkernel_s14.json 32768 1,8 \
       "--methods=q4_0;q4_0:use_kernels=false;q8_0;q8_0:use_kernels=false;q4_0:hadamard=true;q4_0:hadamard=true,use_kernels=false" ;;
  2) timeout 500 python3 scripts/profile_tiles.py $OUT/profile_tiles_s14.json 32768 1,8 "q4_0:use_kernels=false;kivi;gear;polar;turboquant_rvq" ;;
esac
