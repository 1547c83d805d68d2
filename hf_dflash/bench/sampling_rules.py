"""Which exact rule under sampling accepts more: tau of each rule, and the acceptance each proposal would get.

Both rules are exact: rejection sampling (drafts drawn from the drafter, residual resampling; the default) and the
point mass (`dflash_sampling="point_mass"`: the drafter's argmax, accepted when it equals the target's own sample).
1. Measured: the same prompts, one by one, decoded with each rule under a family's sampling defaults (`--sampling`),
   the rules alternated within each seed; tau per rule.
2. With `--overlaps`: rejection sampling accepts draft row j with probability sum_x min(p_j(x), q_j(x)) (p the
   target's processed distribution, q the proposal). At every verify step of the rejection-sampled calls, that
   overlap for three proposals on the same rows: the drafter at the call's temperature (what the step
   samples drafts from), the drafter through the call's temperature, top-k and top-p, and the drafter's argmax (the
   point mass). Reported: the mean overlap of the first draft row (exact: its prefix is the committed one), of all
   rows, and the tau the rows' overlaps imply if rows were accepted independently (1 + sum_j prod_{i<=j} a_i).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from . import harness
from .published import SAMPLING

RULES = ("rejection", "point_mass")
PROPOSALS = ("drafter at temperature", "drafter through top-k/top-p", "drafter's argmax")


def measured_tau(target: Any, drafter: Any, prompts: list[dict], args: argparse.Namespace, settings: dict
                 ) -> dict[str, float]:
    """tau of each rule over the prompts and seeds (each call seeded by its seed and prompt)."""
    lengths: dict[str, list[int]] = {rule: [] for rule in RULES}
    for seed in range(args.seeds):
        for rule in RULES:
            for i, ids in enumerate(prompts):
                torch.manual_seed(seed * len(prompts) + i)
                out = target.generate(**ids, assistant_model=drafter, dflash_sampling=rule,
                                      return_dict_in_generate=True, max_new_tokens=args.max_new_tokens, **settings)
                lengths[rule] += out.acceptance_lengths[0]
    return {rule: sum(values) / len(values) for rule, values in lengths.items()}


def proposal_overlaps(target: Any, drafter: Any, prompts: list[dict], args: argparse.Namespace, settings: dict
                      ) -> dict[str, Any]:
    """The overlaps of PROPOSALS at every step of rejection-sampled calls (see the module docstring)."""
    from transformers.generation import logits_process as lp

    from ..modeling import dflash_step
    from ..modeling.dflash_acceptance import DecodingRule
    from ..modeling.dflash_processors import StepProcessors

    top_k = settings.get("top_k", 50)  # generate's default top-k, which it applies when a config leaves it unset
    warpers = StepProcessors([lp.TemperatureLogitsWarper(settings["temperature"]), lp.TopKLogitsWarper(top_k),
                              lp.TopPLogitsWarper(settings.get("top_p", 1.0))])
    draft_logits: list[torch.Tensor] = []
    overlaps: dict[str, list[torch.Tensor]] = {name: [] for name in PROPOSALS}
    propose, accept = DecodingRule.propose, dflash_step.accept

    def spying_propose(self: Any, logits: torch.Tensor) -> Any:
        draft_logits[:] = [logits]
        return propose(self, logits)

    def spying_accept(scores: torch.Tensor, drafts: torch.Tensor, do_sample: bool, draft_probs: torch.Tensor) -> Any:
        p = torch.softmax(scores[0, :-1], dim=-1)  # (n - 1, V): batch 1, the rows this step verifies
        logits = draft_logits[0][0, : drafts.shape[1]].float()  # the drafter proposed all B - 1 rows
        shaped = torch.softmax(warpers(logits[None], torch.zeros(1, dtype=torch.long), None, drafts[:1])[0], dim=-1)
        overlaps["drafter at temperature"].append(torch.minimum(p, draft_probs[0]).sum(-1))
        overlaps["drafter through top-k/top-p"].append(torch.minimum(p, shaped).sum(-1))
        overlaps["drafter's argmax"].append(p.gather(-1, logits.argmax(-1, keepdim=True))[:, 0])
        return accept(scores, drafts, do_sample, draft_probs)

    DecodingRule.propose, dflash_step.accept = spying_propose, spying_accept
    try:
        for i, ids in enumerate(prompts):
            torch.manual_seed(i)
            target.generate(**ids, assistant_model=drafter, max_new_tokens=args.max_new_tokens, **settings)
    finally:
        DecodingRule.propose, dflash_step.accept = propose, accept
    block = drafter.config.block_size
    result = {}
    for name, rows in overlaps.items():
        full = torch.stack([r for r in rows if r.numel() == block - 1])  # steps with every row (not cut by length)
        result[name] = {"first_row": full[:, 0].mean().item(), "all_rows": full.mean().item(),
                        "implied_tau": 1 + full.cumprod(dim=1).sum(dim=1).mean().item()}
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2", help="smollm2 (default), stories260k, or a path/id")
    parser.add_argument("--drafter", default=None, help="drafter directory (default: our SmolLM2 drafter)")
    parser.add_argument("--prompts", default="sharegpt:8", help="humaneval, sharegpt:N or a .jsonl file")
    parser.add_argument("--limit", type=int, default=8, help="number of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--sampling", choices=[name for name in SAMPLING if name != "greedy"], default="llama3",
                        help="the family's published sampling defaults (llama3: temperature 0.6, top_p 0.9; qwen3: "
                        "temperature 0.6, top_k 20, top_p 0.95)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per rule")
    parser.add_argument("--overlaps", action="store_true", help="also each proposal's acceptance per draft row")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import at_least, check_device, check_drafter, check_model, check_prompts

    for option in ("limit", "max_new_tokens", "seeds"):
        at_least("--" + option.replace("_", "-"), getattr(args, option), 1)
    check_device("--device", args.device)
    check_prompts("--prompts", args.prompts)
    check_model("--target", args.target)
    check_drafter("--drafter", args.drafter)


def run(args: argparse.Namespace) -> int:
    from ..generate_cli import DEFAULT_DRAFTER, encode, load_target
    from ..modeling import DFlashDraftModel
    from ..training.data import load_prompts

    device = args.device or harness.default_device()
    report = harness.header(args, device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    texts = load_prompts(args.prompts)[: args.limit]
    target, tokenizer = load_target(args.target, dtype, device)
    drafter = DFlashDraftModel.from_pretrained(args.drafter or DEFAULT_DRAFTER, dtype=dtype).to(device).eval()
    prompts = [encode(tokenizer, text, device) for text in texts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    settings = {**SAMPLING[args.sampling], "pad_token_id": pad}
    report.update(target=args.target, drafter=Path(str(args.drafter or DEFAULT_DRAFTER)).name,
                  dtype=str(dtype).replace("torch.", ""), prompts=args.prompts, limit=len(prompts),
                  max_new_tokens=args.max_new_tokens, settings=SAMPLING[args.sampling], seeds=args.seeds,
                  tau=measured_tau(target, drafter, prompts, args, settings))
    print(f"tau: {report['tau']}", flush=True)
    if args.overlaps:
        report["proposals"] = proposal_overlaps(target, drafter, prompts, args, settings)
        print(f"proposals: {report['proposals']}", flush=True)
    harness.write_report(args.out, report, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    fig, axis = plt.subplots(figsize=(7, 3.6))
    bars = {f"measured, {rule}": tau for rule, tau in report["tau"].items()}
    bars.update({f"implied, {name}": values["implied_tau"] for name, values in report.get("proposals", {}).items()})
    axis.bar(range(len(bars)), list(bars.values()))
    axis.set_xticks(range(len(bars)), list(bars), fontsize=7, rotation=15)
    axis.set_ylabel("tau")
    axis.set_title(f"{report['target']} + {report['drafter']}, {report['settings']}, {report['machine']} "
                   f"({report['date'][:10]})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
