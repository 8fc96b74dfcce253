#!/usr/bin/env bash
# Session-16 GPU call (after staging MLX-CUDA: ../shared/tools/mlx-cuda-for-device.sh's parts; the last part's setup.sh first).
#   bash scripts/gpu_s16.sh 1   # parity (-m gpu) of the decode over codes inside one kernel (tests/test_coded_decode.py) and
#                               # the tile path; then one layer at 32k, B = 1 and 8, each method on the coded kernel and over
#                               # decoded tiles (--tiles), stock beside each (scripts/bench_tiles.py)
#   bash scripts/gpu_s16.sh 3   # parity of the coded path, where its time goes (scripts/profile_coded.py), the layer table again
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu_s16_versions.txt
python3 -c "import mlx.core as mx, importlib.metadata as m; print('mlx', mx.__version__, 'mlx-lm', m.version('mlx-lm'), mx.default_device())" | tee -a $OUT/gpu_s16_versions.txt
case "$1" in
  1) timeout ${T:-200} python3 -m pytest -q -p no:cacheprovider -x -m gpu tests/test_coded_decode.py tests/test_tiled_decode.py 2>&1 | tail -n 30 | tee $OUT/gpu_tests_s16.txt
     timeout ${TB:-300} python3 scripts/bench_tiles.py $OUT/tiles_coded_s16.json 32768 1,8 --tiles \
       "--methods=kivi;polar;gear;turboquant_rvq;qjl;rabitq" ;;
  3) timeout ${T:-150} python3 -m pytest -q -p no:cacheprovider -x -m gpu tests/test_coded_decode.py 2>&1 | tail -n 30 | tee $OUT/gpu_tests_s16c.txt
     timeout ${TP:-200} python3 scripts/profile_coded.py $OUT/profile_coded_s16.json 32768 1,8 ${SWEEP:-}
     timeout ${TB:-250} python3 scripts/bench_tiles.py $OUT/tiles_coded_s16c.json 32768 1,8 "--methods=${M:-kivi;polar;gear;turboquant_rvq;qjl;rabitq}" ;;
  4) timeout ${TP:-300} python3 scripts/profile_coded.py $OUT/profile_coded_s16d.json 32768 1,8 "${M:-kivi;polar;gear;turboquant_rvq;qjl;rabitq}" --sweep
     # the launch shape with the least summed kernel time at B = 8, then the layer table on it
     export CODED_SHAPE=$(python3 -c "
import json, collections; t = collections.Counter()
for r in json.load(open('$OUT/profile_coded_s16d.json'))['rows']:
    for x in r.get('sweep', []):
        t[(x['U'], x['NW'], x['groups'])] += x['kernel_us'] if x['kernel_us'] else 1e9
print(','.join(map(str, min(t, key=t.get))))")
     echo "CODED_SHAPE=$CODED_SHAPE"
     timeout ${TB:-200} python3 scripts/bench_tiles.py $OUT/tiles_coded_s16d.json 32768 1,8 "--methods=${M:-kivi;polar;gear;turboquant_rvq;qjl;rabitq}" ;;
  2) timeout ${TB:-500} python3 scripts/bench_tiles.py $OUT/tiles_coded_s16b.json 32768 1,8 "--methods=${M:-kivi;polar;gear;turboquant_rvq;qjl;rabitq}" ;;
esac
