"""The DFlash training objective (the paper's recipe as SpecForge reproduces it).

Per sequence (right-padded to length L in a batch of b):
1. One frozen target forward over the whole sequence captures the hidden states at `target_layer_ids` (the
   OUTPUTS of those decoder layers): the context rows, (b, L, k*H).
2. Up to `max_anchors` random anchors a, drawn without replacement among positions where token a and token a + 1
   are both in the loss mask (a is an answer token, and its block has at least one label).
3. Each anchor gets a block [token[a], MASK x (B - 1)] at positions a + 0..B-1, embedded with the target's input
   embedding. All nA blocks of a sequence go through the drafter in one forward: queries are the nA*B block rows,
   keys/values are [L context rows ; nA*B block rows].
4. Attention: a block row sees context positions STRICTLY before its anchor (c < a: at decode time the anchor's own
   hidden state is not known yet when its block is drafted) and every row of its own block; nothing else.
5. Labels: row k >= 1 -> token[a + k] (the same position the row sits at; row 0 only echoes the anchor), kept only
   where a + k is inside the loss mask (which is 0 on padding, so past the sequence end too).
6. Loss: cross-entropy of target.lm_head(drafter rows), row k weighted by exp(-(k - 1) / gamma).

Two reproductions lost most of their acceptance to a label shifted by one and to `<=` in the context rule: the
slow references in tests/test_training.py pin both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling import DFlashConfig
from ..modeling.dflash_capture import TargetHiddenCapture

IGNORE = -100
# Published decay per block size (SpecForge); other sizes interpolate linearly between them, clamped at the ends.
PUBLISHED_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def default_gamma(block_size: int) -> float:
    sizes = sorted(PUBLISHED_GAMMA)
    size = min(max(block_size, sizes[0]), sizes[-1])
    for lo, hi in zip(sizes, sizes[1:]):
        if lo <= size <= hi:
            return PUBLISHED_GAMMA[lo] + (size - lo) * (PUBLISHED_GAMMA[hi] - PUBLISHED_GAMMA[lo]) / (hi - lo)
    raise AssertionError("unreachable: size is clamped into the published range")


def row_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(B,) loss weight per block row: 0 for the anchor row, exp(-(k - 1) / gamma) for row k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros(()))


def sample_anchors(
    loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors per sequence, without replacement, sorted by position.

    loss_mask (b, L) -> anchors (b, nA) long and keep (b, nA) bool, nA = min(max_anchors, most candidates in the
    batch). Sequences with fewer candidates are padded with anchor 0, keep False (no labels, no loss).
    """
    candidates = torch.zeros_like(loss_mask, dtype=torch.bool)
    candidates[:, :-1] = (loss_mask[:, :-1] > 0) & (loss_mask[:, 1:] > 0)
    num = min(max_anchors, int(candidates.sum(1).max()))
    if num == 0:
        raise ValueError("no anchor candidates in this batch: every sequence needs two answer tokens in a row")
    scores = torch.rand(loss_mask.shape, generator=generator, device=loss_mask.device)
    scores = scores.masked_fill(~candidates, 2.0)  # non-candidates sort last
    picked = scores.argsort(dim=1)[:, :num]  # (b, nA) a random subset, candidates first
    keep = candidates.gather(1, picked)
    anchors = torch.where(keep, picked, torch.zeros_like(picked))
    # Sort by position (dropped slots last), which keeps the flex block mask sparse and the layout readable.
    order = torch.where(keep, anchors, torch.full_like(anchors, loss_mask.shape[1])).argsort(dim=1)
    return anchors.gather(1, order), keep.gather(1, order)


@dataclass
class Blocks:
    """Drafter inputs and labels for nA anchors per sequence, block size B."""

    block_ids: torch.Tensor  # (b, nA*B) [token[a], MASK x (B-1)] per anchor
    position_ids: torch.Tensor  # (b, L + nA*B) context rows 0..L-1, then a + 0..B-1 per block
    labels: torch.Tensor  # (b, nA, B) token[a + k] or IGNORE
    anchors: torch.Tensor  # (b, nA)


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> Blocks:
    batch, seq_len = input_ids.shape
    offsets = torch.arange(block_size, device=input_ids.device)
    block_ids = torch.full((*anchors.shape, block_size), mask_token_id, device=input_ids.device)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    positions = anchors[:, :, None] + offsets  # (b, nA, B)
    inside = positions < seq_len
    at = positions.clamp(max=seq_len - 1).flatten(1)
    labeled = inside & (loss_mask.gather(1, at).view_as(positions) > 0) & keep[:, :, None] & (offsets >= 1)
    labels = torch.where(labeled, input_ids.gather(1, at).view_as(positions), IGNORE)
    context_positions = torch.arange(seq_len, device=input_ids.device).expand(batch, seq_len)
    return Blocks(
        block_ids=block_ids.flatten(1),
        position_ids=torch.cat([context_positions, positions.flatten(1)], dim=1),
        labels=labels,
        anchors=anchors,
    )


