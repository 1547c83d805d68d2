# Source on the GPU machine (the `device` tool's H200) from the repository root:
#   - installs carried wheels (.whl/, e.g. gguf) into /tmp/site, and hf-dflash itself without dependencies;
#   - collects the SmolLM2 GGUF's parts (.stage/*/partNN, one per call: a call carries at most 64 MiB with the
#     working tree) in ~/stage, assembles them once all three are there, checks the sha256 and points
#     HF_DFLASH_SMOLLM2_GGUF at the file. Split it with: split -b 33000000 -d -a 2 SmolLM2...gguf part
#     and put partNN under .stage/{a,b,c}/ (see ../shared/gpu/README.md for the wheel it comes from).
set -e
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 \
    || { ln -sfn ../modeling hf_dflash/modeling; export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; }
mkdir -p ~/stage
for part in .stage/*/part*; do
    if [ -f "$part" ]; then cp "$part" ~/stage/; fi
done
if [ ! -f ~/smol.gguf ] && [ "$(ls ~/stage/part* 2>/dev/null | wc -l)" -eq 3 ]; then
    cat ~/stage/part* > ~/smol.gguf
fi
if [ -f ~/smol.gguf ]; then
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $HOME/smol.gguf" | sha256sum -c --quiet -
    export HF_DFLASH_SMOLLM2_GGUF=~/smol.gguf
fi
set +e
