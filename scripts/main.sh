#!/usr/bin/env bash
# The main job: SmolLM2-135M-Instruct with our trained DFlash drafter, against plain generate, on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh .venv 5.25.0
.venv/bin/hf-dflash generate "$@"
