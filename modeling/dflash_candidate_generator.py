"""`DFlashCandidateGenerator`: transformers' CandidateGenerator API over the drafter, its states and its paged cache.

Per verify step the decoding loop (dflash_decoding.py) calls:
1. `get_candidates(input_ids, rule)`: compute keys/values of the context rows appended since the last propose (and
   only those), then one drafter forward over the block [anchor, mask x (B - 1)] per sequence; the drafts are the
   drafter's `propose` from block rows 1..B-1 and their logits under the target's lm_head (over the drafter's draft
   vocabulary only, when it has one): each row's argmax or a sample of its softmax (DFlash), the candidate
   selector's path (DFlash2).
2. the target verifies [anchor, drafts] while `capture` copies the chosen layers' rows into `scratch`;
3. `update_candidate_strategy(input_ids, scores, num_matches)`: rows 0..a of the scratch (anchor and accepted
   drafts) become the next context slots, held in the accumulator until that propose; the block rows' page slots
   are released.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from .dflash_acceptance import DecodingRule, Proposal
from .dflash_capture import TargetHiddenCapture
from .dflash_devices import check_drafter_device, execution_device
from .dflash_draft_vocabulary import DraftVocabularyHead
from .dflash_paged_cache import PAGE_SIZE, DflashProposerState, PagedCacheView, PagedDrafterCache, PagedView


GREEDY = DecodingRule(do_sample=False, rejection=False)


class _Logits:
    """The `head` a drafter's `propose` takes, for rows whose logits are already computed: `draft_rows` gives both,
    and the lm_head (the largest matrix of a step) runs once."""

    def __init__(self, hidden: torch.Tensor, logits: torch.Tensor):
        self.hidden, self.logits = hidden, logits

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if rows is not self.hidden:
            raise ValueError("these logits belong to other rows; this is a bug: please report it")
        return self.logits


class DFlashCandidateGenerator(CandidateGenerator):
    """Drafts one block per sequence per step for `target`, from hidden states captured during its forwards.

    Args:
        drafter: a `DFlashDraftModel`.
        target: the causal LM being decoded; its input embedding and lm_head serve the drafter.
        batch_size: sequences decoded together.
        max_length: longest sequence (prompt + new tokens) any of them may reach; sizes the page pool.
        max_rows: most target rows captured in one forward (the padded prompt length, or B); sizes the scratch.
        pending_rows: rows a state holds before their keys/values are computed (default: a block, one verify's;
            more let plain steps defer theirs, `take_context`). The engine passes 0: its step writes the verified
            rows to the pages itself.
        num_pages: pages of the drafter's pool (default: every page `batch_size` sequences of `max_length` need; the
            continuous-batching engine sizes its shared pool itself).
    """

    def __init__(
        self,
        drafter: torch.nn.Module,
        target: torch.nn.Module,
        batch_size: int,
        max_length: int,
        max_rows: int,
        pending_rows: int | None = None,
        num_pages: int | None = None,
    ):
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
        # The draft vocabulary the head was built for: a held fast-path step is rebuilt when the drafter's changes.
        self.draft_vocabulary = drafter.draft_vocabulary
        self.draft_head = DraftVocabularyHead.for_drafter(drafter, self.lm_head, self.head_device)
        device, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
        self.device = device
        self.capture = TargetHiddenCapture(target, config.target_layer_ids, config.target_hidden_size)
        # Hooks write here; a verify's rows are then copied to their sequence's accumulator.
        self.scratch = torch.empty(batch_size, max_rows, config.num_context_features, dtype=dtype, device=device)
        # A verify adds at most a block of rows, which wait here for the next propose (or a plain step's deferred
        # pass); the prompt's rows, which can be far more, go to the pages straight from the scratch (`commit_prefill`).
        pending_rows = self.block_size if pending_rows is None else pending_rows
        self.states = [
            DflashProposerState(
                ctx_hidden_acc=torch.empty(pending_rows, config.num_context_features, dtype=dtype, device=device)
            )
            for _ in range(batch_size)
        ]
        pages_per_sequence = -(-(max_length + self.block_size) // PAGE_SIZE)
        self.cache = PagedDrafterCache(
            num_layers=config.num_hidden_layers,
            num_pages=pages_per_sequence * batch_size if num_pages is None else num_pages,
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
        # The last `get_candidates` proposal (the eager loop reads its draft distribution under rejection sampling).
        self.proposal: Proposal | None = None

    def capture_rows(self, num_rows: int) -> None:
        """Point the hooks at the scratch for the next target forward of `num_rows` rows per live sequence."""
        self.capture.destination = self.scratch[: len(self.states), :num_rows]

    def resize_scratch(self, max_rows: int) -> None:
        """Capture at most `max_rows` rows per sequence from now on, into a new scratch (the eager loop holds a prompt's
        rows only through its prefill). The hooks write nowhere until the next `capture_rows`."""
        self.capture.destination = None  # the hooks' view would keep the old scratch alive
        self.scratch = self.scratch.new_empty(self.scratch.shape[0], max_rows, self.scratch.shape[2])

    def commit_prefill(self, prompt_mask: torch.Tensor) -> None:
        """After the prompt forward: every real (non-padding) prompt row becomes a context slot, its keys/values
        computed now, straight from the scratch (the accumulator holds one verify's rows, not a prompt's).

        prompt_mask (b, P): 1 for real tokens. Left padding never reaches the drafter's context.
        """
        mask = prompt_mask.to(self.scratch.device).bool()
        rows = [self.scratch[i, : mask.shape[1]][mask[i]] for i in range(len(self.states))]
        self.store_context(self.states, rows)
        for state, state_rows in zip(self.states, rows):
            state.ctx_len += len(state_rows)  # already in the pages: nothing waits in the accumulator
            state.context_ready = True

    def store_new_context(self, states: list[DflashProposerState]) -> None:
        """Keys/values for slots [ctx_committed, ctx_len) of every state, from its accumulator."""
        self.store_context(states, [s.ctx_hidden_acc[: s.ctx_len - s.ctx_committed] for s in states])

    def store_context(self, states: list[DflashProposerState], rows: list[torch.Tensor]) -> None:
        """Keys/values of rows[i] (n_i, kH) as the slots from ctx_committed on of states[i], in one drafter pass over
        all of them; each watermark moves past its rows."""
        fresh = [(state, state_rows) for state, state_rows in zip(states, rows) if len(state_rows)]
        if not fresh:
            return
        positions, slots = [], []
        for state, state_rows in fresh:
            start, end = state.ctx_committed, state.ctx_committed + len(state_rows)
            self.cache.reserve(state, end + self.block_size)
            positions.append(torch.arange(start, end, device=self.device))  # a slot's index is its position
            slots.append(self.cache.slot_mapping(state, start, end))
        rows = torch.cat([state_rows for _, state_rows in fresh])[None]  # (1, n, kH)
        self.write_context(rows, torch.cat(positions)[None], torch.cat(slots)[None])
        for state, state_rows in fresh:
            state.ctx_committed = state.ctx_count_drafter = state.ctx_committed + len(state_rows)

    def write_context(self, rows: torch.Tensor, positions: torch.LongTensor, slots: torch.LongTensor) -> None:
        """Every drafter layer's keys/values of context rows (b, n, k * H_target), rotated at their absolute
        positions (b, n), into the page slots (b, n). The one place context enters the pages, for both loops."""
        for layer, (key, value) in enumerate(self.drafter.context_key_values(rows, positions)):
            self.cache.write_rows(layer, slots, key, value)  # (b, g, n, d) at (b, n) slots

    def draft_rows(
        self, anchor_ids: torch.LongTensor, positions: torch.LongTensor, attention_mask: object, view: PagedView
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward over the blocks [anchor, mask x (B - 1)] at `positions` (b, B), reading context
        through `view` under `attention_mask`; returns block rows 1..B-1 (b, B - 1, H), on the lm_head's device and
        in its dtype, and their logits under the target's lm_head (b, B - 1, V; -inf outside a draft vocabulary).
        The one propose forward, for both loops. anchor_ids (b, 1)."""
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
        selector path), from `draft_rows`' rows and logits, under the call's rule. The one place drafts are made,
        for both loops."""
        return self.drafter.propose(hidden, anchor_ids, _Logits(hidden, logits), rule)

    @torch.no_grad()
    def get_candidates(
        self, input_ids: torch.LongTensor, rule: DecodingRule = GREEDY, **kwargs: object
    ) -> tuple[torch.LongTensor, torch.Tensor]:
        """input_ids (b, t), last column the anchors -> (input_ids + B - 1 drafts, draft logits (b, B - 1, V)). The
        drafts are the drafter's proposal under `rule` (`propose`), kept whole in `self.proposal`."""
        self.take_context()
        anchor_positions = torch.tensor([s.ctx_len for s in self.states], device=self.device)
        position_ids = anchor_positions[:, None] + self.block_offsets  # (b, B)
        view = PagedCacheView(self.cache, self.states, self.block_size, self.window, self.causal_window)
        anchor_ids = input_ids[:, -1:]
        hidden, draft_logits = self.draft_rows(anchor_ids, position_ids, view.attention_masks, view)
        self.proposal = self.propose(hidden, draft_logits, anchor_ids, rule)
        return torch.cat([input_ids, self.proposal.drafts.to(input_ids.device)], dim=1), draft_logits

    def take_context(self, defer: bool = False) -> None:
        """Before a verify: the rows the last verify appended go to the pages (keys/values computed once), and every
        state then waits for this verify. Each propose starts with it; a step that verifies the anchors alone without
        drafting (dflash_policy.py) calls it instead, since the accumulator holds a bounded number of rows.

        `defer` (such a step): the rows may stay in the accumulator while another verify's rows still fit behind them
        in every state; the next propose, or a later step, then computes them all in one pass. One pass over the
        drafter's context weights costs about as much for 1 row as for 16 on a CPU, and a run of plain steps would
        otherwise pay it at each step."""
        for state in self.states:
            if not state.context_ready:
                raise RuntimeError("propose called twice without a verify in between: the drafter context is stale")
            state.context_ready = False
        if defer and all(s.ctx_len - s.ctx_committed + self.block_size <= s.max_pending_rows for s in self.states):
            return
        self.store_new_context(self.states)

    def update_candidate_strategy(
        self, input_ids: torch.LongTensor, scores: torch.Tensor | None, num_matches: int | Sequence[int]
    ) -> None:
        """After a verify: sequence i accepted `num_matches[i]` drafts; its rows 0..a become context slots."""
        if isinstance(num_matches, int):
            num_matches = [num_matches] * len(self.states)
        for i, (state, accepted) in enumerate(zip(self.states, num_matches)):
            state.ctx_count_drafter = state.ctx_committed  # drop the block rows' page slots
            state.append_context(self.scratch[i, : accepted + 1])

    def keep(self, indices: Sequence[int]) -> None:
        """Carry on with the sequences at `indices` only (in that order); the others' pages return to the pool."""
        kept = set(indices)
        for i, state in enumerate(self.states):
            if i not in kept:
                self.cache.release(state)
        self.states = [self.states[i] for i in indices]

    def release(self) -> None:
        """Return every sequence's pages to the pool."""
        self.keep([])


__all__ = ["DFlashCandidateGenerator"]
