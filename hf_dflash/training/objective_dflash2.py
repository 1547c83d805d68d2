"""The DFlash2 training objective: DFlash's block loss on the drafter's own logits, plus its candidate selector's loss.

Blocks, anchors, the context rule and the labels are DFlash's (objective.py, steps 1-5); a DFlash2 drafter scales its
block embeddings itself. The loss is the one SpecForge trains DFlash2 with (z-lab published no training code):
- Block loss: cross-entropy of the drafter's unary logits (lm_head scaled by output_multiplier, soft-capped; what the
  selector starts from at decode time), row k weighted exp(-(k - 1) / gamma), as for DFlash.
- Selector loss: at each labelled row i, the selector scores the row's top-k unary candidates after the TRUE previous
  token (token[a + i - 1]; the anchor for row 1, as at decode time), and cross-entropy over those k scores asks for
  the true token[a + i]. Rows whose label is not among the k candidates add nothing: the selector cannot repair them.
  Each row carries its block-loss weight.
- loss = (sum of weighted block CE + selector_weight * sum of weighted selector CE) / (sum of the block-loss weights),
  one denominator for both (SpecForge's `dflash2_selector_loss_alpha`, 1.0 by default).
- By default the selector's loss also trains what it reads (the unary logits, through the top-k values, and the
  drafter's rows); `selector_stop_gradient` keeps it to the selector's own weights, as SpecForge's option of that name.

Simulated tau counts, per block, the leading rows whose selector pick after the true previous token is the label, plus
one: while every earlier pick was right, the true previous token is exactly the token the decode-time walk drafted
there, so this is the greedy walk's acceptance (the unary argmax would measure DFlash2 with its selector off;
`unary_tau` reports that too).

The logits of labelled rows are built in chunks, each recomputed in the backward (activation checkpointing), so the
(rows, V) logits never exist at once for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..modeling import DFlashConfig
from .objective import IGNORE, DFlashObjective, LossOutput, simulated_tau


@dataclass
class DFlash2LossOutput(LossOutput):
    """`LossOutput` (loss, tau from the selector's picks, num_blocks) and its parts, for logs."""

    block_loss: torch.Tensor  # scalar, detached: weighted block CE / weights
    selector_loss: torch.Tensor  # scalar, detached: weighted selector CE / the same weights
    unary_tau: torch.Tensor  # scalar: simulated tau of the per-row argmax, the backbone alone
    candidate_recall: torch.Tensor  # scalar: share of labelled rows whose label is among the selector's candidates


def predecessor_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """(b, L) tokens, (b, nA) anchors -> (b, nA, B): the token before each block row's label, token[a + k - 1] (row 0's
    is never read; positions are clamped into the sequence, and labelled rows never need the clamp)."""
    offsets = torch.arange(block_size, device=input_ids.device)
    at = (anchors[:, :, None] + offsets - 1).clamp(min=0, max=input_ids.shape[1] - 1)
    return input_ids.gather(1, at.flatten(1)).view_as(at)


def _chunk_terms(
    rows: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    predecessors: torch.Tensor,
    row_weights: torch.Tensor,
    drafter: nn.Module,
    stop_gradient: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of r labelled rows (r, H) -> (weighted block CE sum, weighted selector CE sum, unary argmax hits (r,),
    selector pick hits (r,), label among the candidates (r,))."""
    unary = drafter.unary_logits(rows.to(lm_head_weight.dtype) @ lm_head_weight.T)  # (r, V) float32
    block_sum = (F.cross_entropy(unary, labels, reduction="none") * row_weights).sum()
    selector = drafter.candidate_selector
    top, candidates = unary.topk(selector.top_k, dim=-1)  # (r, k)
    if stop_gradient:
        rows, top = rows.detach(), top.detach()
    scores = selector.scores(rows, top, predecessors, candidates)  # (r, k)
    matches = candidates == labels[:, None]
    covered = matches.any(dim=-1)
    selector_ce = F.cross_entropy(scores, matches.long().argmax(dim=-1), reduction="none")
    selector_sum = (selector_ce * row_weights * covered).sum()
    unary_hits = unary.argmax(dim=-1) == labels
    picks = candidates.gather(-1, scores.argmax(dim=-1, keepdim=True))[:, 0]
    return block_sum, selector_sum, unary_hits, picks == labels, covered


def dflash2_block_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    predecessors: torch.Tensor,
    weights: torch.Tensor,
    drafter: nn.Module,
    selector_weight: float = 1.0,
    selector_stop_gradient: bool = False,
    chunk_rows: int = 4096,
) -> DFlash2LossOutput:
    """hidden (b, nA*B, H) drafter rows; labels (b, nA, B) (IGNORE where none); predecessors (b, nA, B) the true
    token before each label (`predecessor_ids`); weights (B,) per block row; drafter a `DFlash2DraftModel` (its
    `unary_logits` and `candidate_selector`); lm_head_weight (V, H) the frozen target's."""
    valid = labels != IGNORE  # (b, nA, B)
    flat_valid = valid.flatten()
    row_w = (weights.to(hidden.device) * valid).flatten()[flat_valid]  # (R,)
    rows = hidden.flatten(0, 1)[flat_valid]  # (R, H): anchor rows and padding never reach the lm_head
    targets = labels.flatten()[flat_valid]
    previous = predecessors.flatten()[flat_valid]
    block_sum = selector_sum = hidden.new_zeros((), dtype=torch.float32)
    unary_hits, selector_hits, covered = [], [], []
    for start in range(0, rows.shape[0], chunk_rows):
        part = slice(start, start + chunk_rows)
        args = (rows[part], lm_head_weight, targets[part], previous[part], row_w[part], drafter, selector_stop_gradient)
        if torch.is_grad_enabled():
            terms = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            terms = _chunk_terms(*args)
        block_sum = block_sum + terms[0]
        selector_sum = selector_sum + terms[1]
        unary_hits.append(terms[2])
        selector_hits.append(terms[3])
        covered.append(terms[4])
    denominator = row_w.sum().clamp(min=1e-6)
    with torch.no_grad():
        def per_row(hits: list[torch.Tensor]) -> torch.Tensor:
            out = torch.zeros_like(flat_valid)
            out[flat_valid] = torch.cat(hits)
            return out.view_as(valid)

        tau = simulated_tau(per_row(selector_hits), valid)
        unary_tau = simulated_tau(per_row(unary_hits), valid)
        recall = torch.cat(covered).float().mean()
    return DFlash2LossOutput(
        loss=(block_sum + selector_weight * selector_sum) / denominator,
        tau=tau,
        num_blocks=int(valid[:, :, 1].sum()),
        block_loss=(block_sum / denominator).detach(),
        selector_loss=(selector_sum / denominator).detach(),
        unary_tau=unary_tau,
        candidate_recall=recall,
    )


class DFlash2Objective(DFlashObjective):
    """`DFlashObjective` for a DFlash2 drafter: the same batches and drafter forward, the DFlash2 loss.

    `selector_weight`: the selector loss's weight against the block loss (1.0 as published); `selector_stop_gradient`:
    keep the selector loss out of the drafter's backbone. Distillation is not offered for DFlash2 (the published
    recipes train on hard labels)."""

    def __init__(
        self,
        target: nn.Module,
        drafter_config: DFlashConfig,
        max_anchors: int = 512,
        gamma: float | None = None,
        attention: str = "dense",
        selector_weight: float = 1.0,
        selector_stop_gradient: bool = False,
        chunk_rows: int = 4096,
    ):
        if selector_weight < 0:
            raise ValueError(f"selector_weight must be >= 0, got {selector_weight}")
        super().__init__(target, drafter_config, max_anchors, gamma, attention)
        self.selector_weight = selector_weight
        self.selector_stop_gradient = selector_stop_gradient
        self.chunk_rows = chunk_rows

    def __call__(
        self, drafter: nn.Module, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None
    ) -> DFlash2LossOutput:
        # Under data parallel the drafter comes wrapped: its forward goes through the wrapper (which syncs the
        # gradients), its selector and logit scaling are read from the model inside.
        model = getattr(drafter, "module", drafter)
        if not hasattr(model, "candidate_selector"):
            raise ValueError("DFlash2Objective trains a DFlash2 drafter (one with a candidate_selector); use "
                             "DFlashObjective for a DFlash one")
        rows = self.draft_rows(drafter, batch, generator)
        predecessors = predecessor_ids(batch["input_ids"], rows.blocks.anchors, self.config.block_size)
        return dflash2_block_loss(
            rows.hidden,
            self.target.get_output_embeddings().weight,
            rows.blocks.labels,
            predecessors,
            self.weights,
            model,
            self.selector_weight,
            self.selector_stop_gradient,
            self.chunk_rows,
        )


__all__ = ["DFlash2LossOutput", "DFlash2Objective", "dflash2_block_loss", "predecessor_ids"]
