"""One DFlash verify step on device tensors, the continuous-batching engine's (dflash_engine.py), which also serves
`generate`'s fast path (dflash_fast_path.py).

A step, for every row of a batch at once: the rows the last verify captured become drafter context, the drafter
drafts a block after each row's anchor, the target verifies [anchor, drafts], and each row's anchor moves past the
tokens it accepted plus the target's own next token. Every index lives on the device and no shape depends on what
was accepted, so on a GPU the engine records the step as a CUDA graph per shape; on a CPU it runs eagerly.

Memory and sampling reach the step through `StepRows`: one page pool per model shared by every row, read through each
row's block table (or, for a generate call's rows, as a view of the stretch each owns; a generate call whose target
the pool cannot serve keeps the target's keys/values in transformers' cache instead: `call_cache`), and how the
target's scores become tokens is `choose` (per-row sampling settings, or a generate call's logits processors); the
acceptance rule is dflash_acceptance.py's.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from .dflash_acceptance import DecodingRule, Proposal, accept
from .dflash_attention import PackedQueries, grouped_attention, packed_queries
from .dflash_compat import attention_implementation
from .dflash_cpu_linears import OneDNNLinears
from .dflash_fast_path_blockers import target_layer_types
from .dflash_linear_state import HYBRID_FAMILIES
from .dflash_masks import FULL, SLIDING, additive_mask, in_window, target_attention_mask
from .dflash_processors import StepProcessors
from .dflash_proposer import DFlashProposer
from .dflash_paged_cache import page_slots
from .dflash_target_cache import TransformersTargetCache


def _active(linears: OneDNNLinears | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if linears is None else linears.active()


@dataclass
class StepRows:
    """The rows one step runs on: views of a step's per-sequence buffers (the running sequences sit first)."""

    anchor_ids: torch.Tensor  # (n, 1) the last committed token
    anchor_pos: torch.Tensor  # (n,) its position
    prev_pos: torch.Tensor  # (n,) the previous step's anchor position, whose verify rows become context now
    active: torch.Tensor  # (n,) 1 while the sequence runs
    max_length: torch.Tensor  # (n,) the length no sequence commits past
    drafts: torch.Tensor  # (n, B - 1)
    out: torch.Tensor  # (n, B + 1) the target's tokens at the B verified rows, then the accepted count
    block_tables: torch.Tensor  # (n, pages) the drafter's pages of each sequence
    verify_rows: torch.Tensor  # (n, B, k * H) the last verify's captured target rows
    verify_positions: torch.Tensor  # (n, B) the positions the verify stores keys/values at (a persistent buffer)
    key_positions: torch.Tensor  # (L,) the target positions every layer reads back, in order
    draft_key_positions: torch.Tensor  # (S,) the drafter positions every layer reads back, in order
    # a Cache-API object: `update` stores at `write_slots` and returns (n, g, L, d); None where a generate call's
    # transformers cache holds the target's keys/values (`DFlashStep.call_cache`)
    target_cache: Any
    drafter_view: Any  # a Cache-API object over the drafter's pages, block rows written to `block_slots`
    presence: torch.Tensor | None = None  # (n, V) the tokens the repetition penalty counts
    scores: torch.Tensor | None = None  # (n, B, V) float32 the verified rows' processed scores, when kept
    logits: torch.Tensor | None = None  # (n, B, V) float32 their raw logits, when kept
    padding: torch.Tensor | None = None  # (n,) the padding of a generate call's row (its processors count it)
    # each row's ids so far (1, t) as plain generate holds them, for processors that run on the host (no graph)
    prefixes: list[torch.LongTensor] | None = None


