"""How close reduced-precision decoding stays to eager plain greedy `generate`: ours, and transformers' compiled one.

In bfloat16 a verify forward over 16 rows and a 1-token decode forward round differently, so a near-tie can flip an
argmax; transformers' own compiled static-cache decoding rounds differently from its eager decoding too. Per prompt
(batch 1, greedy): eager plain `generate` is the reference; counted against it are our output (the CUDA-graph fast
path on a GPU) and `generate(cache_implementation="static")`; for each, how many outputs differ and, where one
does, after how many new tokens. Meant for bf16 on a GPU; a CPU run in float32 is a smoke run (nothing differs).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from . import harness


def first_difference(output: torch.Tensor, reference: torch.Tensor, prompt_len: int) -> int | None:
    """New-token index of the first difference (a length difference counts at the shorter end); None if equal."""
    a, b = output[0, prompt_len:].tolist(), reference[0, prompt_len:].tolist()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2", help="smollm2 (default), stories260k, or a path/id")
    parser.add_argument("--drafter", default=None, help="drafter directory (default: our SmolLM2 drafter)")
    parser.add_argument("--prompts", required=True, help="held-out prompts (not HumanEval, not training data)")
    parser.add_argument("--limit", type=int, default=8, help="number of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import at_least, check_device, check_drafter, check_model, check_prompts

    at_least("--limit", args.limit, 1)
    at_least("--max-new-tokens", args.max_new_tokens, 1)
    check_device("--device", args.device)
    check_prompts("--prompts", args.prompts)
    check_model("--target", args.target)
    check_drafter("--drafter", args.drafter)


def run(args: argparse.Namespace) -> int:
    from ..generate_cli import DEFAULT_DRAFTER
    from ..modeling import DFlashDraftModel
    from ..training.cli import load_target
    from ..training.data import encode_prompt, load_prompts

    device = args.device or harness.default_device()
    report = harness.header(args, device)
    texts = load_prompts(args.prompts)[: args.limit]
    target, tokenizer = load_target(args.target, device)
    drafter = DFlashDraftModel.from_pretrained(args.drafter or DEFAULT_DRAFTER).to(device, target.dtype)
    rows = []
    for text in texts:
        ids = torch.tensor([encode_prompt(tokenizer, text)], device=device)
        common = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
        eager = target.generate(ids, **common)
        ours = target.generate(ids, assistant_model=drafter, **common)
        static = target.generate(ids, cache_implementation="static", **common)
        rows.append({"prompt_tokens": ids.shape[1],
                     "dflash_first_difference": first_difference(ours, eager, ids.shape[1]),
                     "static_first_difference": first_difference(static, eager, ids.shape[1])})
        print(rows[-1], flush=True)
    summary = {name: sum(r[f"{name}_first_difference"] is not None for r in rows) for name in ("dflash", "static")}
    report.update(target=args.target, drafter=Path(str(args.drafter or DEFAULT_DRAFTER)).name,
                  dtype=str(target.dtype).replace("torch.", ""), prompts=args.prompts, outputs=len(rows),
                  max_new_tokens=args.max_new_tokens, differ_from_eager=summary, rows=rows)
    print(f"of {len(rows)} outputs, differing from eager plain greedy: ours {summary['dflash']}, compiled "
          f"static-cache generate {summary['static']}")
    harness.write_report(args.out, report)
    return 0
