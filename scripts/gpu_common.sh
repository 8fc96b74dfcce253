# Sourced by the per-session GPU scripts (scripts/gpu_s22.sh and later) after MLX-CUDA is staged into /tmp/site:
# points Python at it and at this checkout, makes $OUT, and records the GPU and the MLX / mlx-lm versions in
# $OUT/gpu_${TAG}_versions.txt (TAG: the session's tag, set by the caller).
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu_${TAG}_versions.txt
python3 -c "import mlx.core as mx, importlib.metadata as m; print('mlx', mx.__version__, 'mlx-lm', m.version('mlx-lm'), mx.default_device())" | tee -a $OUT/gpu_${TAG}_versions.txt