def block_mask_mod(anchors: torch.Tensor, seq_len: int, block_size: int) -> Callable:
    """FlexAttention mask_mod: query row q (block q // B) may see key column kv (context < L, then block rows)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        block = q // block_size
        sees_context = (kv < seq_len) & (kv < anchors[b, block])  # strictly before the anchor
        own_block = (kv >= seq_len) & ((kv - seq_len) // block_size == block)
        return sees_context | own_block

    return mask_mod


def dense_block_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """The same rule as a boolean (b, 1, nA*B, L + nA*B) mask (True = may attend), for small CPU runs."""
    num_rows = anchors.shape[1] * block_size
    q = torch.arange(num_rows, device=anchors.device)[:, None]
    kv = torch.arange(seq_len + num_rows, device=anchors.device)[None, :]
    batch = torch.arange(anchors.shape[0], device=anchors.device)[:, None, None]
    return block_mask_mod(anchors, seq_len, block_size)(batch, None, q[None], kv[None])[:, None]


def flex_block_mask(anchors: torch.Tensor, seq_len: int, block_size: int):
    """The same rule as a FlexAttention BlockMask: memory and compute scale with the visible tiles only."""
    from torch.nn.attention.flex_attention import create_block_mask

    num_rows = anchors.shape[1] * block_size
    return create_block_mask(
        block_mask_mod(anchors, seq_len, block_size),
        B=anchors.shape[0],
        H=None,
        Q_LEN=num_rows,
        KV_LEN=seq_len + num_rows,
        device=anchors.device,
    )


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    tau: torch.Tensor  # scalar: simulated acceptance length, mean over blocks with a label
    num_blocks: int


def block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> LossOutput:
    """logits (b, nA, B, V) of all rows, labels (b, nA, B), weights (B,) -> weighted CE and simulated tau.

    Simulated tau per block: the leading rows k = 1.. whose argmax equals the label, plus 1 (the bonus token), as
    greedy verification would commit them.
    """
    valid = labels != IGNORE
    ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten().clamp(min=0), reduction="none")
    w = weights.to(logits.device) * valid
    loss = (ce.view_as(w) * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hits = (logits.argmax(-1) == labels) & valid
        accepted = hits[:, :, 1:].long().cumprod(dim=2).sum(dim=2)  # (b, nA)
        has_label = valid[:, :, 1]
        tau = (accepted + 1).float()[has_label].mean()
    return LossOutput(loss=loss, tau=tau, num_blocks=int(has_label.sum()))


def freeze(target: nn.Module) -> nn.Module:
    """The target is frozen entirely, its embedding and lm_head included."""
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target


class DFlashObjective:
    """Computes the loss of a batch: one target forward for context, one drafter forward for all blocks.

    `attention`: "dense" (a boolean mask, for the default sdpa/eager attention) or "flex" (a FlexAttention
    BlockMask, for a drafter set to `set_attn_implementation("flex_attention")`; GPU only, head dim >= 16).
    """

    def __init__(
        self,
        target: nn.Module,
        drafter_config: DFlashConfig,
        max_anchors: int = 512,
        gamma: float | None = None,
        attention: str = "dense",
    ):
        if attention not in ("dense", "flex"):
            raise ValueError(f"attention must be 'dense' or 'flex', got {attention!r}")
        if "sliding_attention" in drafter_config.layer_types:
            raise NotImplementedError("training sliding-window drafters needs a windowed block mask; not built yet")
        self.target = freeze(target)
        self.config = drafter_config
        self.max_anchors = max_anchors
        self.attention = attention
        self.weights = row_weights(drafter_config.block_size, gamma or default_gamma(drafter_config.block_size))
        self.capture = TargetHiddenCapture(target, drafter_config.target_layer_ids, drafter_config.target_hidden_size)

    @torch.no_grad()
    def context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(b, L, k*H) target hidden states at the drafter's layers, from one forward over the whole sequence."""
        batch, seq_len = input_ids.shape
        dtype = self.target.get_input_embeddings().weight.dtype
        rows = torch.empty(batch, seq_len, self.config.num_context_features, dtype=dtype, device=input_ids.device)
        with self.capture:
            self.capture.destination = rows
            # The decoder alone: the target's logits are never needed, and at 150k vocab they would be costly.
            self.target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return rows

    def __call__(
        self, drafter: nn.Module, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None
    ) -> LossOutput:
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        seq_len, block_size = input_ids.shape[1], self.config.block_size
        context = self.context(input_ids, batch["attention_mask"])
        anchors, keep = sample_anchors(loss_mask, self.max_anchors, generator)
        blocks = build_blocks(input_ids, loss_mask, anchors, keep, block_size, self.config.mask_token_id)
        if self.attention == "flex":
            mask = flex_block_mask(anchors, seq_len, block_size)
        else:
            mask = dense_block_mask(anchors, seq_len, block_size)
        with torch.no_grad():
            noise = self.target.get_input_embeddings()(blocks.block_ids)  # (b, nA*B, H)
        hidden = drafter(
            noise_embeds=noise,
            context_hidden_states=context,
            position_ids=blocks.position_ids,
            attention_mask={"full_attention": mask},
        ).last_hidden_state
        lm_head = self.target.get_output_embeddings()
        logits = lm_head(hidden.to(lm_head.weight.dtype))  # gradients flow through the frozen lm_head
        return block_loss(logits.view(*anchors.shape, block_size, -1), blocks.labels, self.weights)


__all__ = [
    "Blocks",
    "DFlashObjective",
    "LossOutput",
    "block_loss",
    "block_mask_mod",
    "build_blocks",
    "default_gamma",
    "dense_block_mask",
    "flex_block_mask",
    "freeze",
    "row_weights",
    "sample_anchors",
]
