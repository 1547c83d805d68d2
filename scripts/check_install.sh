#!/usr/bin/env bash
# The package as a user installs it: build the wheel from this checkout, install it (not editable) into a fresh
# virtual environment, and from a directory outside the checkout run `hf-dflash --help`, `hf-dflash info` on a
# published config with the Hub offline, and a tiny generation on the stories260K target the package ships.
# usage: scripts/check_install.sh [TRANSFORMERS_VERSION]   (default 5.25.0; torch 2.13.0 as in setup_env.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
transformers_version=${1:-5.25.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Build from a copy of the files git knows (tracked or new, not ignored), as a fresh clone would have them, so a
# stale build/ folder or a virtual environment in the checkout cannot reach the wheel.
mkdir "$work/src" "$work/wheel"
git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
    | tar --null -T - -cf - | tar -xf - -C "$work/src"
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
pip=("$py" -m pip install -q --disable-pip-version-check)
"$py" -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/wheel" "$work/src"
wheel=$(ls "$work"/wheel/hf_dflash-*.whl)
"${pip[@]}" "torch==2.13.0" "transformers==$transformers_version" "$wheel[local]"
echo "check_install: installed $(basename "$wheel") with transformers $transformers_version"

cd "$work"  # outside the checkout: only the installed copy can be imported
export HF_HUB_OFFLINE=1
"$work/venv/bin/hf-dflash" --help > /dev/null
"$work/venv/bin/hf-dflash" info z-lab/Qwen3-8B-DFlash-b16
# A random drafter for stories260K, saved the way users save theirs; `generate` stops with an error if the DFlash
# output differs from plain greedy generate.
"$py" - "$work/stories260k-drafter" <<'EOF'
import sys
from pathlib import Path

import torch

import hf_dflash
from hf_dflash.bundled_models import load_stories260k, stories260k_gguf_path

site = Path(hf_dflash.__file__).resolve().parents[1]
assert site.name == "site-packages", f"hf_dflash imported from {hf_dflash.__file__}, not from the installed wheel"
assert stories260k_gguf_path().is_relative_to(site), f"stories260K read from {stories260k_gguf_path()}"
target, _ = load_stories260k()
torch.manual_seed(0)
config = hf_dflash.DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=0)
hf_dflash.DFlashDraftModel(config).save_pretrained(sys.argv[1])
EOF
"$work/venv/bin/hf-dflash" generate --target stories260k --drafter "$work/stories260k-drafter" \
    --prompt "Once upon a time" --max-new-tokens 24 --device cpu
echo "check_install: passed (hf-dflash --help, info offline, generate on stories260K from the installed wheel)"
