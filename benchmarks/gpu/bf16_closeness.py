"""How close bf16 decoding stays to eager plain greedy `generate`, for SmolLM2 + its drafter on the GPU.

In bfloat16 a verify forward over 16 rows and a 1-token decode forward round differently, so a near-tie can flip
an argmax; transformers' own compiled static-cache decoding rounds differently from its eager decoding too. Per
prompt (batch 1, greedy): eager plain `generate` is the reference; counted against it are our DFlash output (the
CUDA-graph fast path) and `generate(cache_implementation="static")` (compiled); for each, how many outputs
differ and, where one does, after how many new tokens.

    python benchmarks/gpu/bf16_closeness.py --drafter DRAFTER --prompts heldout.jsonl.gz --out closeness.json
"""

from __future__ import annotations

import argparse
import json

import torch

from hf_dflash.bench import run_environment
from hf_dflash.modeling import DFlashDraftModel
from hf_dflash.training.cli import load_target
from hf_dflash.training.data import encode_prompt, load_prompts


def first_difference(output: torch.Tensor, reference: torch.Tensor, prompt_len: int) -> int | None:
    """New-token index of the first difference (a length difference counts at the shorter end); None if equal."""
    a, b = output[0, prompt_len:].tolist(), reference[0, prompt_len:].tolist()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompts", required=True, help="held-out prompts (not HumanEval, not training data)")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", required=True)
    parser.add_argument("--target", default="smollm2", help="a bundled target (stories260k for a CPU smoke run)")
    parser.add_argument("--device", default="cuda", help="cpu runs float32: a smoke run of the script only")
    args = parser.parse_args()
    target, tokenizer = load_target(args.target, args.device)
    drafter = DFlashDraftModel.from_pretrained(args.drafter).to(args.device, target.dtype)
    rows = []
    for prompt in load_prompts(args.prompts)[: args.limit]:
        ids = torch.tensor([encode_prompt(tokenizer, prompt)], device=args.device)
        common = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
        eager = target.generate(ids, **common)
        ours = target.generate(ids, assistant_model=drafter, **common)
        static = target.generate(ids, cache_implementation="static", **common)
        rows.append({"prompt_tokens": ids.shape[1],
                     "dflash_first_difference": first_difference(ours, eager, ids.shape[1]),
                     "static_first_difference": first_difference(static, eager, ids.shape[1])})
        print(json.dumps(rows[-1]), flush=True)
    summary = {name: sum(r[f"{name}_first_difference"] is not None for r in rows) for name in ("dflash", "static")}
    report = {**run_environment(args.device), "target": args.target, "drafter": args.drafter, "prompts": args.prompts, "outputs": len(rows),
              "max_new_tokens": args.max_new_tokens, "differ_from_eager": summary, "rows": rows}
    print(f"of {len(rows)} outputs, differing from eager plain greedy: DFlash fast path {summary['dflash']}, "
          f"compiled static-cache generate {summary['static']}")
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
