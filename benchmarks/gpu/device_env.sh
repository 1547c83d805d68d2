#!/usr/bin/env bash
# Source on the GPU machine (the `device` tool's H200) from the repository root:
#   - installs carried wheels (.whl/, e.g. gguf) into /tmp/site, and hf-dflash itself without dependencies;
#   - assembles the SmolLM2 GGUF from ~/stage/part00 (an earlier call) and .stage/b/part01 when both are there,
#     checks its sha256 and points HF_DFLASH_SMOLLM2_GGUF at it.
# See ../shared/gpu/README.md for why the GGUF travels in two halves.
set -e
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
    || { ln -sfn ../modeling hf_dflash/modeling; export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; }
if [ ! -f ~/smol.gguf ] && [ -f ~/stage/part00 ] && [ -f .stage/b/part01 ]; then
    cat ~/stage/part00 .stage/b/part01 > ~/smol.gguf
fi
if [ -f ~/smol.gguf ]; then
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $HOME/smol.gguf" | sha256sum -c --quiet -
    export HF_DFLASH_SMOLLM2_GGUF=~/smol.gguf
fi
set +e
