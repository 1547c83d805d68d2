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
6. Loss: cross-entropy of target.lm_head(drafter rows), row k weighted by exp(-(k - 1) / gamma); computed in chunks of
   labelled rows only (`sparse_block_loss`), optionally against a mix of the label and the target's own top-k
   distribution (distillation).

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
class DraftRows:
    """One drafter forward over a batch's anchor blocks."""

    hidden: torch.Tensor  # (b, nA*B, H) the drafter's final-norm rows, differentiable
    blocks: Blocks
    final: torch.Tensor  # (b, L, H) the target decoder's final hidden states (its logits where needed)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    tau: torch.Tensor  # scalar: simulated acceptance length, mean over blocks with a label
    num_blocks: int  # anchor blocks with at least one label (the unit of training throughput)


def chunk_loss_terms(
    logits: torch.Tensor, target_ids: torch.Tensor, target_probs: torch.Tensor, row_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of `SparseTargetCrossEntropy`: logits (r, V) -> the weighted CE sum (float32), the argmax (r,), and
    d(sum)/d(logits) = w * (softmax - t) (r, V) in the logits' dtype. Element-wise work over (r, V) dominates a
    chunk's memory traffic; on GPU it runs compiled (`compiled_chunk_loss_terms`), which fuses it into few passes."""
    z = logits.float()
    log_z = torch.logsumexp(z, dim=-1)  # (r,)
    # -sum_j t_j log q_j = log Z - sum_j t_j z_j, since the t_j sum to 1
    ce = log_z - (target_probs * z.gather(1, target_ids)).sum(-1)
    grad = torch.exp(z - log_z[:, None]).scatter_add(1, target_ids, -target_probs) * row_weights[:, None]
    return (row_weights * ce).sum(), z.argmax(-1), grad.to(logits.dtype)


_compiled_terms = None


def compiled_chunk_loss_terms():
    """`chunk_loss_terms` under torch.compile (one graph for any number of rows), built on first use."""
    global _compiled_terms
    if _compiled_terms is None:
        _compiled_terms = torch.compile(chunk_loss_terms, dynamic=True)
    return _compiled_terms


class SparseTargetCrossEntropy(torch.autograd.Function):
    """sum_r w_r * CE(softmax(hidden_r @ W^T), t_r) for sparse target distributions t_r, in chunks of rows.

    The full (R, V) logits never exist at once: each chunk's logits give its loss and, right away, its gradient
    with respect to `hidden` (softmax - t, times w, times W), which is all the backward needs (W is frozen). At 49K
    vocab and tens of thousands of block rows per batch the logits would otherwise dominate memory, and the
    float32 copies that cross-entropy makes of them would dominate memory traffic.

    hidden (R, H); weight (V, H) the frozen lm_head; target_ids (R, m) long and target_probs (R, m) float (each row
    sums to 1; an id may repeat); row_weights (R,). Returns the weighted loss sum (scalar, float32) and the argmax of
    every row's logits (R,) long, for simulated tau. `compiled`: the element-wise part through torch.compile.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target_ids, target_probs, row_weights, chunk_rows: int, compiled: bool):
        terms = compiled_chunk_loss_terms() if compiled else chunk_loss_terms
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        argmax = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = hidden[rows].to(weight.dtype) @ weight.T  # (r, V)
            loss_sum, argmax[rows], grad_logits = terms(
                logits, target_ids[rows], target_probs[rows].float(), row_weights[rows].float()
            )
            total += loss_sum
            if grad_hidden is not None:
                grad_hidden[rows] = (grad_logits @ weight).to(hidden.dtype)
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(argmax)
        return total, argmax

    @staticmethod
    def backward(ctx, grad_total, grad_argmax):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None, None


def simulated_tau(hits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """hits, valid (b, nA, B) bool -> the mean over blocks with a label of (leading rows k >= 1 whose argmax equals
    the label) + 1 (the bonus token), as greedy verification would commit them."""
    accepted = (hits & valid)[:, :, 1:].long().cumprod(dim=2).sum(dim=2)  # (b, nA)
    return (accepted + 1).float()[valid[:, :, 1]].mean()


def block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> LossOutput:
    """logits (b, nA, B, V) of all rows, labels (b, nA, B), weights (B,) -> weighted CE and simulated tau.

    The plain reference of `sparse_block_loss` (which is what training runs): simple, and memory-hungry.
    """
    valid = labels != IGNORE
    ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten().clamp(min=0), reduction="none")
    w = weights.to(logits.device) * valid
    loss = (ce.view_as(w) * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        tau = simulated_tau(logits.argmax(-1) == labels, valid)
    return LossOutput(loss=loss, tau=tau, num_blocks=int(valid[:, :, 1].sum()))


def sparse_block_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    soft_targets: tuple[torch.Tensor, torch.Tensor] | None = None,
    soft_weight: float = 0.0,
    chunk_rows: int = 8192,
    compiled: bool = False,
) -> LossOutput:
    """The loss of `block_loss`, with the lm_head applied only to rows that carry a label, in chunks.

    hidden (b, nA*B, H) drafter rows; labels (b, nA, B); weights (B,). `soft_targets`: (ids, probs), each
    (R, k) for the R labelled rows in row-major order, the target's top-k distribution at the position each row
    predicts; the loss then is the cross-entropy to (1 - soft_weight) * one_hot(label) + soft_weight * probs.
    """
    valid = labels != IGNORE  # (b, nA, B)
    flat_valid = valid.flatten()
    row_w = (weights.to(hidden.device) * valid).flatten()[flat_valid]  # (R,)
    rows = hidden.flatten(0, 1)[flat_valid]  # (R, H): padding anchors and anchor rows never reach the lm_head
    target_ids = labels.flatten()[flat_valid][:, None]  # (R, 1)
    target_probs = torch.ones_like(target_ids, dtype=torch.float32)
    if soft_targets is not None and soft_weight > 0:
        soft_ids, soft_probs = soft_targets
        target_ids = torch.cat([target_ids, soft_ids], dim=1)  # (R, 1 + k)
        target_probs = torch.cat([target_probs * (1 - soft_weight), soft_probs.float() * soft_weight], dim=1)
    total, argmax = SparseTargetCrossEntropy.apply(rows, lm_head_weight, target_ids, target_probs, row_w, chunk_rows,
                                                   compiled)
    loss = total / row_w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hits = torch.zeros_like(flat_valid)
        hits[flat_valid] = argmax == target_ids[:, 0]
        tau = simulated_tau(hits.view_as(valid), valid)
    return LossOutput(loss=loss, tau=tau, num_blocks=int(valid[:, :, 1].sum()))


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
    `distill_topk` > 0 adds distillation: each labelled row also learns the target's own top-k distribution at the
    position it predicts (renormalized over those k), weighted `distill_weight` against the hard label; the target's
    logits come from the final hidden states of the forward that captures the context anyway. `compile_loss`: the
    loss's element-wise work through torch.compile (GPU: a few fused passes over the logits instead of a dozen).
    """

    def __init__(
        self,
        target: nn.Module,
        drafter_config: DFlashConfig,
        max_anchors: int = 512,
        gamma: float | None = None,
        attention: str = "dense",
        distill_topk: int = 0,
        distill_weight: float = 0.5,
        compile_loss: bool = False,
    ):
        if attention not in ("dense", "flex"):
            raise ValueError(f"attention must be 'dense' or 'flex', got {attention!r}")
        if "sliding_attention" in drafter_config.layer_types:
            raise NotImplementedError("training sliding-window drafters needs a windowed block mask; not built yet")
        if distill_topk < 0 or not 0.0 <= distill_weight <= 1.0:
            raise ValueError(f"distill_topk must be >= 0 and distill_weight in [0, 1], got {distill_topk} and "
                             f"{distill_weight}")
        if getattr(target.get_output_embeddings(), "bias", None) is not None:
            raise NotImplementedError("the training loss applies the target's lm_head weight alone; it has a bias")
        self.target = freeze(target)
        self.config = drafter_config
        self.max_anchors = max_anchors
        self.attention = attention
        self.distill_topk = distill_topk
        self.distill_weight = distill_weight
        self.compile_loss = compile_loss
        self.gamma = gamma or default_gamma(drafter_config.block_size)
        self.weights = row_weights(drafter_config.block_size, self.gamma)
        self.capture = TargetHiddenCapture(target, drafter_config.target_layer_ids, drafter_config.target_hidden_size)

    @torch.no_grad()
    def context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From one forward over the whole sequence: (b, L, k*H) target hidden states at the drafter's layers, and
        (b, L, H) the decoder's final (normed) hidden states, which give the target's logits where needed."""
        batch, seq_len = input_ids.shape
        dtype = self.target.get_input_embeddings().weight.dtype
        rows = torch.empty(batch, seq_len, self.config.num_context_features, dtype=dtype, device=input_ids.device)
        with self.capture:
            self.capture.destination = rows
            # The decoder alone: the target's logits over every position are not needed, and at 150k vocab they
            # would be costly.
            final = self.target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return rows, final.last_hidden_state

    @torch.no_grad()
    def target_topk(self, final_rows: torch.Tensor, chunk_rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
        """final_rows (R, H) target final hidden states -> (R, k) token ids and probabilities, the target's top-k
        renormalized to sum to 1."""
        weight = self.target.get_output_embeddings().weight
        ids, probs = [], []
        for start in range(0, final_rows.shape[0], chunk_rows):
            logits = final_rows[start : start + chunk_rows].to(weight.dtype) @ weight.T
            top = logits.float().topk(self.distill_topk, dim=-1)
            ids.append(top.indices)
            probs.append(top.values.softmax(dim=-1))
        return torch.cat(ids), torch.cat(probs)

    def draft_rows(
        self, drafter: nn.Module, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None
    ) -> DraftRows:
        """Steps 1-4 of the recipe: the target's context, random anchors, their blocks, one drafter forward."""
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        seq_len, block_size = input_ids.shape[1], self.config.block_size
        context, final = self.context(input_ids, batch["attention_mask"])
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
        return DraftRows(hidden=hidden, blocks=blocks, final=final)

    def __call__(
        self, drafter: nn.Module, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None
    ) -> LossOutput:
        input_ids = batch["input_ids"]
        seq_len = input_ids.shape[1]
        rows = self.draft_rows(drafter, batch, generator)
        hidden, blocks, final = rows.hidden, rows.blocks, rows.final
        soft_targets = None
        if self.distill_topk:
            # Row k of anchor a predicts token a + k: the target's distribution for it is its output at a + k - 1.
            valid = (blocks.labels != IGNORE).flatten()
            predicted_from = (blocks.position_ids[:, seq_len:] - 1).clamp(min=0)  # (b, nA*B)
            batch_index = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None].expand_as(predicted_from)
            # Top-k once per position (b * L rows), not per block row (about B times as many), then gathered.
            ids, probs = self.target_topk(final.flatten(0, 1))  # (b * L, k) each
            at = (batch_index * seq_len + predicted_from).flatten()[valid]
            soft_targets = ids[at], probs[at]
        # Gradients flow through the frozen lm_head into the drafter; it is applied to labelled rows only.
        return sparse_block_loss(hidden, self.target.get_output_embeddings().weight, blocks.labels, self.weights,
                                 soft_targets, self.distill_weight, compiled=self.compile_loss)


__all__ = [
    "Blocks",
    "DFlashObjective",
    "DraftRows",
    "LossOutput",
    "SparseTargetCrossEntropy",
    "block_loss",
    "block_mask_mod",
    "build_blocks",
    "chunk_loss_terms",
    "default_gamma",
    "dense_block_mask",
    "flex_block_mask",
    "freeze",
    "row_weights",
    "sample_anchors",
    "simulated_tau",
    "sparse_block_loss",
]
