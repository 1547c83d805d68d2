"""The fast path of the DFlash loop: every verify step is one CUDA graph replay and one host synchronization.

On a GPU, eager PyTorch spends most of a step launching kernels (about 50 ms for a Qwen3-8B step on an H200 whose
memory floor is 4 ms). Here a whole step (store the new context keys/values, draft a block, verify it, accept, move
each sequence's anchor) works on preallocated buffers with every index on the device, so it is recorded once as a
CUDA graph and replayed. The host reads back one small tensor per step ([target tokens | accepted count] per
sequence); the committed tokens then pass the call's host hooks (dflash_host_hooks.py: eos / max_length, other
stopping criteria token by token, the streamer, and per-token scores / logits, which the step writes to buffers only
for a call that returns them), exactly as plain generate would stop and report.

Sequences keep their own slots (dflash_static_cache.py): a sequence that accepts fewer drafts than its neighbours
just moves its anchor less; a finished one is frozen, and once the running ones fit in a smaller power-of-two batch
they move to the first rows and the step runs at that batch (`compact`, one graph per batch size).

Which calls the fast path serves, and the warning that says why one does not: dflash_fast_path_blockers.py. On a
CPU (`generate(..., dflash_fast_path=True)`) it runs the same step without a graph, which is how CI tests it.

The drafter's pass of the step (its context keys/values, masks, layers and the lm_head over the draft rows: our own code)
is compiled with torch.compile (inductor, fixed shapes) before a graph records it, so the graph replays inductor's
fused kernels where it would replay hundreds of small eager ones (RMSNorm, rotary, masks, casts). A call's first step
compiles it for every batch size the step may run at, once per held step (batch size and cache length);
`generate(..., dflash_compile=False)` keeps it eager.
The target's forward is never compiled: the verified tokens come from the target alone, so a compiled drafter can only
change which drafts are proposed (tau), never the output. If compiling fails, a warning names why and the step runs the
eager drafter.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers.utils import logging

from .dflash_acceptance import DecodingRule
from .dflash_attention import grouped_attention
from .dflash_candidate_generator import DFlashCandidateGenerator
from .dflash_capture import decoder_layers
from .dflash_compat import dynamo_cache_size_limit
from .dflash_linear_state import HybridStaticCache
from .dflash_paged_cache import PAGE_SIZE
from .dflash_prefill import prefill
from .dflash_processors import StepProcessors
from .dflash_static_cache import (
    ContiguousPagedView, StaticTargetCache, contiguous_block_tables, reorder_contiguous_rows,
)
from .dflash_step import DFlashStep, StepRows

logger = logging.get_logger(__name__)

# Target cache lengths are rounded up to this, so prompts of similar length share one captured graph.
SLOT_BUCKET = 256
# Compiled drafter passes dynamo may keep: one per batch size and cache length a process runs (its default, 8, would
# leave a long-lived process's ninth shape uncompiled, or with fullgraph raise).
DRAFTER_RECOMPILE_LIMIT = 64


def record_cuda_graph(fn: Any, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Record `fn` as a CUDA graph, after `warmup` calls on a side stream (CUDA graphs require a warmed-up stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


DrafterPass = Callable[["StepRows"], tuple[torch.Tensor, torch.Tensor]]  # `DFlashStaticStep.draft`


def compile_drafter_pass(fn: DrafterPass) -> DrafterPass:
    """`fn` compiled by inductor for fixed shapes, as one graph (a break is an error, not a silent eager piece), and
    without CUDA graphs of its own: the fast path records the whole step as one. Its calls may keep up to
    `DRAFTER_RECOMPILE_LIMIT` compiled versions."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)

    def run(rows: StepRows) -> tuple[torch.Tensor, torch.Tensor]:
        with dynamo_cache_size_limit(DRAFTER_RECOMPILE_LIMIT):
            return compiled(rows)

    return run


def bucket_size(running: int, batch_size: int) -> int:
    """The batch a step runs at for `running` sequences: the next power of two, at most the full batch. Finished rows
    leave the step once the running ones fit in a smaller one (for b a power of two: in half of it), so a batch is not
    held by its longest sequence, and a held step records at most ceil(log2(b)) + 1 graphs."""
    return min(batch_size, 1 << max(running - 1, 0).bit_length())


