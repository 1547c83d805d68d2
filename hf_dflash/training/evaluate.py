"""Acceptance length of a drafter on real decoding: tau = tokens committed per verify step (accepted drafts + 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .data import encode_prompt


@dataclass
class TauReport:
    mean_tau: float  # committed tokens / verify steps over all prompts
    per_prompt: list[float]
    verify_steps: int
    matches_greedy: bool  # every DFlash output equals plain greedy generate, token for token


@torch.no_grad()
def measure_tau(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    prompts: list[str] | list[list[int]],
    max_new_tokens: int,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> TauReport:
    """Greedy DFlash decoding of each prompt alone (batch 1), checked against plain greedy generate.

    Text prompts are encoded like the training prompts (`encode_prompt`: chat template if any) and need `tokenizer`.
    """
    committed, steps, per_prompt, identical = 0, 0, [], True
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt) if isinstance(prompt, str) else prompt
        input_ids = torch.tensor([ids], device=target.device)
        out = target.generate(
            input_ids=input_ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            assistant_model=drafter,
            return_dict_in_generate=True,
        )
        plain = target.generate(input_ids=input_ids, max_new_tokens=max_new_tokens, do_sample=False)
        identical &= torch.equal(out.sequences, plain)
        (lengths,) = out.acceptance_lengths
        committed, steps = committed + sum(lengths), steps + len(lengths)
        per_prompt.append(sum(lengths) / max(len(lengths), 1))
    return TauReport(committed / max(steps, 1), per_prompt, steps, identical)


__all__ = ["TauReport", "measure_tau"]
