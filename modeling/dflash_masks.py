"""Attention masks, one set of rules for both loops: the sliding window, the additive form, and the target's mask.

A sliding layer (one of the target's, or one of a drafter's own) lets a query at position p see positions
p - W + 1 .. p. The target's forward takes its masks as transformers' models do: one additive 4D mask for every
layer, or one per layer type where its config lists `layer_types` (a hybrid's linear-attention layers take a padding
mask or none there, never a 4D one). The two loops differ only in how they find what each query may see: the eager
loop from each sequence's positions in a 2D mask with holes, the fast path from its contiguous slots.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"


def pads_after_real_tokens(attention_mask: torch.Tensor) -> bool:
    """Whether a 2D attention mask (b, P) has padding after a real token in any row: anything but left padding."""
    real = attention_mask.bool()
    return bool((real[:, :-1] & ~real[:, 1:]).any())


def in_window(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int, causal: bool = True
) -> torch.Tensor:
    """Which keys a sliding layer lets each query see: the `window` positions up to and including its own, causal
    (for a DFlash drafter's block rows too, as z-lab's reference and vLLM run the published sliding-window drafters:
    benchmarks/families.md); or with `causal` False the positions less than `window` away on either side, as a DFlash2
    drafter's block rows see each other (the caller bounds the keys a block may see at all).
    query_positions (..., q), key_positions (..., kv) -> bool (..., q, kv)."""
    behind = query_positions[..., :, None] - key_positions[..., None, :]
    if not causal:
        return behind.abs() < window
    return (behind >= 0) & (behind < window)


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean (b, q, L) visibility as the additive (b, 1, q, L) mask every attention backend takes (eager
    attention would add a boolean one as 0/1)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
        ~visible, torch.finfo(dtype).min
    )[:, None]


def target_attention_mask(
    visible: torch.Tensor,
    windowed: torch.Tensor | None,
    mask_types: Iterable[str] | None,
    dtype: torch.dtype,
    linear_attention: torch.Tensor | None = None,
) -> torch.Tensor | dict[str, torch.Tensor | None]:
    """What the target's forward takes as `attention_mask`.

    Args:
        visible: bool (b, q, L), the keys each query sees under full attention.
        windowed: bool (b, q, L), the same within the sliding window; None when no layer slides.
        mask_types: the layer types the forward wants one mask each for (its config lists `layer_types`), or None
            for one mask for every layer (then every layer slides when `windowed` is given: a Mistral-style config).
        dtype: the additive masks' dtype (the target's).
        linear_attention: what linear-attention layers take instead (a padding mask (b, L), or None).
    """
    if mask_types is None:
        return additive_mask(visible if windowed is None else windowed, dtype)
    return {
        kind: linear_attention if kind == LINEAR else additive_mask(windowed if kind == SLIDING else visible, dtype)
        for kind in mask_types
    }


__all__ = ["FULL", "LINEAR", "SLIDING", "additive_mask", "in_window", "target_attention_mask"]
