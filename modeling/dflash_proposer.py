"""`DFlashProposer`: the drafter's side of the engine's step (dflash_step.py), for one target and drafter.

It owns what drafting needs besides the engine's per-row buffers: the hooks that capture the chosen target layers'
hidden states (`capture`), the drafter's page pool (`cache`), and the heads that turn block rows into logits (the
target's lm_head, or the drafter's draft vocabulary's). Per step the engine calls:
1. `write_context`: the rows the last verify captured become every drafter layer's keys/values, rotated at their
   positions, written to the sequences' pages;
2. `draft_rows`: one drafter forward over the block [anchor, mask x (B - 1)] per sequence, and the logits of its
   rows 1..B-1 under the target's lm_head (over the draft vocabulary only, when the drafter has one);
3. `propose`: the drafter's proposal from those rows (each row's argmax or a sample of its softmax for DFlash, the
   candidate selector's path for DFlash2).

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import torch

from .dflash_acceptance import DecodingRule, Proposal
from .dflash_capture import TargetHiddenCapture
from .dflash_devices import check_drafter_device, execution_device
from .dflash_draft_vocabulary import DraftVocabularyHead
from .dflash_paged_cache import PagedDrafterCache, PagedView


class _Logits:
    """The `head` a drafter's `propose` takes, for rows whose logits are already computed: `draft_rows` gives both,
    and the lm_head (the largest matrix of a step) runs once."""

    def __init__(self, hidden: torch.Tensor, logits: torch.Tensor):
        self.hidden, self.logits = hidden, logits

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if rows is not self.hidden:
            raise ValueError("these logits belong to other rows; this is a bug: please report it")
        return self.logits


class DFlashProposer:
    """Drafts one block per sequence per step for `target`, from hidden states captured during its forwards.

    Args:
        drafter: a `DFlashDraftModel`.
        target: the causal LM being decoded; its input embedding and lm_head serve the drafter.
        batch_size: the most sequences drafted together.
        num_pages: pages of the drafter's pool (`PagedDrafterCache`), which the engine sizes.
    """

    def __init__(self, drafter: torch.nn.Module, target: torch.nn.Module, batch_size: int, num_pages: int):
        config = drafter.config
        self.drafter = drafter
        self.block_size = config.block_size
        check_drafter_device(drafter, target)
        self.input_embeddings = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        # The lm_head reads the drafter's rows where it computes (a split or offloaded target's last device) and in
        # its own dtype; a quantized lm_head (integer weights) casts its input itself.
        self.head_device = execution_device(self.lm_head)
        self.head_dtype = self.lm_head.weight.dtype if self.lm_head.weight.is_floating_point() else None
        # The draft vocabulary the head was built for: a held engine is rebuilt when the drafter's changes.
        self.draft_vocabulary = drafter.draft_vocabulary
        self.draft_head = DraftVocabularyHead.for_drafter(drafter, self.lm_head, self.head_device)
        device, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
        self.device = device
        self.capture = TargetHiddenCapture(target, config.target_layer_ids, config.target_hidden_size)
        self.cache = PagedDrafterCache(
            num_layers=config.num_hidden_layers,
            num_pages=num_pages,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=dtype,
            device=device,
        )
        self.mask_ids = torch.full((batch_size, self.block_size - 1), config.mask_token_id, dtype=torch.long, device=device)
        self.block_offsets = torch.arange(self.block_size, device=device)
        sliding = [t == "sliding_attention" for t in config.layer_types]
        self.window = config.sliding_window if any(sliding) else None
        self.causal_window = drafter.causal_sliding_window

    def write_context(self, rows: torch.Tensor, positions: torch.LongTensor, slots: torch.LongTensor) -> None:
        """Every drafter layer's keys/values of context rows (b, n, k * H_target), rotated at their absolute
        positions (b, n), into the page slots (b, n). The one place context enters the pages."""
        for layer, (key, value) in enumerate(self.drafter.context_key_values(rows, positions)):
            self.cache.write_rows(layer, slots, key, value)  # (b, g, n, d) at (b, n) slots

    def draft_rows(
        self, anchor_ids: torch.LongTensor, positions: torch.LongTensor, attention_mask: object, view: PagedView
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward over the blocks [anchor, mask x (B - 1)] at `positions` (b, B), reading context
        through `view` under `attention_mask`; returns block rows 1..B-1 (b, B - 1, H), on the lm_head's device and
        in its dtype, and their logits under the target's lm_head (b, B - 1, V; -inf outside a draft vocabulary).
        The one propose forward. anchor_ids (b, 1)."""
        mask_ids = self.mask_ids[: anchor_ids.shape[0]].to(anchor_ids.device)
        noise_embeds = self.input_embeddings(torch.cat([anchor_ids, mask_ids], dim=1)).to(self.device)
        hidden = self.drafter(
            noise_embeds=noise_embeds, position_ids=positions, attention_mask=attention_mask, cache=view
        ).last_hidden_state
        # Row 0 only echoes the anchor; rows 1..B-1 predict the tokens after it.
        hidden = hidden.to(self.head_device, self.head_dtype)
        if self.draft_head is not None and hidden.device.type == "cpu":
            # On a CPU the draft head (our copy of the kept lm_head rows) runs over all B rows, row 0's too, and drops
            # it after: MKL's float32 product is much faster for 16 rows than for 15 (benchmarks/step-cost.md), and
            # the rows 1..B-1 it keeps are the same rows. The target's own lm_head keeps seeing exactly the draft rows.
            return hidden[:, 1:], self.draft_head(hidden)[:, 1:]
        hidden = hidden[:, 1:]
        return hidden, self.lm_head(hidden) if self.draft_head is None else self.draft_head(hidden)

    def propose(
        self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.LongTensor, rule: DecodingRule
    ) -> Proposal:
        """The drafter's proposal for block rows 1..B-1 (`propose` of its class: each row's argmax, or DFlash2's
        selector path), from `draft_rows`' rows and logits, under the call's rule. The one place drafts are made."""
        return self.drafter.propose(hidden, anchor_ids, _Logits(hidden, logits), rule)


__all__ = ["DFlashProposer"]
