"""The eager loop's prompt forward: the target reads the left-padded prompts into transformers' cache while hooks
capture the drafter's layers, the prompts' real rows become drafter context, and each sequence's first token is chosen
under the call's processors exactly as plain generate chooses it (every processor called once on the whole batch).
The engine prefills its rows itself, into its pools (dflash_engine.py).

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

from typing import Any

import torch

from .dflash_acceptance import accept
from .dflash_candidate_generator import DFlashCandidateGenerator
from .dflash_processors import StepProcessors


def prompt_positions(attention_mask: torch.Tensor) -> torch.LongTensor:
    """Absolute positions of the real tokens of left-padded rows (padding gets position 0, as in generate)."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


@torch.no_grad()
def prefill(
    target: torch.nn.Module,
    generator: DFlashCandidateGenerator,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor,
    cache: dict[str, Any],
    processors: StepProcessors,
    do_sample: bool,
) -> tuple[torch.LongTensor, torch.Tensor, torch.Tensor]:
    """The prompt forward. input_ids (b, P); attention_mask (b, P) 1 for real tokens (left padding 0); `cache`:
    {the forward's argument name: transformers' cache}.

    Returns (first tokens (b,), their processed scores (b, 1, V), the raw logits (b, 1, V)).
    """
    generator.capture_rows(input_ids.shape[1])
    logits = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=prompt_positions(attention_mask),
        use_cache=True,
        logits_to_keep=1,
        **cache,
    ).logits[:, -1:]
    generator.commit_prefill(attention_mask)
    scores = processors.first_token_scores(input_ids, logits[:, 0])[:, None]
    tokens, _ = accept(scores, input_ids[:, :0], do_sample, None)
    return tokens[:, 0], scores, logits


__all__ = ["prefill", "prompt_positions"]
