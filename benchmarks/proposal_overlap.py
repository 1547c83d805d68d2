"""Would rejection sampling accept more drafts if the drafter's distribution went through the call's top-k / top-p
before drafts are drawn from it? Measured along the same sampled decoding, step by step.

Rejection sampling accepts draft row j with probability sum_x min(p_j(x), q_j(x)) (p the target's processed
distribution, q the proposal), whatever q is. At every verify step of a sampled generate call (Llama-3's or Qwen3's
sampling defaults), this computes that overlap for three proposals on the same rows:
- "drafter at temperature": q = softmax(drafter logits / T), what the step samples drafts from;
- "drafter through top-k/top-p": q = the same logits through the call's temperature, top-k and top-p;
- "drafter's argmax" (point mass): the probability p_j gives the drafter's argmax.
Reported: the mean overlap of the first draft row (exact: its prefix is the committed one) and the tau the rows'
overlaps imply if rows were accepted independently (1 + sum_j prod_{i<=j} a_i), beside the tau the call measured.

usage: python benchmarks/proposal_overlap.py [--prompts sharegpt:8] [--sampling llama3] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers.generation import logits_process as lp

from hf_dflash import DFlashDraftModel
from hf_dflash.bench import SAMPLING, run_environment
from hf_dflash.generate_cli import DEFAULT_DRAFTER, encode, load_target
from hf_dflash.modeling import dflash_decoding
from hf_dflash.modeling.dflash_acceptance import DecodingRule
from hf_dflash.modeling.dflash_processors import StepProcessors
from hf_dflash.training.data import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    parser.add_argument("--prompts", default="sharegpt:8", help="humaneval, sharegpt:N or a .jsonl file")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--sampling", choices=["llama3", "qwen3"], default="llama3")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    target, tokenizer = load_target(args.target, torch.float32, "cpu")
    drafter = DFlashDraftModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
    settings = {**SAMPLING[args.sampling]}
    settings.setdefault("top_k", 50)  # generate's default top-k, which it applies when a config leaves it unset
    warpers = StepProcessors([
        lp.TemperatureLogitsWarper(settings["temperature"]), lp.TopKLogitsWarper(settings["top_k"]),
        lp.TopPLogitsWarper(settings["top_p"]),
    ])

    # Spy on the eager loop: keep the drafter's logits of each step, and score each proposal where it accepts.
    draft_logits: list[torch.Tensor] = []
    overlaps: dict[str, list[torch.Tensor]] = {"drafter at temperature": [], "drafter through top-k/top-p": [],
                                               "drafter's argmax": []}
    propose, accept = DecodingRule.propose, dflash_decoding.accept

    def spying_propose(self, logits):
        draft_logits[:] = [logits]
        return propose(self, logits)

    def spying_accept(scores, drafts, do_sample, draft_probs):
        p = torch.softmax(scores[0, :-1], dim=-1)  # (B - 1, V): batch 1
        logits = draft_logits[0][0].float()
        shaped = torch.softmax(warpers(logits[None], torch.zeros(1, dtype=torch.long), None, drafts[:1])[0], dim=-1)
        overlaps["drafter at temperature"].append(torch.minimum(p, draft_probs[0]).sum(-1))
        overlaps["drafter through top-k/top-p"].append(torch.minimum(p, shaped).sum(-1))
        overlaps["drafter's argmax"].append(p.gather(-1, logits.argmax(-1, keepdim=True))[:, 0])
        return accept(scores, drafts, do_sample, draft_probs)

    DecodingRule.propose, dflash_decoding.accept = spying_propose, spying_accept
    taus = []
    try:
        for i, text in enumerate(load_prompts(args.prompts)[: args.limit]):
            torch.manual_seed(i)
            out = target.generate(**encode(tokenizer, text, "cpu"), assistant_model=drafter, return_dict_in_generate=True,
                                  max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.eos_token_id, **settings)
            taus += out.acceptance_lengths[0]
    finally:
        DecodingRule.propose, dflash_decoding.accept = propose, accept

    block = drafter.config.block_size
    proposals = {}
    for name, rows in overlaps.items():
        full = torch.stack([r for r in rows if r.numel() == block - 1])  # steps with every row (not cut by the length)
        proposals[name] = {"first_row": full[:, 0].mean().item(), "all_rows": full.mean().item(),
                           "implied_tau": 1 + full.cumprod(dim=1).sum(dim=1).mean().item()}
    result = {
        **run_environment("cpu"), "command": " ".join(["python", *sys.argv]), "target": args.target, "drafter": Path(args.drafter).name,
        "prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens, "settings": settings,
        "steps": len(taus), "measured_tau": sum(taus) / len(taus), "proposals": proposals,
    }
    path = Path(__file__).parent / "results" / f"proposal_overlap_{args.target}_{args.sampling}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