class DFlashStep:
    """The step's math over `StepRows`, for a target and a drafter. Subclasses own the buffers and the caches."""

    def __init__(self, target: torch.nn.Module, drafter: torch.nn.Module, proposer: DFlashProposer, cache_argument: str):
        text = target.config.get_text_config()
        self.target, self.drafter, self.proposer = target, drafter, proposer
        self.block_size = drafter.config.block_size
        self.block_offsets = proposer.block_offsets  # (B,) 0..B-1
        self.cache_argument = cache_argument  # the target forward's name for its cache (it changed in 5.24)
        # hybrid targets: keys/values for the full-attention layers, rolled-back states for the linear ones
        self.hybrid = text.model_type in HYBRID_FAMILIES
        # The target's forward takes one mask per layer type when its config lists them (a dict), else one for every
        # layer; a sliding layer's query at position p sees positions p - W + 1 .. p, as plain decoding's does.
        layer_types = target_layer_types(text)
        self.mask_types = sorted(set(layer_types)) if getattr(text, "layer_types", None) is not None else None
        self.target_window = text.sliding_window if SLIDING in layer_types else None
        self.mask_dtype = target.dtype
        # How drafts are proposed and accepted, and the processors of the target's scores (`choose`).
        self.rule = DecodingRule(do_sample=False, rejection=False)
        self.processors = StepProcessors([])
        # The drafter's pass per batch size (the fast path may compile it); the eager one by default.
        self.drafter_passes: dict[int, Any] = {}
        # On a CPU, the models' linear layers over prepacked oneDNN weights (dflash_cpu_linears.py), for the drafter's
        # pass and every verify (the engine sets them where they pay); None: the models' own.
        self.target_linears: OneDNNLinears | None = None
        self.drafter_linears: OneDNNLinears | None = None
        # A generate call whose target keeps its keys/values in transformers' cache, not in the step's pages: the
        # verify goes through it (dflash_target_cache.py's `TransformersTargetCache`); None: `rows.target_cache`.
        self.call_cache: TransformersTargetCache | None = None

    def target_masks(
        self,
        visible: torch.Tensor,
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
        linear_attention: torch.Tensor | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor | None]:
        """What the target's forward takes as `attention_mask`, from the positions each query sees under full attention
        (visible (n, q, L)), the queries' own positions (n, q) and the positions read back (L,). Additive (n, 1, q, L)
        masks: eager attention adds them and sdpa takes them as they are (a boolean mask would be added as 0/1 by
        eager attention). A hybrid target's linear-attention layers take `linear_attention` instead: the prompt's
        padding mask (b, P) in the prefill, none in a verify (a block has no padding)."""
        windowed = None
        if self.target_window is not None:
            windowed = visible & in_window(query_positions, key_positions, self.target_window)
        return target_attention_mask(visible, windowed, self.mask_types, self.mask_dtype, linear_attention)

    def drafter_mask(self, visible: torch.Tensor) -> torch.Tensor:
        """The drafter's mask (n, 1, q, S) from its visibility (n, q, S): sdpa takes an additive one as it is, and
        would turn a boolean one into an additive one in each of its layers; eager attention takes booleans."""
        if attention_implementation(self.drafter.config) == "eager":
            return visible[:, None]
        return additive_mask(visible, self.drafter.dtype)

    # -- one verify step, on device buffers only --------------------------------------------------------------

    def step(self, rows: StepRows) -> None:
        """A full-width step: draft a block, verify all B rows (the fast path records this)."""
        self.verify(rows, self.propose(rows)[0].probs)

    def propose(self, rows: StepRows, context_rows: int | None = None) -> tuple[Proposal, torch.Tensor]:
        """Store the last verify's rows as context, then draft the next block into `rows.drafts` (the drafter's
        `propose`: DFlash2's selector runs here, inside the step). Returns the proposal (its `probs`, the
        distribution the drafts were sampled from (n, B - 1, V) under rejection sampling, else None, and the
        drafter's `confidence` in each draft) and the draft rows' logits (n, B - 1, V). `context_rows`: see
        `store_context` (default: all B rows, as the fast path's recorded or compiled pass stores them)."""
        compiled = self.drafter_passes.get(rows.anchor_ids.shape[0]) if context_rows is None else None
        # A compiled pass is inductor's own code. The eager one runs the oneDNN products: the drafter's, and the
        # target's lm_head's, which gives a drafter without a draft vocabulary its logits.
        drafter_linears = None if compiled else self.drafter_linears
        head_linears = None if compiled or self.proposer.draft_head is not None else self.target_linears
        # grouped_attention: no copy of every key/value head per layer (dflash_attention.py)
        with grouped_attention(self.drafter), _active(drafter_linears), _active(head_linears):
            hidden, draft_logits = compiled(rows) if compiled else self.draft(rows, context_rows)
        proposal = self.proposer.propose(hidden, draft_logits, rows.anchor_ids, self.rule)
        rows.drafts.copy_(proposal.drafts)
        return proposal, draft_logits

    def store_context(self, rows: StepRows, context_rows: int | None = None) -> None:
        """1. The first `context_rows` rows the last verify captured (positions prev_pos + 0..context_rows-1;
        default: all B) become context keys/values: a drafted step does this first, and a plain step (the engine's
        policy verifying the anchor alone) does only this.

        Why rows past the accepted ones may be written, and fewer than B suffice. Before a step every position below
        prev_pos holds valid context, and captured rows 0..a (a: the drafts the last verify accepted) are those of
        prev_pos..anchor_pos-1 (anchor_pos = prev_pos + a + 1). Writing any context_rows >= a + 1 of them therefore
        makes every position below the anchor valid; the rows past a (rejected drafts, or rows a narrower verify
        never captured, left from an earlier step) land at positions at or after the anchor. The drafter reads only
        positions below anchor_pos + B, and a drafted block first overwrites anchor_pos..anchor_pos + B - 1 with its
        own keys/values; a plain step reads nothing, and the next step's write covers its anchor. So no row past
        the accepted ones is ever read, whatever the widths of the steps were."""
        offsets = self.block_offsets if context_rows is None else self.block_offsets[:context_rows]
        captured = rows.verify_rows if context_rows is None else rows.verify_rows[:, :context_rows]
        positions = rows.prev_pos[:, None] + offsets  # (n, context_rows)
        self.proposer.write_context(captured, positions, page_slots(rows.block_tables, positions))

    def draft(self, rows: StepRows, context_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's pass of `propose` (the part of the step the fast path compiles): context keys/values
        (`store_context`), masks, the drafter forward and the lm_head. Returns the draft rows (n, B - 1, H) and
        their logits (n, B - 1, V)."""
        block, proposer = self.block_size, self.proposer
        self.store_context(rows, context_rows)
        # 2. Draft: [anchor, mask x (B - 1)] at positions anchor_pos + 0..B-1, seeing every position before anchor + B.
        positions = rows.anchor_pos[:, None] + self.block_offsets  # (n, B)
        rows.drafter_view.block_slots.copy_(page_slots(rows.block_tables, positions))
        visible = rows.draft_key_positions < (rows.anchor_pos + block)[:, None]  # (n, S)
        masks = {FULL: visible[:, None, :]}  # (n, 1, S)
        if proposer.window is not None:  # (n, B, S); a symmetric window also needs the block's bound
            window = in_window(positions, rows.draft_key_positions, proposer.window, proposer.causal_window)
            masks[SLIDING] = window if proposer.causal_window else window & visible[:, None, :]
        # (n, 1, q, S) masks; additive for sdpa, built once here rather than converted from booleans in every layer
        masks = {kind: self.drafter_mask(mask) for kind, mask in masks.items()}
        return proposer.draft_rows(rows.anchor_ids, positions, masks, rows.drafter_view)

    def verify(
        self, rows: StepRows, draft_probs: torch.Tensor | None, width: int | None = None,
        waiting_rows: int | None = None, packed: PackedQueries | None = None,
    ) -> None:
        """The target verifies [anchor, drafts]; accepted rows and the target's next token move each anchor.

        `width` (1..B, default B): the rows verified per sequence, the anchor and the first width - 1 drafts (the
        engine's policy narrows it; 1 verifies the anchor alone, a plain decoding step). Only those rows are
        computed and captured; `out` holds tokens in its first `width` columns and the accepted count last.
        `waiting_rows`: a plain step that leaves the captured rows before it waiting to become context (every row
        waits exactly this many, from `prev_pos`) captures its own row behind them and keeps `prev_pos`; by
        default the rows are captured from the first and `prev_pos` moves to the anchor.
        `packed` (a ragged verify, over the pool only): sequence i verifies its own widths[i] rows, packed into one
        forward (`_verify_in_pool`); `width` is then the widest, and a sequence accepts at most widths[i] - 1
        drafts, its token at row widths[i] - 1 being the target's own there (under rejection sampling, the token a
        judged row yields, accepted draft or resample, follows the target's distribution, so it may end a block)."""
        block = self.block_size
        width = packed.width if packed is not None else block if width is None else width
        drafts, offsets = rows.drafts[:, : width - 1], self.block_offsets[:width]
        if draft_probs is not None:
            draft_probs = draft_probs[:, : width - 1]
        positions = rows.anchor_pos[:, None] + offsets  # (n, width)
        # 3. Verify [anchor, drafts] at their positions, causally.
        first = waiting_rows or 0
        self.proposer.capture.destination = rows.verify_rows[:, first : first + width]
        input_ids = torch.cat([rows.anchor_ids, drafts], dim=1)
        if self.call_cache is not None:  # transformers' cache, rolled back once the host has read the acceptance
            with _active(self.target_linears):
                logits = self.call_cache.verify(input_ids, positions).to(input_ids.device)
        else:
            logits = self._verify_in_pool(rows, input_ids, positions, packed)
        scores, tokens, accepted = self.choose(rows, logits, drafts, draft_probs)
        # never commit past max_length, nor past a sequence's own verified rows
        room = rows.max_length - rows.anchor_pos - 1
        accepted = torch.minimum(accepted, (room - 1).clamp(min=0))
        if packed is not None:
            accepted = torch.minimum(accepted, packed.widths - 1)
        # 4. Accept: rows 0..accepted become context next step; the target's token after them is the new anchor.
        if waiting_rows is None:
            rows.prev_pos.copy_(rows.anchor_pos)
        running = rows.active[:, None] > 0
        rows.anchor_ids.copy_(torch.where(running, tokens.gather(1, accepted[:, None]), rows.anchor_ids))
        rows.anchor_pos.add_((accepted + 1) * rows.active)
        if self.hybrid:  # the linear layers advance over the rows each sequence keeps (none for a finished one)
            rows.target_cache.commit((accepted + 1) * rows.active)
        if rows.presence is not None:  # the committed tokens join the repetition penalty's set
            committed = (offsets <= accepted[:, None]) & running  # (n, width)
            hits = torch.zeros_like(rows.presence, dtype=torch.int32).scatter_add_(1, tokens, committed.int())
            rows.presence.logical_or_(hits > 0)
        rows.out[:, :width].copy_(tokens)
        rows.out[:, block].copy_(accepted)
        if rows.scores is not None:
            rows.scores[:, :width].copy_(scores)
        if rows.logits is not None:
            rows.logits[:, :width].copy_(logits)

    def _verify_in_pool(
        self, rows: StepRows, input_ids: torch.LongTensor, positions: torch.Tensor,
        packed: PackedQueries | None = None,
    ) -> torch.Tensor:
        """The verify forward of input_ids (n, w) at positions (n, w) over the pool (`rows.target_cache`): their
        keys/values stored at their positions, each query seeing every position up to its own. Returns the logits
        (n, w, V). `packed`: only each sequence's first widths[i] rows run, packed into one row of the forward
        (dflash_attention.py); the logits past them are zeros, and their rows are neither stored nor captured."""
        width = input_ids.shape[1]
        verify_positions = rows.verify_positions[:, :width]
        verify_positions.copy_(positions)
        cache = rows.target_cache
        cache.write_slots = verify_positions
        keys = rows.key_positions
        visible = keys <= positions[:, :, None]  # (n, w, L)
        masks = self.target_masks(visible, positions, keys)  # per sequence, also for packed queries
        captured = None
        if packed is not None:  # (n, w) -> (1, T)
            cache.pool_slots = packed.pack(cache.pool_slots)
            input_ids, positions = packed.pack(input_ids), packed.pack(positions)
            destination = self.proposer.capture.destination  # (n, w, k * H)
            captured = destination.new_empty(1, input_ids.shape[1], destination.shape[-1])
            self.proposer.capture.destination = captured
        # a hybrid target's linear layers take no mask (a block has no padding) and defer their states to `commit`
        with cache.deferring() if self.hybrid else contextlib.nullcontext():
            with grouped_attention(self.target), _active(self.target_linears):
                with packed_queries(packed) if packed is not None else contextlib.nullcontext():
                    logits = self.target(
                        input_ids=input_ids,
                        position_ids=positions,
                        attention_mask=masks,
                        use_cache=True,
                        logits_to_keep=input_ids.shape[1],
                        **{self.cache_argument: cache},
                    ).logits
        if packed is None:
            return logits
        destination[packed.sequence, packed.column] = captured[0]
        return packed.unpack(logits)

    def prefix_lengths(self, rows: StepRows) -> torch.Tensor:
        """(n,) plain generate's input_ids length before each row's verify rows, the anchor and a generate call's
        padding included, which length-gated processors read."""
        return rows.anchor_pos + 1 if rows.padding is None else rows.padding + rows.anchor_pos + 1

    def choose(
        self, rows: StepRows, logits: torch.Tensor, drafts: torch.LongTensor, draft_probs: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.LongTensor, torch.LongTensor]:
        """The target's scores of the verify rows, its tokens there and the accepted drafts (`accept`), under the
        bound processors and decoding rule. logits (n, k, V), the verified drafts (n, k - 1) -> (scores (n, k, V),
        tokens (n, k), accepted (n,))."""
        if self.processors.processors or self.rule.do_sample:
            scores = self.processors(logits, self.prefix_lengths(rows), rows.presence, drafts, rows.prefixes)
        else:  # greedy, nothing to process: the argmax of the logits as they are is that of their exact float32 copy,
            scores = logits  # which would cost a (n, B, V) float32 write and read (9.7 MB per sequence at Qwen3's V)
        tokens, accepted = accept(scores, drafts, self.rule.do_sample, draft_probs)
        return scores, tokens, accepted


__all__ = ["DFlashStep", "StepRows"]
