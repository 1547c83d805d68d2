"""What drawing a sampled step's tokens costs with each of `sample`'s two exact rules, alone and in whole calls.

`sample` (modeling/dflash_acceptance.py) draws one token per row by the exponential race or by the inverse CDF;
a call uses the inverse CDF on a CPU and the race elsewhere. In one process:
1. the rules alone: one call on the rows a verify step samples (batch x block rows of the drafter's vocabulary, a
   top-p-like distribution), median ms, at batch 1, 4 and 16;
2. whole calls: the target's sampled generate with the drafter (Llama-3's sampling defaults: temperature 0.6,
   top-p 0.9), ms per verify step with each rule forced, the rules alternated round after round (so drift of a
   shared machine shows as a gap between rounds), beside our greedy step and plain sampled generate's ms per token
   on the same prompts, batch 1.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from . import harness
from .published import SAMPLING

BATCHES = (1, 4, 16)


def rule_alone_ms(rule: Any, rows: int, vocab: int, device: str) -> float:
    """Median ms of one call on `rows` rows of a top-p-like distribution (most of each row zero)."""
    probs = torch.softmax(torch.randn(rows, vocab, device=device) * 6, dim=-1)
    probs[probs < probs.topk(50, dim=-1).values[:, -1:]] = 0
    return harness.time_call(lambda: rule(probs), repeats=20).median_ms


def decode_ms(target: Any, drafter: Any, prompts: list[dict], max_new_tokens: int, **settings: Any
              ) -> dict[str, float]:
    """ms per verify step (per token without a drafter) and tau over the prompts, one by one, each call seeded."""
    seconds, steps, tokens = 0.0, 0, 0
    for i, ids in enumerate(prompts):
        torch.manual_seed(i)
        out, took = harness.timed(lambda: target.generate(
            **ids, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
            **({"assistant_model": drafter} if drafter is not None else {}), **settings,
        ))
        seconds += took
        new = out.sequences.shape[1] - ids["input_ids"].shape[1]
        tokens += new
        steps += len(out.acceptance_lengths[0]) if drafter is not None else new
    return {"ms_per_step": 1000 * seconds / steps, "tau": tokens / steps}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2", help="smollm2 (default), stories260k, or a path/id")
    parser.add_argument("--drafter", default=None, help="drafter directory (default: our SmolLM2 drafter)")
    parser.add_argument("--prompts", default="sharegpt:8", help="humaneval, sharegpt:N or a .jsonl file")
    parser.add_argument("--limit", type=int, default=8, help="number of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the two rules, alternated")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import at_least, check_device, check_drafter, check_model, check_prompts

    for option in ("limit", "max_new_tokens", "rounds"):
        at_least("--" + option.replace("_", "-"), getattr(args, option), 1)
    check_device("--device", args.device)
    check_prompts("--prompts", args.prompts)
    check_model("--target", args.target)
    check_drafter("--drafter", args.drafter)


def run(args: argparse.Namespace) -> int:
    from ..generate_cli import DEFAULT_DRAFTER, encode, load_target
    from ..modeling import DFlashDraftModel, dflash_acceptance
    from ..modeling.dflash_fast_path import release_fast_path
    from ..training.data import load_prompts

    device = args.device or harness.default_device()
    report = harness.header(args, device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    texts = load_prompts(args.prompts)[: args.limit]
    target, tokenizer = load_target(args.target, dtype, device)
    drafter = DFlashDraftModel.from_pretrained(args.drafter or DEFAULT_DRAFTER, dtype=dtype).to(device).eval()
    prompts = [encode(tokenizer, text, device) for text in texts]
    vocab, block = drafter.config.vocab_size, drafter.config.block_size
    pad = dict(pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    rules = {"exponential race": dflash_acceptance.exponential_race_sample,
             "inverse CDF": dflash_acceptance.inverse_cdf_sample}
    alone = {name: {f"{batch} x {block} rows": rule_alone_ms(rule, batch * block, vocab, device) for batch in BATCHES}
             for name, rule in rules.items()}
    print(alone, flush=True)

    sampled = {**SAMPLING["llama3"], **pad}
    device_rule = dflash_acceptance.sample  # what a call uses on this device

    def forced(rule: Any) -> Any:
        def whole_calls() -> dict[str, float]:
            release_fast_path(drafter)  # a held CUDA graph keeps the rule it was recorded with
            dflash_acceptance.sample = rule
            try:
                return decode_ms(target, drafter, prompts, args.max_new_tokens, **sampled)
            finally:
                dflash_acceptance.sample = device_rule

        return whole_calls

    decode_ms(target, drafter, prompts[:1], 8, **sampled)  # warm-up (and any compile)
    whole = harness.alternate({name: forced(rule) for name, rule in rules.items()}, args.rounds)
    release_fast_path(drafter)
    greedy = decode_ms(target, drafter, prompts, args.max_new_tokens, do_sample=False, **pad)
    plain = decode_ms(target, None, prompts, args.max_new_tokens, **sampled)
    report.update(target=args.target,
                  drafter=Path(str(args.drafter or DEFAULT_DRAFTER)).name, dtype=str(dtype).replace("torch.", ""),
                  prompts=args.prompts, limit=len(prompts), max_new_tokens=args.max_new_tokens,
                  sampling=SAMPLING["llama3"], rule_alone_ms=alone, sampled_step=whole, greedy_step=greedy,
                  plain_sampled_ms_per_token=plain["ms_per_step"])
    harness.write_report(args.out, report, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    shapes = list(next(iter(report["rule_alone_ms"].values())))
    harness.grouped_bars(left, shapes, {name: [costs[s] for s in shapes] for name, costs in
                                        report["rule_alone_ms"].items()}, "ms per call (median)")
    left.set_yscale("log")
    left.set_title(f"one draw per row, the drafter's vocabulary ({report['machine']}, {report['threads']} threads)",
                   fontsize=9)
    bars = {f"sampled,\n{name}": statistics.mean(r["ms_per_step"] for r in runs)
            for name, runs in report["sampled_step"].items()}
    bars["greedy"] = report["greedy_step"]["ms_per_step"]
    bars["plain sampled\n(per token)"] = report["plain_sampled_ms_per_token"]
    right.bar(range(len(bars)), list(bars.values()), color=["C0", "C1", "C2", "C7"])
    right.set_xticks(range(len(bars)), list(bars), fontsize=8)
    right.set_ylabel("ms per verify step")
    right.set_title(f"{report['target']} + {report['drafter']}, {report['dtype']}, batch 1, "
                    f"{report['max_new_tokens']} new tokens", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
