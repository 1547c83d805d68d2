# Source on the GPU machine (README.md beside this file) from the repository root, first in every call:
#   - installs carried wheels (.whl/, e.g. gguf) into /tmp/site, and hf-dflash itself without dependencies;
#   - collects the SmolLM2 GGUF's parts (.stage/*/partNN, one per call: a call carries at most 64 MiB with the
#     working tree; benchmarks/gpu/stage_smollm2.sh makes three or four) in ~/stage, assembles them once their
#     sha256 is the GGUF's, and points HF_DFLASH_SMOLLM2_GGUF at the file. Until then it says how many parts it has.
set -e
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
    || { ln -sfn ../modeling hf_dflash/modeling; export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; }
mkdir -p ~/stage
for part in .stage/*/part*; do
    if [ -f "$part" ]; then cp "$part" ~/stage/; fi
done
smollm2_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ ! -f ~/smol.gguf ] && ls ~/stage/part* >/dev/null 2>&1; then
    cat ~/stage/part* > ~/smol.gguf.tmp
    if [ "$(sha256sum < ~/smol.gguf.tmp | cut -d' ' -f1)" = "$smollm2_sha" ]; then
        mv ~/smol.gguf.tmp ~/smol.gguf
    else
        rm -f ~/smol.gguf.tmp
        echo "device_env: $(ls ~/stage/part* | wc -l) GGUF part(s) in ~/stage, not yet the whole file"
    fi
fi
if [ -f ~/smol.gguf ]; then
    export HF_DFLASH_SMOLLM2_GGUF=~/smol.gguf
fi
set +e