class DFlashStaticStep(DFlashStep):
    """Buffers of the fast path for one batch size and one cache length, and the step (dflash_step.py) over them.

    Every per-sequence buffer has one row per sequence of the batch; `sequence_of_row[i]` is the call's sequence in
    row i. Rows are kept with the running sequences first, and a step runs on the first `live_rows` of them
    (`rows(n)`): when sequences finish, `compact` moves them behind the running ones and the step runs at a smaller
    batch (one graph per batch size).
    """

    def __init__(
        self, target: torch.nn.Module, drafter: torch.nn.Module, batch_size: int, num_slots: int, cache_argument: str
    ):
        config = drafter.config
        text = target.config.get_text_config()
        block = config.block_size
        device = drafter.fc.weight.device
        max_length = num_slots - block  # the longest sequence (padding included) this step can hold
        # Capture hooks, per-sequence states and the drafter's page pools; prefill reuses the generator's methods.
        # Its scratch is sized for each call's prompt in `prefill` (the steps capture into `verify_rows`).
        generator = DFlashCandidateGenerator(drafter, target, batch_size, max_length, max_rows=0, pending_rows=0)
        super().__init__(target, drafter, generator, cache_argument)
        self.batch_size, self.num_slots = batch_size, num_slots
        for state in self.generator.states:  # every page a sequence may need, once, in row order (the pool is fresh)
            self.generator.cache.reserve(state, num_slots)
        self.block_tables = torch.stack([state.block_table_dev for state in self.generator.states])  # (b, pages)
        if not contiguous_block_tables(self.block_tables):  # a fresh pool hands out low pages first, row by row
            raise RuntimeError("the drafter's pages are not laid out row by row; this is a bug: please report it")
        self.draft_slots_per_row = self.block_tables.shape[1] * PAGE_SIZE  # S
        self.draft_key_positions = torch.arange(self.draft_slots_per_row, device=device)  # (S,)
        self.draft_block_slots = torch.zeros(batch_size, block, dtype=torch.long, device=device)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        cache_kind = dict(target=target) if self.hybrid else dict(num_layers=len(decoder_layers(target)))
        self.target_cache = (HybridStaticCache if self.hybrid else StaticTargetCache)(
            **cache_kind,
            batch_size=batch_size,
            num_key_value_heads=text.num_key_value_heads,
            head_dim=head_dim,
            num_slots=num_slots,
            dtype=target.dtype,
            device=device,
        )
        self.target_slots = torch.zeros(batch_size, block, dtype=torch.long, device=device)
        self.key_slots = torch.arange(num_slots, device=device)
        # Target hidden states of the verified rows land here (the capture hooks' destination during a step).
        self.verify_rows = torch.zeros(
            batch_size, block, config.num_context_features, dtype=drafter.fc.weight.dtype, device=device
        )
        long = dict(dtype=torch.long, device=device)
        self.anchor_ids = torch.zeros(batch_size, 1, **long)
        self.anchor_pos = torch.zeros(batch_size, **long)
        self.prev_pos = torch.zeros(batch_size, **long)
        self.offsets = torch.zeros(batch_size, **long)
        self.active = torch.zeros(batch_size, **long)
        self.drafts = torch.zeros(batch_size, block - 1, **long)
        self.out = torch.zeros(batch_size, block + 1, **long)
        self.max_length_now = torch.zeros(batch_size, **long)  # this call's max_length (a buffer: the graph reads it)
        self.vocab_size = generator.lm_head.weight.shape[0]
        # The call's decoding rule and processors are bound by `bind`; a recorded graph computes with the ones it was
        # recorded with, so the graphs are kept only while later calls bring the same.
        self.presence: torch.Tensor | None = None  # (b, V) bool, the tokens the repetition penalty counts
        # The verify rows' scores / logits (b, B, V) float32, allocated only for a call that returns them
        # (return_dict_in_generate with output_scores / output_logits): 9.7 MB per sequence each at B = 16 and a
        # vocabulary of 151,936; the host keeps the rows of committed tokens, one (1, V) copy per token.
        self.scores: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.sequence_of_row = list(range(batch_size))
        self.live_rows = batch_size
        self.use_graphs = device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # rows -> the step recorded at that batch
        # Whether calls compile the drafter's pass (`bind`); the pass the step runs per batch size, compiled or eager
        # (`prepare_drafter`); why compiling failed, if it did (the step then stays eager rather than try again).
        self.compile_drafter = False
        self.compile_error: str | None = None
        self._rows: dict[int, StepRows] = {}

    def rows(self, n: int) -> StepRows:
        """The first n rows of every per-sequence buffer (views, built once per n)."""
        if n not in self._rows:
            self._rows[n] = StepRows(
                anchor_ids=self.anchor_ids[:n],
                anchor_pos=self.anchor_pos[:n],
                prev_pos=self.prev_pos[:n],
                offsets=self.offsets[:n],
                active=self.active[:n],
                max_length=self.max_length_now[:n],
                drafts=self.drafts[:n],
                out=self.out[:n],
                block_tables=self.block_tables[:n],
                verify_rows=self.verify_rows[:n],
                target_slots=self.target_slots[:n],
                key_slots=self.key_slots,
                draft_key_positions=self.draft_key_positions,
                target_cache=self.target_cache.head(n),
                drafter_view=ContiguousPagedView(
                    self.generator.cache, self.draft_block_slots[:n], num_rows=n, slots_per_row=self.draft_slots_per_row
                ),
                presence=None if self.presence is None else self.presence[:n],
                scores=None if self.scores is None else self.scores[:n],
                logits=None if self.logits is None else self.logits[:n],
            )
        return self._rows[n]

    def prepare_drafter(self, n: int) -> None:
        """Choose the drafter's pass for the first n rows. When calls compile it, the first call compiles it for every
        batch size the step may run at (`bucket_size`), so that no compile stalls a call once it decodes (when its
        finished sequences leave the batch), and runs each once (its first run also tunes kernels), before any graph
        records the step. Leaves the device state as a step would find it: a pass rewrites the last verify's context
        rows as they were, and block slots the next step overwrites. If compiling fails, a warning says why and the
        step keeps the eager pass."""
        if n in self.drafter_passes:
            return
        if not self.compile_drafter or self.compile_error is not None:
            self.drafter_passes[n] = self.draft
            return
        # A warning, not an info line: the call waits tens of seconds per batch size on a cold compile cache, and
        # transformers shows only warnings by default.
        logger.warning_once(
            "DFlash: compiling the drafter's pass of the fast path with torch.compile, for each batch size the step "
            "may run at, on the first call of a batch size and cache length (about half a minute per batch size on "
            "an H200 with a cold compile cache; that call takes longer, later ones are faster); pass "
            "dflash_compile=False to generate to keep it eager."
        )
        sizes = sorted({bucket_size(running, self.batch_size) for running in range(1, self.batch_size + 1)})
        for size in reversed(sizes):
            if size in self.drafter_passes:
                continue
            self.drafter_passes[size] = self.draft
            started = time.perf_counter()
            compiled = compile_drafter_pass(self.draft)
            try:
                with torch.no_grad(), grouped_attention(self.drafter):
                    # Eagerly first: the grouped attention asks torch's sdpa dispatcher once per kind of call and
                    # keeps the answer, which a compiled trace can read but not ask (dflash_attention.py).
                    self.draft(self.rows(size))
                    compiled(self.rows(size))
            except Exception as error:  # any failure to compile leaves the eager pass, never a failed call
                lines = str(error).strip().splitlines()
                self.compile_error = f"{type(error).__name__}: {lines[0][:300] if lines else ''}"
                logger.warning_once(
                    f"DFlash: compiling the drafter's pass failed ({self.compile_error}); the fast path runs it "
                    "eagerly (the same tokens, each step somewhat slower). Pass dflash_compile=False to generate to "
                    "skip the attempt."
                )
                return
            logger.info(f"DFlash: compiled the drafter's pass for {size} rows in {time.perf_counter() - started:.1f} s")
            self.drafter_passes[size] = compiled

    # -- host side ------------------------------------------------------------------------------------------

    def bind(
        self, processors: StepProcessors, rule: DecodingRule, keep_scores: bool, keep_logits: bool,
        compile_drafter: bool = False,
    ) -> None:
        """Take this call's decoding rule and processors, whether the step writes out the verify rows' scores /
        logits, and whether the drafter's pass is compiled. A recorded graph baked in what it was recorded with
        (temperatures, thresholds, the tensors they hold, the copies to the output buffers, the compiled or eager
        drafter): the graphs are kept only for a call that computes the same, and dropped otherwise (the next step
        records its own)."""
        kept = (self.scores is not None, self.logits is not None)
        if compile_drafter != self.compile_drafter:
            self.graphs = {}
            self.drafter_passes = {}
            self.compile_drafter = compile_drafter
        if self.graphs and (rule, processors.signature, kept) == (
            self.rule, self.processors.signature, (keep_scores, keep_logits)
        ):
            return
        self.graphs = {}
        self._rows = {}
        self.rule, self.processors = rule, processors
        self.presence = self._buffer(processors.penalty is not None, self.presence, torch.bool)
        self.scores = self._buffer(keep_scores, self.scores, torch.float32, self.block_size)
        self.logits = self._buffer(keep_logits, self.logits, torch.float32, self.block_size)

    def _buffer(self, needed: bool, held: torch.Tensor | None, dtype: torch.dtype, *rows: int) -> torch.Tensor | None:
        """A (b, *rows, V) buffer while a call needs it (the one held, if any), None otherwise."""
        if not needed:
            return None
        if held is not None:
            return held
        return torch.zeros(self.batch_size, *rows, self.vocab_size, dtype=dtype, device=self.anchor_ids.device)

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor, max_length: int, call: StepProcessors
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Eager prompt forward into the static cache; the prompt rows become drafter context. Returns each
        sequence's first token (the call's one synchronization before the loop), chosen under the call's own
        processors `call` exactly as plain generate chooses it, with its scores (b, 1, V) and raw logits (b, 1, V).
        (`call`, not the bound `self.processors`: a kept graph keeps the processor objects of the call that recorded
        it, and the first token is chosen by this call's own, as plain generate chooses it.)"""
        batch, prompt_len = input_ids.shape
        device = input_ids.device
        self.generator.restart()
        self.max_length_now.fill_(max_length)
        real = attention_mask.long()
        self.offsets.copy_(prompt_len - real.sum(dim=1))
        columns = torch.arange(prompt_len, device=device)
        self.target_cache.write_slots = columns.expand(batch, -1)
        # A query sees real keys up to itself; a padding query sees itself only, so no softmax row is empty (an
        # empty one would write NaN keys/values that later masked reads still multiply by zero).
        sees = (self.key_slots <= columns[:, None]) & (self.key_slots < prompt_len)  # (P, L)
        real_keys = torch.nn.functional.pad(real.bool(), (0, self.num_slots - prompt_len))  # (b, L)
        visible = (sees & real_keys[:, None, :]) | (self.key_slots == columns[:, None])  # (b, P, L)
        # a hybrid target's linear layers zero the padding's inputs, as in generate, and start from empty states
        forward_mask = self.target_masks(visible, columns.expand(batch, -1), self.key_slots, linear_attention=real)
        # The prompt's captured rows are held only while its context keys/values are computed from them.
        self.generator.resize_scratch(prompt_len)
        with self.target_cache.prefilling() if self.hybrid else contextlib.nullcontext():
            first, scores, logits = prefill(
                self.target, self.generator, input_ids, real, forward_mask, {self.cache_argument: self.target_cache},
                call, self.rule.do_sample,
            )
        self.generator.resize_scratch(0)
        if self.presence is not None:
            self.presence.copy_(call.prompt_presence(input_ids, self.vocab_size))
            self.presence[torch.arange(batch, device=device), first] = True
        self.anchor_ids.copy_(first[:, None])
        self.anchor_pos.copy_(real.sum(dim=1))
        self.prev_pos.copy_(self.anchor_pos)  # nothing new for the first step: its context rows land in block slots
        self.active.fill_(1)
        self.sequence_of_row = list(range(batch))
        self.live_rows = batch
        return first.tolist(), scores, logits

    def capture_graph(self, n: int) -> None:
        """Record `step` over the first n rows as a CUDA graph, leaving the device state as it was."""
        rows = self.rows(n)
        state = [t for t in (rows.anchor_ids, rows.anchor_pos, rows.prev_pos, rows.verify_rows, rows.presence) if t is not None]
        state += rows.target_cache.carried_state()  # e.g. a hybrid target's linear-attention states
        saved = [t.clone() for t in state]
        # The warm-up steps draw random numbers too: the generator is put back, so that a seeded call samples the
        # same tokens whether it records the graph or replays one recorded by an earlier call.
        rng = torch.cuda.get_rng_state(self.anchor_ids.device)
        self.graphs[n] = record_cuda_graph(lambda: self.step(rows))
        torch.cuda.set_rng_state(rng, self.anchor_ids.device)
        # Warm-up steps wrote keys/values only at or after each anchor, which the next real step overwrites before any
        # read; the rows they captured, the anchors they moved and the states they advanced are put back.
        for tensor, value in zip(state, saved):
            tensor.copy_(value)

    @torch.no_grad()
    def run_step(self) -> dict[int, list[int]]:
        """One verify step over the live rows; returns per sequence in them (frozen ones included) [tokens at the B
        rows..., accepted]."""
        n = self.live_rows
        self.prepare_drafter(n)
        if self.use_graphs and n not in self.graphs:
            self.capture_graph(n)
        if n in self.graphs:
            self.graphs[n].replay()
        else:
            self.step(self.rows(n))
        out = self.out[:n].tolist()  # the step's one host synchronization
        return {sequence: out[row] for row, sequence in enumerate(self.sequence_of_row[:n])}

    def verified_rows(self, sequence: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The last step's scores and raw logits (B, V) of `sequence`'s verify rows (None where not kept): views
        of the step's buffers, which the next step overwrites."""
        if self.scores is None and self.logits is None:
            return None, None
        row = self.sequence_of_row.index(sequence)
        return (
            None if self.scores is None else self.scores[row],
            None if self.logits is None else self.logits[row],
        )

    def stop(self, sequence: int) -> None:
        """Freeze a finished sequence: its anchor no longer moves, and `compact` may move it out of the live rows."""
        self.active[self.sequence_of_row.index(sequence)] = 0

    def compact(self, running: list[int]) -> None:
        """Move the running sequences to the first rows and run on the smallest batch that holds them (`bucket_size`),
        once that is smaller than the live rows; one copy of each per-sequence buffer's rows."""
        n = bucket_size(len(running), self.batch_size)
        if n >= self.live_rows:
            return
        row_of = {sequence: row for row, sequence in enumerate(self.sequence_of_row)}
        first = [row_of[sequence] for sequence in running]
        order = first + sorted(set(range(self.batch_size)) - set(first))
        index = torch.tensor(order, device=self.anchor_ids.device)
        per_row = (
            self.anchor_ids, self.anchor_pos, self.prev_pos, self.offsets, self.active, self.verify_rows, self.presence,
        )
        for buffer in per_row:
            if buffer is not None:
                buffer.copy_(buffer[index])
        self.target_cache.reorder(index)
        # the drafter's keys/values move to their row's pages, so every row keeps its contiguous stretch of the pool
        # (and its state and block table, which the next prefill pairs again)
        reorder_contiguous_rows(self.generator.cache, index, self.draft_slots_per_row)
        self.sequence_of_row = [self.sequence_of_row[row] for row in order]
        self.live_rows = n


def static_step_for(
    target: torch.nn.Module, drafter: torch.nn.Module, batch_size: int, max_length: int, cache_argument: str
) -> DFlashStaticStep:
    """The drafter's fast-path step for this target and batch size, built (and on CUDA, graph-captured at its first
    use) once and kept on the drafter: one at a time, to bound the memory it holds. A held step serves any call that
    fits its cache and needs at least a quarter of it (attention reads every slot, so a far larger one costs time),
    while the drafter keeps the draft vocabulary it was built for."""
    num_slots = -(-(max_length + drafter.config.block_size) // SLOT_BUCKET) * SLOT_BUCKET
    key = (id(target), batch_size, target.dtype)
    held = getattr(drafter, "_dflash_static_step", None)
    if (
        held is None
        or held[0] != key
        or not num_slots <= held[1].num_slots <= 4 * num_slots
        or held[1].generator.draft_vocabulary is not drafter.draft_vocabulary  # its head copied the old one's rows
    ):
        drafter._dflash_static_step = None  # let the old buffers go before allocating new ones
        drafter._dflash_static_step = (key, DFlashStaticStep(target, drafter, batch_size, num_slots, cache_argument))
    return drafter._dflash_static_step[1]


def release_fast_path(drafter: torch.nn.Module) -> None:
    """Free the fast path's buffers and CUDA graph kept on `drafter`."""
    drafter._dflash_static_step = None
    drafter._dflash_engine = None


__all__ = ["DFlashStaticStep", "StepRows", "bucket_size", "record_cuda_graph", "release_fast_path", "static_step_for"]
