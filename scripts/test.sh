#!/usr/bin/env bash
# The test suite, at both ends of the supported transformers range (5.17 and the newest 5.x that installs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh .venv 5.24.0
bash scripts/setup_env.sh .venv-5.17 5.17.0
echo "== transformers 5.24.0 =="
.venv/bin/python -m pytest -q "$@"
echo "== transformers 5.17.0 =="
.venv-5.17/bin/python -m pytest -q "$@"
