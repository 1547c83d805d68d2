"""The DFlash continuous-batching engine: sequences join and leave a running batch, one verify step at a time.

The engine holds up to `max_batch_size` sequences in rows 0..n-1 and advances them together with the verify step of
dflash_step.py (the fast path's step: per-row anchors, the same masks, the same acceptance). A sequence is admitted at
any step (`admit`: its prompt prefilled, in chunks of `prefill_chunk` positions, into rows nobody else reads, its
first token chosen; `admit_many`: several short prompts packed into one forward) and retired at any step (`retire`:
its pages go back, the last row moves into its place, so the running rows stay first and a step never computes for an
empty row).

It serves the targets the fast path serves (full and sliding-window attention, MoE), hybrid ones included: Qwen3-Next
and Qwen3.5/3.6, text and multimodal, whose Gated DeltaNet (linear-attention) layers keep states instead of keys.

Memory is paged, in two pools shared by every row (`PagedDrafterCache`, pages of 16 positions):
- the target's keys/values: a row's block table maps its positions to pages; `PagedTargetCache` is what the target's
  attention layers see through the Cache API's `update`, which stores the new rows through the block tables and
  returns every row's positions 0..span-1, gathered, where span is the batch's longest sequence rounded up to
  `SPAN_BUCKET` (a 4D mask hides what a row does not hold);
- the drafter's context keys/values, addressed the same way.
A hybrid target's linear-attention layers hold no keys: each layer's conv and recurrent states sit in buffers of
`max_batch_size` rows beside the pools (`PagedHybridCache`), zeroed by a row's first prefill chunk and carried through
its next ones, advanced in each verify over exactly the rows its sequence accepts (dflash_linear_state.py's rollback,
the fast path's), and moved with the row when another retires.
A generate call whose target the pool cannot serve (`fast_path_blocker`: split over devices, other quantizers,
untested families, other attention, a hybrid's padding between real tokens) keeps its target's keys/values in its own
transformers cache instead (`transformers_cache`, `TransformersTargetCache`): the target reads its padded prompt and
each verify through its own attention and masks, and the cache is rolled back once the step's acceptance is read; the
drafter's pool, the step and the policy are the same, run eagerly.
A request takes the pages of its prompt and one block when it is admitted (`fits_now`: with room left for two steps
of every sequence), and more as it grows: before each step every sequence takes the pages that step writes into
(`pages_short` says how many are missing). When a step would need more than are free, the caller preempts: it retires
the newest requests and admits them again later with their committed tokens as prompt (the continuous-batching
manager does; greedy tokens do not change). A request that never fits is refused with a ValueError naming the limit
(`check_request`). A generate call's rows own their whole stretch from the start (`contiguous_rows`).

How many rows a step verifies is a `VerifyPolicy`'s (dflash_policy.py) choice when `adaptive` is on (by default
where the engine runs on a CPU, where a verify costs about in proportion to its rows; on a GPU when asked): per step
it decides whether to
draft at all (a plain step verifies each anchor alone and skips the drafter's layers; the last verify's rows still
become drafter context, at once or with the next drafted step), and after drafting how many rows (anchor + drafts)
to verify, from each sequence's drafter confidence and recent acceptance and the verify cost it measures per batch
size. Greedy tokens never change and
sampled ones stay target-distributed: the width is chosen from the drafter's state alone (a request's drafts are
never sampled; a bound generate call's sampled drafts give the width through `width_confidence`, which never reads
the drafts drawn), and accepting a prefix of fewer drafts is the same acceptance rule. A plain step leaves the row it
captured waiting behind the rows already waiting, where every row waits the same count (`waiting_rows`): the next
drafted step stores them as drafter context in one pass. Without a policy every step verifies the full block, or a
bound generate call's `dflash_verify_rows`.
Sequences (under a policy of `per_sequence`, the default, a manager's or a generate call's) each verify their own
width where the step runs eagerly over the pool on a target without linear-attention layers, whose attention is sdpa
(`ragged_verify`): the verified rows of all sequences run packed in one row of the target's forward, so that a
sequence that expects little verifies little while a confident one verifies its block, and no row is computed for
padding (dflash_attention.py's `PackedQueries`). Elsewhere the batch verifies one width.
At static shapes (a GPU) a step whose width is chosen runs in two recorded parts (`StepPart`): the drafter's, whose
drafts' confidence the host reads, then the verify at the chosen width rounded up to a power of two (`_width_bucket`),
so that a few graphs per shape serve every width; a plain step is one part, and no row waits there (every drafted
step stores all B captured rows, which on a GPU costs about what one does).

Buffers belong to the engine, which its caller owns: the manager (dflash_continuous.py), or `generate`'s fast path
(dflash_fast_path.py), which keeps one engine per drafter, its rows each one stretch of the pools (`contiguous_rows`).
Each step reads the device once (the verified tokens and accepted counts), twice with a policy (the drafts'
confidence, before choosing the width). A CUDA device replays each step's shape, or each part's, as a recorded graph
(`static_shapes`).

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers.utils import logging

from .dflash_acceptance import DecodingRule, accept, width_confidence
from .dflash_attention import PackedQueries, attends_grouped, grouped_attention
from .dflash_capture import decoder_layers, one_call_at_a_time
from .dflash_checks import check_drafter_fits
from .dflash_compat import cache_argument, dynamo_cache_size_limit
from .dflash_cpu_linears import OneDNNLinears, onednn_linears_blocker
from .dflash_fast_path_blockers import bitsandbytes_quantized, target_layer_types
from .dflash_linear_state import HYBRID_FAMILIES, LinearStates, hybrid_blocker, linear_attention_modules
from .dflash_linear_state import linear_state_buffers
from .dflash_masks import LINEAR
from .dflash_paged_cache import PAGE_SIZE, PagedDrafterCache, PagedView, StretchView, page_slots
from .dflash_policy import VerifyPolicy
from .dflash_processors import StepProcessors
from .dflash_proposer import DFlashProposer
from .dflash_row_sampling import SamplingSettings, penalize, warp
from .dflash_step import DFlashStep, StepRows
from .dflash_target_cache import TransformersTargetCache

logger = logging.get_logger(__name__)

# The span a step reads is the longest sequence rounded up to this many positions (fewer distinct mask shapes).
SPAN_BUCKET = 64
# A static step (`static_shapes`) reads back a power of two times this many positions. Each new shape is first run
# eagerly and then recorded, which costs far more than attending over unused positions does
# (benchmarks/batches-and-serving.md): short requests share one span, and longer ones step through few.
STATIC_SPAN_BUCKET = 256
# `record_shapes` (the manager's `warmup`) records the static step's spans up to this many positions, as the default
# pools hold sequences of up to 2,048 positions each (`max_tokens`); a longer request's first steps at each larger
# span record theirs as they come.
RECORD_SPAN_LIMIT = 2048
# A prompt is prefilled in forwards of at most this many positions (the default of `prefill_chunk`).
PREFILL_CHUNK = 512
# The most prompt tokens one packed prefill (`admit_many`) takes on a CPU. A packed forward attends from every token to
# every other of the pack, masked: beside one forward per prompt that is cheap on a GPU, while on a CPU its cost grows
# with the square of the pack (benchmarks/batches-and-serving.md).
CPU_PACK_TOKENS = 512
# The pools' default size, in sequences of the longest request (at most 2048 positions each): rows past it fill when
# requests are shorter, so that wide batches cost no more memory than this.
DEFAULT_MEMORY_SEQUENCES = 8


# Compiled drafter passes dynamo may keep: one per row count and span a process runs (its default, 8, would leave a
# long-lived process's ninth shape uncompiled, or with fullgraph raise).
DRAFTER_RECOMPILE_LIMIT = 64


def bucket_size(running: int, batch_size: int) -> int:
    """The rows a static step runs at for `running` sequences: the next power of two, at most the full batch, so that
    an engine records at most ceil(log2(b)) + 1 row counts per span."""
    return min(batch_size, 1 << max(running - 1, 0).bit_length())


def compile_drafter_pass(fn: Callable[[StepRows], tuple[torch.Tensor, torch.Tensor]]) -> Callable:
    """`fn` (the step's drafter pass, `DFlashStep.draft`) compiled by inductor for fixed shapes, as one graph (a break
    is an error, not a silent eager piece), and without CUDA graphs of its own: the engine records the whole step as
    one. Its calls may keep up to `DRAFTER_RECOMPILE_LIMIT` compiled versions."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)

    def run(rows: StepRows) -> tuple[torch.Tensor, torch.Tensor]:
        with dynamo_cache_size_limit(DRAFTER_RECOMPILE_LIMIT):
            return compiled(rows)

    return run


@dataclass
class EngineRows(StepRows):
    """`StepRows` with each row's sampling settings (all None when every row is greedy) and repetition penalty (None,
    and `presence` None, when no row has one)."""

    do_sample: torch.Tensor | None = None  # (n,) bool
    temperature: torch.Tensor | None = None  # (n,) float32
    top_k: torch.Tensor | None = None  # (n,) long, 0: off
    top_p: torch.Tensor | None = None  # (n,) float32
    repetition_penalty: torch.Tensor | None = None  # (n,) float32, 1: off
    logprobs: torch.Tensor | None = None  # (n, B) float32: the log-probability of each verified row's token, if kept


class StepPart(NamedTuple):
    """What one run of a static-shape step computes (each kind and width records its own graphs): "step", draft and
    verify `width` rows, the whole step; a step whose width the policy chooses on the host between its parts:
    "draft" (the drafts and their confidence, `width` unused) then "verify" (`width` rows of those drafts), or
    "plain" (the captured rows become context, and the anchor alone is verified; `width` 1)."""

    kind: str
    width: int


class RowScoring(NamedTuple):
    """What the rows' scores take before their tokens are chosen: a warp where some row samples, a repetition penalty
    where some row has one (a recorded step computes one of these kinds, so each has its own graphs)."""

    sampled: bool
    penalized: bool

    @classmethod
    def of(cls, settings: list[SamplingSettings]) -> "RowScoring":
        """The kind the rows of these settings need."""
        return cls(any(not s.greedy for s in settings), any(s.penalized for s in settings))


def token_logprobs(scores: torch.Tensor, tokens: torch.LongTensor) -> torch.Tensor:
    """(n, q) float32: the log-probability of each token (n, q) under the scores (n, q, V) it was chosen from, as
    transformers' manager reports it (the log of its softmax)."""
    return scores.float().log_softmax(dim=-1).gather(-1, tokens[..., None])[..., 0]


@dataclass
class DflashProposerState:
    """One sequence in one of the engine's rows, host side: the pages its block tables point at in each pool (taken
    when it is admitted, returned the step it ends), the position of its anchor (every position below it holds
    committed keys/values, each written once at its own position) and what it may still commit. The rest of its
    state lives in the engine's per-row device buffers, so that a step reads it without the host."""

    key: Hashable  # the caller's name for it
    position: int  # its anchor's position: prompt and committed tokens held, minus one
    max_length: int  # prompt + max_new_tokens: it commits at most max_length - position - 1 more tokens
    sampling: SamplingSettings
    target_pages: list[int] = field(default_factory=list)
    drafter_pages: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of tokens committed since the caller last took them

    @property
    def room(self) -> int:
        """The most tokens it may still commit: a verify of more rows than this only costs."""
        return self.max_length - self.position - 1


class PagedTargetCache:
    """The target's keys/values of rows 0..n-1, in a page pool they share. `write_slots` (n, q) are the positions
    of the forward in flight (set before it); `update` stores its keys/values (n, g, q, d) there through the block
    tables (n, pages) and returns the pages `read_pages` (n, P) of each row, positions 0..P * PAGE_SIZE - 1
    (n, g, P * PAGE_SIZE, d). A packed prefill (`DFlashEngine.admit_many`) sets `pool_slots` instead: the flat pool
    slots of its queries, which belong to several sequences. Rows that each own one stretch of the pool
    (`DFlashEngine`'s `contiguous_rows`) are read as views instead: `stretch`, `PagedDrafterCache.read_stretch`'s
    arguments."""

    def __init__(
        self, pool: PagedDrafterCache, block_tables: torch.Tensor | None, read_pages: torch.Tensor,
        stretch: tuple[int, int, int, int] | None = None,
    ):
        self.pool = pool
        self.block_tables = block_tables
        self.read_pages = read_pages
        self.stretch = stretch
        self._write_positions: torch.Tensor | None = None
        self.pool_slots: torch.Tensor | None = None

    @property
    def write_slots(self) -> torch.Tensor | None:
        return self._write_positions

    @write_slots.setter
    def write_slots(self, positions: torch.Tensor) -> None:
        # the forward's positions become pool slots once here, not once per layer in `update`
        self._write_positions = positions
        self.pool_slots = page_slots(self.block_tables, positions)

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.pool.write_rows(layer_idx, self.pool_slots, key, value)
        if self.stretch is not None:
            return self.pool.read_stretch(layer_idx, *self.stretch)
        return self.pool.read_pages(layer_idx, self.read_pages)


class PagedHybridCache(LinearStates, PagedTargetCache):
    """`PagedTargetCache` for a hybrid target's full-attention layers, plus the conv and recurrent states of its
    linear-attention layers for rows 0..n-1 (layer index -> views of the engine's per-row buffers), prefilled and
    rolled back by `LinearStates` (dflash_linear_state.py)."""

    def __init__(
        self,
        pool: PagedDrafterCache,
        block_tables: torch.Tensor,
        span: int,
        conv: dict[int, torch.Tensor],
        recurrent: dict[int, torch.Tensor],
        linear_layers: list[torch.nn.Module],
        stretch: tuple[int, int, int, int] | None = None,
    ):
        super().__init__(pool, block_tables, block_tables[:, : span // PAGE_SIZE], stretch)
        self.bind_linear_states(conv, recurrent, linear_layers, len(pool.key_pools))


class DFlashEngine(DFlashStep):
    """Rows of running sequences over shared page pools, advanced one DFlash verify step at a time.

    Args:
        target: the causal LM (hybrids with Gated DeltaNet layers included: Qwen3-Next, Qwen3.5/3.6).
        drafter: a DFlash drafter trained for it.
        max_batch_size: rows, the most sequences that run together.
        max_tokens: positions each pool holds, shared by the rows (default: max_batch_size sequences of
            max_sequence_length, at most 2048 each, and at most `DEFAULT_MEMORY_SEQUENCES` of them: more rows fill
            when requests are shorter, the others wait for pages).
        max_sequence_length: the longest request, prompt and new tokens (default: the target's context, and the
            drafter's when it has one).
        prefill_chunk: the most prompt positions one prefill forward takes; a longer prompt is prefilled in chunks,
            each reading the ones before it from the pages (the same tokens, less memory for its attention). Shorter
            prompts admitted together share forwards of at most this many positions (on a CPU at most
            `CPU_PACK_TOKENS`): `pack_tokens`.
        static_shapes: run every step at a bucketed shape, which a CUDA device records once as a CUDA graph per
            shape and then replays (None, the default: on a CUDA device). The rows run at
            the next power of two (rows past the running ones are idle: inactive, their pages a scratch page no
            sequence holds) and the span at the next power of two of STATIC_SPAN_BUCKET. On a CPU (True) the same padded
            step runs eagerly.
        adaptive: whether a `VerifyPolicy` chooses each step's width, down to plain steps (see the module's
            docstring). None (the default): on where the engine runs on a CPU without static shapes, off elsewhere
            (a GPU verifies a block in about the time of one row at small batches); True: a new
            `VerifyPolicy(whole_batch=True)`; a `VerifyPolicy`: that one, as given (its cost fit carries over; one
            engine at a time). The width is chosen on the host between the drafter and the verify: without static
            shapes its steps run eagerly at the running rows' shape, with them in two recorded parts (`StepPart`).
        return_logprobs: whether each committed token's log-probability is kept (`take_logprobs`): under the
            scores its token was chosen from (the raw logits of a greedy row, a sampled row's processed ones), as
            transformers' manager reports them with `return_logprobs`.
        onednn_linears: whether, on a CPU, the drafter's pass and every verify (drafts, or a plain step) run the
            models' float32 linear layers over weights prepacked for oneDNN (dflash_cpu_linears.py: a second copy
            of those weights, much faster products of 2 to 64 rows, and no slower for one). None
            (the default): where it pays and fits, with a warning where a float32 CPU engine goes without; False:
            never; True: required (an error says why it cannot be).
        contiguous_rows: whether each row owns one fixed stretch of each pool, a sequence's whole length (the
            pools then hold `max_batch_size` of them, whatever `max_tokens` says): the step's layers read every row's
            keys/values as a view of the pool, not a gather per layer, and a row that moves when another retires
            takes its keys/values with it (a copy). For `generate` calls, whose rows all start together
            (dflash_fast_path.py); requests of a server share their pages instead.
        transformers_cache: whether the target's keys/values (and a hybrid's linear states) live in each bound
            generate call's own transformers cache (`admit_call`'s `call_cache`) instead of the engine's pool: for
            the calls whose target the pool cannot serve (`fast_path_blocker`). The target then runs its own
            attention and masks, as in plain generate; the drafter's side, the step and its policy are the same.
            Implies `contiguous_rows` and eager steps (on a CPU its verifies run the same oneDNN products).
    """

    def __init__(
        self,
        target: torch.nn.Module,
        drafter: torch.nn.Module,
        max_batch_size: int = 8,
        max_tokens: int | None = None,
        max_sequence_length: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        static_shapes: bool | None = None,
        adaptive: bool | VerifyPolicy | None = None,
        return_logprobs: bool = False,
        contiguous_rows: bool = False,
        onednn_linears: bool | None = None,
        transformers_cache: bool = False,
    ):
        if adaptive is not None and not isinstance(adaptive, (bool, VerifyPolicy)):
            raise ValueError(f"adaptive must be True, False, None (on on a CPU) or a VerifyPolicy, got {adaptive!r}")
        text = target.config.get_text_config()
        if transformers_cache and static_shapes:
            raise ValueError("an engine over transformers' cache runs its steps eagerly, at the running rows' shape")
        paged = not transformers_cache  # whether the engine's pool holds the target's keys/values
        if paged and text.model_type in HYBRID_FAMILIES and (blocker := hybrid_blocker(target)) is not None:
            raise ValueError(f"DFlash continuous batching cannot serve this target: {blocker}")
        if paged and text.model_type not in HYBRID_FAMILIES and LINEAR in target_layer_types(text):
            raise ValueError(
                f"DFlash continuous batching serves the Gated DeltaNet layers of {', '.join(HYBRID_FAMILIES)} targets, "
                f"not the linear-attention layers of {text.model_type}; use generate(assistant_model=drafter)"
            )
        check_drafter_fits(drafter, target)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        device = drafter.fc.weight.device
        self.pack_tokens = prefill_chunk if device.type == "cuda" else min(prefill_chunk, CPU_PACK_TOKENS)
        limits = [text.max_position_embeddings, getattr(drafter.config, "max_position_embeddings", None)]
        context = min(limit for limit in limits if limit)
        self.max_sequence_length = min(max_sequence_length or context, context)
        block = drafter.config.block_size
        self.pages_per_row = -(-(self.max_sequence_length + block) // PAGE_SIZE)  # block table width
        self.contiguous_rows = contiguous_rows = contiguous_rows or transformers_cache
        if contiguous_rows:  # every row its whole stretch
            max_tokens = max_batch_size * self.pages_per_row * PAGE_SIZE
        elif max_tokens is None:  # whole pages per sequence: each reserves its own
            sequences = min(max_batch_size, DEFAULT_MEMORY_SEQUENCES)
            max_tokens = sequences * -(-(min(self.max_sequence_length, 2048) + block) // PAGE_SIZE) * PAGE_SIZE
        self.max_batch_size, self.max_tokens = max_batch_size, max_tokens
        # bitsandbytes' quantized layers are not tested inside a CUDA graph: their steps run eagerly
        graphs_allowed = device.type == "cuda" and paged and not bitsandbytes_quantized(target)
        if static_shapes is None:
            static_shapes = graphs_allowed
        self.static_shapes = static_shapes
        self.use_graphs = self.static_shapes and graphs_allowed
        # with static shapes, one page of each pool is the idle rows' scratch: never handed out, never read unmasked
        self.scratch_pages = 1 if self.static_shapes else 0
        num_pages = -(-max_tokens // PAGE_SIZE) + self.scratch_pages
        proposer = DFlashProposer(drafter, target, max_batch_size, num_pages)
        super().__init__(target, drafter, proposer, cache_argument(target))
        if onednn_linears and device.type != "cpu":
            raise ValueError(f"onednn_linears=True asks for oneDNN's CPU products, but this engine runs on {device}")
        if onednn_linears is not False and device.type == "cpu":
            self.use_onednn_linears(required=onednn_linears is True)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        # Over transformers' cache the target's pool only counts pages (every layer keyless), and its linear states
        # are the cache's, rolled back by `TransformersTargetCache`.
        self.hybrid = self.hybrid and paged
        linear = linear_attention_modules(target) if self.hybrid else {}
        num_layers = len(decoder_layers(target))
        self.target_pool = PagedDrafterCache(
            num_layers=num_layers, num_pages=num_pages, num_key_value_heads=text.num_key_value_heads,
            head_dim=head_dim, dtype=target.dtype, device=device,
            keyless_layers=frozenset(linear) if paged else frozenset(range(num_layers)),
        )
        # a hybrid's linear layers: per row, conv (b, conv_dim, K) and recurrent (b, heads, dk, dv) states per layer
        self.linear_layers = list(linear.values())
        self.conv, self.recurrent = linear_state_buffers(linear, max_batch_size, target.dtype, device)
        self.drafter_pool = proposer.cache
        b, long = max_batch_size, dict(dtype=torch.long, device=device)
        self.target_tables = torch.zeros(b, self.pages_per_row, **long)
        self.drafter_tables = torch.zeros(b, self.pages_per_row, **long)
        self.anchor_ids = torch.zeros(b, 1, **long)
        self.anchor_pos = torch.zeros(b, **long)
        self.prev_pos = torch.zeros(b, **long)
        self.max_length = torch.zeros(b, **long)
        self.active = torch.zeros(b, **long)  # 1 for rows 0..n-1, which run; 0 for the idle rows after them
        self.drafts = torch.zeros(b, block - 1, **long)
        # A step in parts (`StepPart`): the drafts' confidence the host reads between them, and under a bound call's
        # rejection sampling the distributions the drafts were drawn from (b, B - 1, V), allocated by `bind`.
        self.confidence = torch.zeros(b, block - 1, dtype=torch.float32, device=device)
        self.draft_probs: torch.Tensor | None = None
        self.out = torch.zeros(b, block + 1, **long)
        self.verify_positions = torch.zeros(b, block, **long)
        self.draft_block_slots = torch.zeros(b, block, **long)
        self.verify_rows = torch.zeros(b, block, drafter.config.num_context_features, dtype=drafter.fc.weight.dtype,
                                       device=device)
        self.do_sample = torch.zeros(b, dtype=torch.bool, device=device)
        self.temperature = torch.ones(b, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(b, **long)
        self.top_p = torch.ones(b, dtype=torch.float32, device=device)
        self.repetition_penalty = torch.ones(b, dtype=torch.float32, device=device)
        # the tokens each row's repetition penalty counts (its prompt and committed tokens), kept for penalized rows
        vocab = target.get_output_embeddings().weight.shape[0]
        self.presence = torch.zeros(b, vocab, dtype=torch.bool, device=device)
        self.return_logprobs = return_logprobs
        self.logprobs = torch.zeros(b, block, dtype=torch.float32, device=device) if return_logprobs else None
        # A generate call's rows (`bind`, `admit_call`): the padding each row of plain generate's input_ids holds,
        # wherever it lies (what its processors count in a prefix's length), and the verify rows' scores / logits
        # (b, B, V) float32, allocated only for a call that returns them.
        self.padding = torch.zeros(b, **long)
        self.call_processors = False
        # The call's sequences as plain generate holds them (padding included), which processors that read the whole
        # prefix are called with (`StepProcessors`); None unless the call has such processors.
        self.call_tokens: list[list[int]] | None = None
        self.scores: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.vocab_size = vocab
        self.per_row = (
            self.target_tables, self.drafter_tables, self.anchor_ids, self.anchor_pos, self.prev_pos, self.max_length,
            self.verify_rows, self.do_sample, self.temperature, self.top_k, self.top_p, self.repetition_penalty,
            self.presence, self.padding, *self.conv.values(), *self.recurrent.values(),
        )
        self.sequences: list[DflashProposerState] = []  # row i runs sequences[i]
        # Whether a bound generate call compiles the drafter's pass (`bind`), and why compiling failed, if it did.
        self.compile_drafter = False
        self.compile_error: str | None = None
        if self.static_shapes:
            self.scratch = (self.target_pool.take(1)[0], self.drafter_pool.take(1)[0])
            for row in range(b):
                self._idle(row)
        # CUDA graphs by shape (`StepPart`, rows, span, `RowScoring`); shapes run once eagerly before being recorded
        self.graphs: dict[tuple[StepPart, int, int, RowScoring], torch.cuda.CUDAGraph] = {}
        self.warmed_shapes: set[tuple[StepPart, int, int, RowScoring]] = set()
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # One stream for every shape's first, eager run: the caching allocator keeps freed memory per stream, so a new
        # stream per shape would hold each shape's working memory apart and ask the driver for fresh memory every time.
        self.warm_up_stream = torch.cuda.Stream(device) if self.use_graphs else None
        # Totals since construction: row-steps verified and drafts they accepted (tau = 1 + accepted / row_steps),
        # steps per verified width (1: plain steps, which skip the drafter; a ragged step's widest), the rows
        # verified, and the steps whose sequences verified different widths.
        self.row_steps = 0
        self.accepted_drafts = 0
        self.width_steps: Counter[int] = Counter()
        self.verified_rows_total = 0
        self.ragged_steps = 0
        if adaptive is None:
            adaptive = device.type == "cpu" and not self.static_shapes
        if isinstance(adaptive, VerifyPolicy):
            self.policy: VerifyPolicy | None = adaptive
        else:
            self.policy = VerifyPolicy(whole_batch=True) if adaptive else None
        # Why a step cannot verify each sequence its own width, packed (`PackedQueries`), or None where it can: that
        # takes eager steps over the pool, no linear-attention states (their layers advance a row per batch row), and
        # attention through the grouped function, the one that unpacks the queries.
        self.ragged_blocker = (
            "static shapes (a step of one recorded shape)" if self.static_shapes
            else "the target's keys/values live in transformers' cache" if not paged
            else "a hybrid target's linear-attention layers" if self.hybrid
            else "the target's attention is not sdpa" if not attends_grouped(target) else None
        )
        self._say_if_one_width()
        # The most rows a step verifies, anchor included (a bound generate call's `dflash_verify_rows` may lower it).
        self.verify_cap = block
        # After a step of a chosen width, how many captured rows (from each row's `prev_pos`) the next step stores as
        # drafter context (`store_context`): the largest accepted count + 1, or the rows plain steps left waiting;
        # `waiting_rows`: that count when every row waits exactly that many, so that a plain step may leave its own
        # row waiting behind them (None when rows wait different counts). A newly admitted row waits for none (it
        # was prefilled).
        self.context_rows = 1
        self.waiting_rows: int | None = 0

    @property
    def ragged_verify(self) -> bool:
        """Whether a drafted step verifies each sequence the width its policy chose for it (`row_widths`)."""
        return self.policy is not None and self.policy.per_sequence and self.ragged_blocker is None

    def _width_cap(self) -> int:
        """The widest verify a chosen-width step may take: the cap, and no more rows than the largest room (no row
        commits more than its room, so a wider verify would only cost)."""
        return min(self.verify_cap, max(sequence.room for sequence in self.sequences))

    def _say_if_one_width(self) -> None:
        """Log, at info level, why a policy that would give each sequence its own width verifies one here."""
        if self.policy is not None and self.policy.per_sequence and self.ragged_blocker is not None:
            logger.info(f"DFlash: every sequence of a step verifies the same width here: {self.ragged_blocker}")

    def use_onednn_linears(self, required: bool) -> None:
        """Prepack the target's and the drafter's linear weights for oneDNN (`onednn_linears`), the draft
        vocabulary's head among the drafter's, or say why not."""
        blocker = onednn_linears_blocker(self.target)
        if blocker is None:
            self.target_linears = OneDNNLinears(self.target)
            draft_head = self.proposer.draft_head
            kept = [draft_head.kept] if draft_head is not None and draft_head.kept is not None else []
            self.drafter_linears = OneDNNLinears(self.drafter, *kept)
            return
        message = f"the CPU verify runs without prepacked oneDNN weights (slower from 2 to 16 rows): {blocker}"
        if required:
            raise ValueError(message)
        if self.target.dtype == torch.float32:  # a bfloat16 model on a CPU is no float32 engine to warn about
            logger.warning_once(message)

    # -- room ---------------------------------------------------------------------------------------------------

    def pages_for(self, prompt_length: int, max_new_tokens: int) -> int:
        """Pages a request holds in each pool at its longest: its prompt, its new tokens and the block after its last
        anchor (with `max_new_tokens` 0, what it takes when admitted)."""
        return -(-(prompt_length + max_new_tokens + self.block_size) // PAGE_SIZE)

    def _next_step_pages(self, sequence: DflashProposerState, ahead: int = 0) -> int:
        """Pages `sequence` holds once it has those of every position its next step writes (up to the block after its
        anchor: the verify's keys/values, the drafter's block and the captured rows it stores), or of `ahead`
        positions more; never more than it holds at its longest."""
        return self.pages_for(min(sequence.position + ahead, sequence.max_length), 0)

    def _growth(self, steps: int = 1) -> int:
        """Pages the running sequences' next `steps` steps may need beyond those they hold (a step commits at most a
        block)."""
        if self.contiguous_rows:
            return 0
        ahead = (steps - 1) * self.block_size
        return sum(max(self._next_step_pages(s, ahead) - len(s.target_pages), 0) for s in self.sequences)

    def _free_pages(self) -> int:
        return min(len(self.target_pool.free_pages), len(self.drafter_pool.free_pages))

    def _capacity(self) -> int:
        """Pages a sequence can hold at most in each pool: all but the idle rows' scratch page."""
        return self.target_pool.num_pages - self.scratch_pages

    def pages_short(self) -> int:
        """How many more pages the running sequences' next step needs than are free (0 when it can run): the caller
        retires some (preempts) before `run_step`."""
        return max(self._growth() - self._free_pages(), 0)

    def _grow(self) -> None:
        """Give every running sequence the pages its next step writes into, in both pools and block tables."""
        if self.contiguous_rows:  # each row owns its whole stretch
            return
        if self.pages_short():
            raise RuntimeError("run_step called without pages for its writes (check pages_short first, and retire "
                               "some requests); this is a bug: please report it")
        for row, sequence in enumerate(self.sequences):
            held = len(sequence.target_pages)
            more = self._next_step_pages(sequence) - held
            if more <= 0:
                continue
            sequence.target_pages += self.target_pool.take(more)
            sequence.drafter_pages += self.drafter_pool.take(more)
            for table, pages in ((self.target_tables, sequence.target_pages),
                                 (self.drafter_tables, sequence.drafter_pages)):
                table[row, held : held + more] = torch.tensor(pages[held:], device=table.device)

    def check_request(self, prompt_length: int, max_new_tokens: int) -> None:
        """ValueError naming the limit for a request this engine can never hold."""
        if prompt_length < 1 or max_new_tokens < 1:
            raise ValueError(
                f"a request needs a prompt and max_new_tokens >= 1; got {prompt_length} prompt tokens and "
                f"max_new_tokens={max_new_tokens}"
            )
        length = prompt_length + max_new_tokens
        if length > self.max_sequence_length:
            raise ValueError(
                f"the prompt ({prompt_length} tokens) and max_new_tokens ({max_new_tokens}) come to {length} tokens, "
                f"more than a sequence may hold here ({self.max_sequence_length}: the target's and the drafter's "
                "context); send a shorter prompt or fewer new tokens"
            )
        if self.pages_for(prompt_length, max_new_tokens) > self._capacity():
            raise ValueError(
                f"the prompt ({prompt_length} tokens) and max_new_tokens ({max_new_tokens}) need more than the "
                f"engine's whole memory ({self.max_tokens} tokens per model); raise max_tokens or ask for fewer tokens"
            )

    def fits_now(self, prompt_length: int, max_new_tokens: int, ahead: list[tuple[int, int]] = ()) -> bool:
        """Whether a free row and the request's pages for its first two steps are there now, after the requests
        `ahead` of it (their (prompt length, max_new_tokens)), which `admit_many` would admit with it, took theirs,
        with the pages the running sequences' next two steps take still free (with `contiguous_rows`, a free row:
        each owns its stretch). A request takes the rest of its pages as it grows."""
        if self.contiguous_rows:
            return len(self.sequences) + len(ahead) < self.max_batch_size
        if self.pages_for(prompt_length, max_new_tokens) > self._capacity():
            return False  # it never fits (`check_request`)
        # Room for two steps of every sequence, running or admitted here, not one: a request admitted into the last
        # free pages would be preempted at the next step and admitted again at once, over and over. Each request
        # counts what it would count running (its first pages and its next step's), so that admitting them one by
        # one, after the ones ahead, agrees.
        pages = sum(self.pages_for(length, min(self.block_size, new))
                    for length, new in [*ahead, (prompt_length, max_new_tokens)])
        free = self._free_pages() - self._growth(steps=2)
        return len(self.sequences) + len(ahead) < self.max_batch_size and pages <= free

    def pool_usage(self) -> dict[str, int]:
        """Pages used and held by each pool (used 0 when no sequence runs)."""
        usage = {}
        for name, pool in (("drafter", self.drafter_pool), ("target", self.target_pool)):
            usage[f"{name}_pages_used"] = pool.num_pages - self.scratch_pages - len(pool.free_pages)
            usage[f"{name}_pages_total"] = pool.num_pages - self.scratch_pages
        return usage

    def compute_free_capacity(self) -> float:
        """The fraction of the fuller pool still free (what transformers serve reports of its manager's cache)."""
        pools = (self.target_pool, self.drafter_pool)
        return min(len(pool.free_pages) / (pool.num_pages - self.scratch_pages) for pool in pools)

    # -- joining and leaving -------------------------------------------------------------------------------------

    @torch.no_grad()
    def admit(self, key: Hashable, prompt: list[int], max_new_tokens: int, sampling: SamplingSettings) -> int:
        """Prefill `prompt` into the next free row and return its first token; the other rows are untouched. The
        caller checked `fits_now`. On an error the row and its pages stay free."""
        self.check_request(len(prompt), max_new_tokens)
        if not self.fits_now(len(prompt), max_new_tokens):
            raise RuntimeError("admit called without room (check fits_now first); this is a bug: please report it")
        row = len(self.sequences)
        sequence = self._place(row, key, prompt, max_new_tokens, sampling)
        try:
            with one_call_at_a_time(self.target, self.drafter), self.proposer.capture:
                first, logprob = self._prefill(row, torch.tensor([prompt], device=self.anchor_ids.device), sampling)
        except BaseException:
            self._give_back(sequence)
            raise
        self._start(row, sequence, first, logprob)
        return int(first)

    @torch.no_grad()
    def admit_many(
        self, requests: list[tuple[Hashable, list[int], int, SamplingSettings]]
    ) -> list[int | Exception]:
        """`admit` for several requests (key, prompt, max_new_tokens, sampling), in that order: per request its first
        token, or the exception that kept it out (the others are admitted all the same). The caller checked that they
        fit together (`fits_now` with the ones before each as `ahead`).

        Where their prompts come to at most `pack_tokens` tokens, they are prefilled in one target forward, packed
        end to end into one sequence whose tokens see their own prompt only: one forward instead of one per request,
        as transformers' manager packs its prefills. A hybrid target's linear-attention layers cannot tell packed
        prompts apart, and a longer total is chunked per prompt: those requests, and any whose packed forward
        raised, are admitted one at a time (so a fault stays with its request)."""
        if len(requests) < 2 or self.hybrid or sum(len(prompt) for _, prompt, _, _ in requests) > self.pack_tokens:
            return [self._admit_or_error(*request) for request in requests]
        first_row = len(self.sequences)
        placed = []
        try:
            for _, prompt, max_new_tokens, _ in requests:
                self.check_request(len(prompt), max_new_tokens)
            for row, request in enumerate(requests, first_row):
                placed.append(self._place(row, *request))
            with one_call_at_a_time(self.target, self.drafter), self.proposer.capture:
                prompts = [prompt for _, prompt, _, _ in requests]
                scoring = RowScoring.of([sampling for *_, sampling in requests])
                firsts, logprobs = self._prefill_packed(first_row, prompts, scoring)
        except BaseException as error:
            for sequence in placed:
                self._give_back(sequence)
            if not isinstance(error, Exception):
                raise
            return [self._admit_or_error(*request) for request in requests]
        for i, sequence in enumerate(placed):
            self._start(first_row + i, sequence, firsts[i], None if logprobs is None else logprobs[i])
        return firsts.tolist()

    # -- a generate call's rows ------------------------------------------------------------------------------------

    def bind(
        self, processors: StepProcessors, rule: DecodingRule, keep_scores: bool, keep_logits: bool,
        compile_drafter: bool = False, policy: VerifyPolicy | None = None, verify_rows: int | None = None,
        tokens: list[list[int]] | None = None,
    ) -> None:
        """Serve a `generate` call (dflash_decoding.py): its rows' tokens are chosen under the call's logits processors
        and decoding rule (the drafts sampled from the drafter under rejection sampling) instead of per-request
        settings, and the step writes the verify rows' scores / logits out when the call returns them. The call's
        `policy` (its `dflash_adaptive`) chooses each step's width, and `verify_rows` (its `dflash_verify_rows`,
        default the block) caps it (at static shapes the steps run at widths of `_width_bucket`). `tokens[i]`: call
        row i's ids so far as plain generate holds them (the call's host hooks keep them up to date), read by the
        processors that run on the host, whose steps run eagerly at the running rows' shape. A recorded graph baked
        in what it was recorded with: the graphs are kept only for a call that computes the same."""
        self.policy = policy
        self._say_if_one_width()
        self.verify_cap = verify_rows or self.block_size
        self.call_tokens = tokens if processors.host_only else None
        kept = (self.scores is not None, self.logits is not None)
        if compile_drafter != self.compile_drafter:
            self._drop_graphs()
            self.drafter_passes = {}
            self.compile_drafter = compile_drafter
        # a step in parts under rejection sampling hands the drafts' distributions from one part to the next
        in_parts = rule.rejection and self.static_shapes and policy is not None
        if in_parts != (self.draft_probs is not None):
            self._drop_graphs()  # a recorded verify part reads the buffer it was recorded with
            self.draft_probs = torch.zeros(
                self.max_batch_size, self.block_size - 1, self.vocab_size, device=self.anchor_ids.device
            ) if in_parts else None
        same = (rule, processors.signature, (keep_scores, keep_logits)) == (
            self.rule, self.processors.signature, kept
        )
        self.call_processors = True
        if self.graphs and same:
            return
        self._drop_graphs()
        self.rule, self.processors = rule, processors
        block, vocab, device = self.block_size, self.vocab_size, self.anchor_ids.device
        self.scores = torch.zeros(self.max_batch_size, block, vocab, device=device) if keep_scores else None
        self.logits = torch.zeros(self.max_batch_size, block, vocab, device=device) if keep_logits else None

    def _drop_graphs(self) -> None:
        """Forget every recorded step; later ones record into a new memory pool (CUDA refuses to record into a pool
        whose graphs were all freed)."""
        self.graphs, self.warmed_shapes = {}, set()
        if self.use_graphs:
            self.graph_pool = torch.cuda.graph_pool_handle()

    @torch.no_grad()
    def admit_call(
        self, input_ids: torch.LongTensor, attention_mask: torch.Tensor, max_length: int, processors: StepProcessors,
        call_cache: TransformersTargetCache | None = None,
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """A bound `generate` call's batch (b, P) as sequences 0..b-1 in rows 0..b-1, each up to the call's
        `max_length` (padding included, as generate counts it). Its prompts are prefilled without their padding
        (wherever the mask has it: `fast_path_blocker` says where that gives plain generate's tokens), at positions
        0..n-1; each first token is chosen under the call's own processors `processors` exactly as plain generate
        chooses it (every processor called once on the whole batch). Returns the first tokens, their scores (b, 1, V)
        and raw logits (b, 1, V). An engine over transformers' cache (`transformers_cache`) takes the call's
        `call_cache`, which prefills the padded batch as plain generate does and serves the call's verifies until
        `retire_all`."""
        if self.sequences:
            raise RuntimeError("admit_call needs an empty engine; this is a bug: please report it")
        if (call_cache is None) != self.target_pool.holds_keys:
            raise ValueError("admit_call takes a call_cache exactly where the engine has transformers_cache=True")
        batch, padded_length = input_ids.shape
        real = attention_mask.bool()
        prompts = [[token for token, kept in zip(*row) if kept] for row in zip(input_ids.tolist(), real.tolist())]
        max_new_tokens = max_length - padded_length
        for prompt in prompts:
            self.check_request(len(prompt), max_new_tokens)
        if self.policy is not None:  # the call's rows 0..b-1, from the prior; the cost fit carries over
            self.policy.start(batch)
        placed = []
        try:
            for row, prompt in enumerate(prompts):
                placed.append(self._place(row, row, prompt, max_new_tokens, SamplingSettings()))
            with self.proposer.capture:
                if call_cache is None:
                    logits = self._prefill_call_logits(prompts)
                else:
                    logits = self._prefill_call_cache(call_cache, input_ids, real)
                    self.call_cache = call_cache
        except BaseException:
            for sequence in placed:
                self._give_back(sequence)
            raise
        scores = processors.first_token_scores(input_ids, logits[:, 0])[:, None]
        tokens, _ = accept(scores, input_ids[:, :0], self.rule.do_sample, None)
        first = tokens[:, 0]
        self.padding[:batch] = padded_length - real.sum(dim=1)
        if processors.penalty is not None:
            self.presence[:batch] = processors.prompt_presence(input_ids, self.vocab_size)
            self.presence[torch.arange(batch, device=first.device), first] = True
        for row, sequence in enumerate(placed):
            self._start(row, sequence, first[row], None)
        return first.tolist(), scores, logits

    def _prefill_call_logits(self, prompts: list[list[int]]) -> torch.Tensor:
        """The last logits (b, 1, V) of rows 0..b-1 after their prompts' prefill. The prompts are laid left-aligned in
        one batch (b, L), L the longest, as plain generate prefills its padded batch in one forward (in chunks of
        `prefill_chunk` positions past that). A shorter row's padding runs at its positions after its prompt, whose
        keys/values and context every step writes again before it reads them, as it does a rejected draft's. A
        hybrid target's linear-attention states would run on through that padding, so its prompts go one by one."""
        device = self.anchor_ids.device
        if self.hybrid:
            return torch.cat([
                self._prefill_logits(row, torch.tensor([prompt], device=device)) for row, prompt in enumerate(prompts)
            ])
        longest = max(map(len, prompts))
        input_ids = torch.tensor([prompt + [0] * (longest - len(prompt)) for prompt in prompts], device=device)
        last = torch.tensor([len(prompt) - 1 for prompt in prompts], device=device)  # (b,)
        logits = None
        for start in range(0, longest, self.prefill_chunk):
            end = min(start + self.prefill_chunk, longest)
            ending = ((last >= start) & (last < end)).nonzero()[:, 0]  # rows whose prompt ends in this chunk
            keep, column = torch.unique(last[ending] - start, return_inverse=True)
            chunk = self._prefill_chunk(slice(0, len(prompts)), input_ids[:, start:end], start, keep)  # (b, k, V)
            if logits is None:
                logits = chunk.new_empty(len(prompts), 1, chunk.shape[-1])
            logits[ending, 0] = chunk[ending, column]
        return logits

    def _prefill_call_cache(
        self, call_cache: TransformersTargetCache, input_ids: torch.LongTensor, real: torch.Tensor
    ) -> torch.Tensor:
        """The padded batch's prompt forward into transformers' cache (`TransformersTargetCache.prefill`); each row's
        real tokens' captured rows become its drafter context at positions 0..n-1. Returns the last logits (b, 1, V)."""
        device = self.anchor_ids.device
        captured = self.verify_rows.new_empty(*input_ids.shape, self.verify_rows.shape[-1])  # (b, P, features)
        self.proposer.capture.destination = captured
        try:
            logits = call_cache.prefill(input_ids).to(device)
        finally:
            self.proposer.capture.destination = None
        lengths = real.sum(dim=1).tolist()
        # every row's real tokens in one drafter pass, each at its own positions 0..n-1 and in its own pages
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]  # (1, T)
        slots = torch.cat([
            page_slots(self.drafter_tables[row : row + 1], torch.arange(n, device=device)[None])
            for row, n in enumerate(lengths)
        ], dim=1)
        self.proposer.write_context(captured[real.to(device)][None], positions, slots)
        return logits

    def verified_rows(self, key: Hashable) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The last step's scores and raw logits (B, V) of `key`'s verify rows (None where not kept): views of the
        step's buffers, which the next step overwrites."""
        if self.scores is None and self.logits is None:
            return None, None
        row = next(i for i, sequence in enumerate(self.sequences) if sequence.key == key)
        return (
            None if self.scores is None else self.scores[row],
            None if self.logits is None else self.logits[row],
        )

    @property
    def hands_back_caches(self) -> bool:
        """Whether `copy_into_cache` can give a sequence's keys/values to transformers' cache as plain decoding would
        hold them: every layer of the target attends over its whole history (no sliding window, no Gated DeltaNet
        states)."""
        return not self.hybrid and self.target_window is None and self.target_pool.holds_keys

    @torch.no_grad()
    def copy_into_cache(self, key: Hashable, cache: object) -> None:
        """Store `key`'s target keys/values of every position before its anchor in `cache`, an empty transformers
        cache, layer by layer (`update`): what plain generate's cache holds after the same tokens (all but the last,
        which it has not read yet), so that generate can continue from it. Only where `hands_back_caches`."""
        row = next(i for i, sequence in enumerate(self.sequences) if sequence.key == key)
        positions = torch.arange(self.sequences[row].position, device=self.anchor_ids.device)
        slots = page_slots(self.target_tables[row : row + 1], positions[None])  # (1, L)
        for layer in range(len(self.target_pool.key_pools)):
            keys, values = self.target_pool.read(layer, slots)  # (1, g, L, d) gathered copies
            cache.update(keys, values, layer)

    def retire_all(self) -> None:
        """Free every row and its pages (a call ended, also by an exception); a bound call's transformers cache is
        the call's again."""
        self.retire_many([sequence.key for sequence in self.sequences])
        self.call_cache = None

    def retire_many(self, keys: list[Hashable]) -> None:
        """`retire` each of `keys`, the last rows first: a row that ends with those after it moves nobody into its
        place (with `contiguous_rows`, no keys/values are copied)."""
        if not keys:  # most steps of a call end no row
            return
        rows = {sequence.key: row for row, sequence in enumerate(self.sequences)}
        for key in sorted(keys, key=rows.__getitem__, reverse=True):
            self.retire(key)

    def _admit_or_error(self, *request: object) -> int | Exception:
        try:
            return self.admit(*request)
        except Exception as error:
            return error

    def _place(
        self, row: int, key: Hashable, prompt: list[int], max_new_tokens: int, sampling: SamplingSettings
    ) -> DflashProposerState:
        """Take a request's pages and point `row`'s block tables and sampling settings at them (not yet running)."""
        length = len(prompt)
        if self.contiguous_rows:  # the row's own stretch
            pages = self.pages_per_row
            stretch = self._stretch_pages(row)
            taken = self.target_pool.take_pages(stretch), self.drafter_pool.take_pages(stretch)
        else:  # its prompt's and its first block's; more as it grows (`_grow`)
            pages = self.pages_for(length, 0)
            taken = self.target_pool.take(pages), self.drafter_pool.take(pages)
        sequence = DflashProposerState(key, length, length + max_new_tokens, sampling, *taken)
        tables = ((self.target_tables, sequence.target_pages), (self.drafter_tables, sequence.drafter_pages))
        for table, taken in tables:
            table[row].zero_()
            table[row, :pages] = torch.tensor(taken, device=self.anchor_ids.device)
        self._set_sampling(row, sampling)
        if sampling.penalized:  # the prompt's tokens count from its first token on
            self.presence[row] = False
            self.presence[row, torch.tensor(prompt, device=self.presence.device)] = True
        return sequence

    def _start(
        self, row: int, sequence: DflashProposerState, first: torch.Tensor, logprob: torch.Tensor | None
    ) -> None:
        """A prefilled row runs from the next step on, its first token the anchor (`logprob`: its log-probability,
        when kept)."""
        self.anchor_ids[row, 0] = first
        if logprob is not None:
            sequence.logprobs.append(float(logprob))
        if sequence.sampling.penalized:
            self.presence[row, first] = True
        self.active[row] = 1
        self.anchor_pos[row] = self.prev_pos[row] = sequence.position  # the first step has no verify rows to store
        self.max_length[row] = sequence.max_length
        # the row waits for no captured rows: so do all only if the running ones do too
        self.waiting_rows = 0 if not self.sequences or self.waiting_rows == 0 else None
        self.sequences.append(sequence)
        if self.policy is not None:
            self.policy.add(sequence.key)

    def _set_sampling(self, row: int, sampling: SamplingSettings) -> None:
        sampled = not sampling.greedy
        self.do_sample[row] = sampled
        self.temperature[row] = sampling.temperature if sampled else 1.0  # a greedy row's argmax needs no warp
        self.top_k[row] = sampling.top_k
        self.top_p[row] = sampling.top_p
        self.repetition_penalty[row] = sampling.repetition_penalty

    def _prefill(
        self, row: int, input_ids: torch.LongTensor, sampling: SamplingSettings
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt forward of one row (1, P) (`_prefill_logits`), and its first token (a 0-d tensor) under its own
        sampling settings, with its log-probability when kept."""
        logits = self._prefill_logits(row, input_ids)
        first, logprob = self._first_tokens(logits, slice(row, row + 1), RowScoring.of([sampling]))
        return first[0], None if logprob is None else logprob[0]

    def _prefill_logits(self, row: int, input_ids: torch.LongTensor) -> torch.Tensor:
        """The prompt forward of one row (1, P), in chunks of at most `prefill_chunk` positions: keys/values to its
        pages, captured rows to the drafter's context. Returns the last position's logits (1, 1, V). A chunk's queries
        see the chunks before it through the pages, so the result is that of one forward, while the attention scores
        and masks of a forward stay (chunk x span) rather than (P x P)."""
        length = input_ids.shape[1]
        for start in range(0, length, self.prefill_chunk):
            end = min(start + self.prefill_chunk, length)
            logits = self._prefill_chunk(slice(row, row + 1), input_ids[:, start:end], start)
        return logits

    def _first_tokens(
        self, logits: torch.Tensor, rows: slice, scoring: RowScoring
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first tokens (k,) of rows `rows` from their prompts' last logits (k, 1, V), each under its own
        settings, and their log-probabilities (k,) when kept."""
        no_drafts = logits.new_zeros(logits.shape[0], 0, dtype=torch.long)
        scores, do_sample = self._scores(logits, no_drafts, **self._sampling(rows, scoring))
        tokens, _ = accept(scores, no_drafts, do_sample, None)
        return tokens[:, 0], None if self.logprobs is None else token_logprobs(scores, tokens)[:, 0]

    def _prefill_chunk(
        self, rows: slice, input_ids: torch.LongTensor, start: int, logits_to_keep: int | torch.Tensor = 1
    ) -> torch.Tensor:
        """Positions start..start+c-1 of the prompts of `rows` (input_ids (n, c)); returns the logits (n, k, V) of the
        chunk's last position, or of its columns `logits_to_keep` (k,)."""
        n, width = input_ids.shape
        positions = torch.arange(start, start + width, device=input_ids.device).expand(n, width)  # (n, c)
        span = self._span(start + width)
        cache = self._target_cache(rows, span)
        cache.write_slots = positions
        keys = torch.arange(span, device=input_ids.device)
        visible = keys[None, None, :] <= positions[:1, :, None]  # (1, c, span): the same for every row
        captured = self.verify_rows.new_empty(n, width, self.verify_rows.shape[-1])
        self.proposer.capture.destination = captured
        # a hybrid's linear layers start the row from empty states at its first chunk and carry them on through the
        # next ones (the prompt has no padding to mask)
        try:
            with cache.prefilling() if self.hybrid and start == 0 else contextlib.nullcontext():
                logits = self.target(
                    input_ids=input_ids,
                    position_ids=positions,
                    attention_mask=self.target_masks(visible, positions[:1], keys),
                    use_cache=True,
                    logits_to_keep=logits_to_keep,
                    **{self.cache_argument: cache},
                ).logits  # (n, k, V)
        finally:
            self.proposer.capture.destination = None
        self.proposer.write_context(captured, positions, page_slots(self.drafter_tables[rows], positions))
        return logits

    def _prefill_packed(
        self, first_row: int, prompts: list[list[int]], scoring: RowScoring
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_prefill_packed_logits`, then each prompt's first token under its own sampling settings (`scoring`: of
        them all). Returns the first tokens (k,) and their log-probabilities (k,) when kept."""
        logits = self._prefill_packed_logits(first_row, prompts)
        return self._first_tokens(logits, slice(first_row, first_row + len(prompts)), scoring)

    def _prefill_packed_logits(self, first_row: int, prompts: list[list[int]]) -> torch.Tensor:
        """The prompts of rows first_row.. in one target forward (1, T), T their total length: each prompt's keys and
        values go to its own row's pages, each token reads back its own prompt's pages only (a block-diagonal causal
        mask). Returns each prompt's last logits (k, 1, V)."""
        device = self.anchor_ids.device
        rows = range(first_row, first_row + len(prompts))
        lengths = torch.tensor([len(prompt) for prompt in prompts], device=device)
        pages = -(-lengths // PAGE_SIZE)
        positions = torch.cat([torch.arange(len(prompt), device=device) for prompt in prompts])[None]  # (1, T)
        key_positions = torch.cat([torch.arange(n * PAGE_SIZE, device=device) for n in pages.tolist()])[None]  # (1, K)
        prompt_of_query = torch.repeat_interleave(torch.arange(len(prompts), device=device), lengths)  # (T,)
        prompt_of_key = torch.repeat_interleave(torch.arange(len(prompts), device=device), pages * PAGE_SIZE)  # (K,)
        visible = (prompt_of_query[:, None] == prompt_of_key[None, :]) & (key_positions <= positions[0, :, None])
        read_pages = torch.cat([self.target_tables[row, :n] for row, n in zip(rows, pages.tolist())])[None]  # (1, P)
        cache = PagedTargetCache(self.target_pool, None, read_pages)

        def slots(tables: torch.Tensor) -> torch.Tensor:  # (1, T) flat pool slots of every prompt's positions
            return torch.cat([page_slots(tables[row : row + 1], torch.arange(len(prompt), device=device)[None])
                              for row, prompt in zip(rows, prompts)], dim=1)

        cache.pool_slots = slots(self.target_tables)
        captured = self.verify_rows.new_empty(1, positions.shape[1], self.verify_rows.shape[-1])
        self.proposer.capture.destination = captured
        try:
            logits = self.target(
                input_ids=torch.tensor([[token for prompt in prompts for token in prompt]], device=device),
                position_ids=positions,
                attention_mask=self.target_masks(visible[None], positions, key_positions),
                use_cache=True,
                logits_to_keep=lengths.cumsum(0) - 1,  # each prompt's last position
                **{self.cache_argument: cache},
            ).logits[0, :, None]  # (k, 1, V)
        finally:
            self.proposer.capture.destination = None
        self.proposer.write_context(captured, positions, slots(self.drafter_tables))
        return logits

    def retire(self, key: Hashable) -> None:
        """Free `key`'s row and pages at once; the last row moves into its place."""
        row = next(i for i, sequence in enumerate(self.sequences) if sequence.key == key)
        last = len(self.sequences) - 1
        self._give_back(self.sequences[row])
        if self.policy is not None:
            self.policy.remove(key)
        if row != last:
            moved = self.sequences[last]
            tables = (self.target_tables, self.drafter_tables)
            for buffer in self.per_row:
                if self.contiguous_rows and any(buffer is table for table in tables):
                    continue  # the row keeps its stretch; the moving sequence's keys/values come into it
                buffer[row] = buffer[last]
            if self.contiguous_rows:
                self._move_stretch(last, row, moved)
            self.sequences[row] = moved
        if self.call_cache is not None:
            self.call_cache.move(row, last)
        self.sequences.pop()
        self.active[last] = 0
        if self.static_shapes:
            self._idle(last)

    def _stretch_pages(self, row: int) -> list[int]:
        """The pages `row` owns in each pool with `contiguous_rows` (after the scratch page)."""
        first = self.scratch_pages + row * self.pages_per_row
        return list(range(first, first + self.pages_per_row))

    def _move_stretch(self, source: int, row: int, sequence: DflashProposerState) -> None:
        """With `contiguous_rows`: `sequence` moves from row `source` to `row`, whose stretch is free: its keys/values
        below its anchor are copied there in both pools (the step writes the rest before it reads them: the target's
        from the anchor on, the drafter's from the verify rows the row's buffers carry), and it holds that stretch's
        pages instead of its old ones."""
        slots = self.pages_per_row * PAGE_SIZE
        start, to = (self.scratch_pages * PAGE_SIZE + r * slots for r in (source, row))
        held = sequence.position
        for pool in (self.target_pool, self.drafter_pool):
            for buffer in (*pool.key_pools, *pool.value_pools):
                if buffer.shape[0]:  # a hybrid's linear layers keep no keys
                    buffer[to : to + held] = buffer[start : start + held]
        self.target_pool.give_back(sequence.target_pages)
        self.drafter_pool.give_back(sequence.drafter_pages)
        sequence.target_pages = self.target_pool.take_pages(self._stretch_pages(row))
        sequence.drafter_pages = self.drafter_pool.take_pages(self._stretch_pages(row))

    def _stretch(self, rows: slice, span: int) -> tuple[int, int, int, int]:
        """`PagedDrafterCache.read_stretch`'s arguments for `rows` (a slice with a stop) reading positions 0..span-1."""
        slots = self.pages_per_row * PAGE_SIZE
        first = rows.start or 0
        return self.scratch_pages * PAGE_SIZE + first * slots, rows.stop - first, slots, span

    def _idle(self, row: int) -> None:
        """Make an inactive `row` (its `active` 0: its anchor never moves, it commits nothing) safe to run idle in a
        padded step: its pages the scratch page, its positions 0."""
        self.target_tables[row] = self.scratch[0]
        self.drafter_tables[row] = self.scratch[1]
        for buffer in (self.anchor_ids, self.anchor_pos, self.prev_pos, self.max_length):
            buffer[row] = 0

    def _give_back(self, sequence: DflashProposerState) -> None:
        self.target_pool.give_back(sequence.target_pages)
        self.drafter_pool.give_back(sequence.drafter_pages)
        sequence.target_pages, sequence.drafter_pages = [], []

    # -- the step ---------------------------------------------------------------------------------------------------

    def _target_cache(self, rows: slice, span: int) -> PagedTargetCache | None:
        """The target's cache for a forward of `rows` reading positions 0..span-1 (a hybrid's: with those rows'
        linear-attention states); None where the call's transformers cache holds the target's keys/values."""
        if not self.target_pool.holds_keys:
            return None
        stretch = self._stretch(rows, span) if self.contiguous_rows else None
        if not self.hybrid:
            tables = self.target_tables[rows]
            return PagedTargetCache(self.target_pool, tables, tables[:, : span // PAGE_SIZE], stretch)
        conv = {i: state[rows] for i, state in self.conv.items()}
        recurrent = {i: state[rows] for i, state in self.recurrent.items()}
        return PagedHybridCache(
            self.target_pool, self.target_tables[rows], span, conv, recurrent, self.linear_layers, stretch
        )

    def _step_span(self) -> int:
        """Positions a step of the running rows reads back: the longest sequence's, with a block. Where a generate
        call's step is recorded or its drafter's pass compiled (`contiguous_rows` rows), every row's whole stretch:
        one shape per row count, so that the pass is compiled, and the step recorded, once per row count, not again at
        every span a long call reaches."""
        if self.contiguous_rows and (self.use_graphs or self.compile_drafter):
            return self.pages_per_row * PAGE_SIZE
        return self._span(max(sequence.position for sequence in self.sequences) + self.block_size)

    def _span(self, longest: int) -> int:
        """Positions a forward reads back: `longest` rounded up to SPAN_BUCKET, within the block tables."""
        return min(-(-longest // SPAN_BUCKET) * SPAN_BUCKET, self.pages_per_row * PAGE_SIZE)

    def _sampling(self, rows: slice, scoring: RowScoring) -> dict[str, torch.Tensor | None]:
        """`EngineRows`' sampling and penalty fields for `rows`: their settings where `scoring` asks, else None."""
        sampling = {name: getattr(self, name)[rows] if scoring.sampled else None
                    for name in ("do_sample", "temperature", "top_k", "top_p")}
        penalty = {name: getattr(self, name)[rows] if scoring.penalized else None
                   for name in ("presence", "repetition_penalty")}
        return {**sampling, **penalty}

    @staticmethod
    def _scores(
        logits: torch.Tensor, drafts: torch.LongTensor, do_sample: torch.Tensor | None,
        temperature: torch.Tensor | None, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
        presence: torch.Tensor | None, repetition_penalty: torch.Tensor | None,
    ) -> tuple[torch.Tensor, bool | torch.Tensor]:
        """Scores (n, q, V) to choose tokens from, and do_sample: False where no row samples, else per row (n,).
        drafts (n, q - 1): the verified drafts, which row j's repetition penalty counts up to j."""
        if presence is not None:
            logits = penalize(logits, presence, drafts, repetition_penalty)
        if do_sample is None:
            return logits, False
        return warp(logits, temperature, top_k, top_p), do_sample

    def choose(
        self, rows: EngineRows, logits: torch.Tensor, drafts: torch.LongTensor, draft_probs: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.LongTensor, torch.LongTensor]:
        """Each row's own repetition penalty and sampling settings (greedy rows: the argmax), with the drafter's argmax
        as its proposal; the tokens' log-probabilities go to `rows.logprobs` when kept. Under a bound generate call,
        the call's processors and decoding rule (`DFlashStep.choose`)."""
        if self.call_processors:
            return super().choose(rows, logits, drafts, draft_probs)
        scores, do_sample = self._scores(
            logits, drafts, rows.do_sample, rows.temperature, rows.top_k, rows.top_p, rows.presence,
            rows.repetition_penalty,
        )
        tokens, accepted = accept(scores, drafts, do_sample, None)
        if rows.logprobs is not None:
            rows.logprobs[:, : tokens.shape[1]].copy_(token_logprobs(scores, tokens))
        return scores, tokens, accepted

    def _static_shape(self, n: int, span: int) -> tuple[int, int]:
        """The bucketed (rows, span) a padded step runs at: powers of two, within the rows and the block tables."""
        rows = bucket_size(n, self.max_batch_size)
        buckets = 1 << max(-(-span // STATIC_SPAN_BUCKET) - 1, 0).bit_length()
        return rows, min(buckets * STATIC_SPAN_BUCKET, self.pages_per_row * PAGE_SIZE)

    def _rows(self, n: int, span: int, scoring: RowScoring) -> EngineRows:
        """The step's view of rows 0..n-1 reading positions 0..span-1. Everything here is device work on the engine's
        buffers, so that a CUDA graph records it with the step."""
        positions = torch.arange(span, device=self.anchor_ids.device)
        return EngineRows(
            anchor_ids=self.anchor_ids[:n],
            anchor_pos=self.anchor_pos[:n],
            prev_pos=self.prev_pos[:n],
            active=self.active[:n],
            max_length=self.max_length[:n],
            drafts=self.drafts[:n],
            out=self.out[:n],
            block_tables=self.drafter_tables[:n],
            verify_rows=self.verify_rows[:n],
            verify_positions=self.verify_positions[:n],
            key_positions=positions,
            draft_key_positions=positions,
            target_cache=self._target_cache(slice(0, n), span),
            drafter_view=StretchView(
                self.drafter_pool, self.draft_block_slots[:n], self._stretch(slice(0, n), span)
            ) if self.contiguous_rows else PagedView(
                self.drafter_pool, self.draft_block_slots[:n],
                read_slots=page_slots(self.drafter_tables[:n], positions.expand(n, -1)),
            ),
            **self._scoring_fields(n, scoring),
        )

    def _scoring_fields(self, n: int, scoring: RowScoring) -> dict[str, torch.Tensor | None]:
        """`EngineRows`' fields for how rows 0..n-1 choose their tokens: each request's own settings and kept
        log-probabilities, or under a bound generate call (`bind`) its penalty set, padding and kept scores / logits."""
        if not self.call_processors:
            return dict(logprobs=None if self.logprobs is None else self.logprobs[:n],
                        **self._sampling(slice(0, n), scoring))
        device = self.anchor_ids.device
        return dict(
            presence=self.presence[:n] if self.processors.penalty is not None else None,
            prefixes=None if self.call_tokens is None else [
                torch.tensor([self.call_tokens[sequence.key]], device=device) for sequence in self.sequences[:n]
            ],
            scores=None if self.scores is None else self.scores[:n],
            logits=None if self.logits is None else self.logits[:n],
            padding=self.padding[:n],
        )

    def _run_rows(self, n: int, span: int, scoring: RowScoring, part: StepPart | None = None) -> None:
        """Run `part` (default: the whole step at the full width) over rows 0..n-1, reading positions 0..span-1."""
        part = part or StepPart("step", self.block_size)
        with one_call_at_a_time(self.target, self.drafter), self.proposer.capture:
            rows = self._rows(n, span, scoring)
            if part.kind == "plain":
                self.store_context(rows)
                self.verify(rows, None, 1)
            elif part.kind == "verify":
                self.verify(rows, None if self.draft_probs is None else self.draft_probs[:n], part.width)
            else:
                self._prepare_drafter(rows)
                proposal, draft_logits = self.propose(rows)
                if part.kind == "step":
                    self.verify(rows, proposal.probs, part.width)
                else:  # "draft": what the host and the verify part read
                    self.confidence[:n].copy_(
                        width_confidence(proposal, draft_logits, self.drafter.config.is_dflash2)
                    )
                    if self.draft_probs is not None:
                        self.draft_probs[:n].copy_(proposal.probs)

    def _prepare_drafter(self, rows: EngineRows) -> None:
        """When a bound generate call compiles the drafter's pass (`bind`), compile it for this many rows and run it
        once (its first run also tunes kernels), before any graph records the step (a call's step reads every row's
        whole stretch, so the row count fixes its shape). Leaves the device state as a step would find it: a pass
        rewrites the last verify's context rows as they were, and block slots the step overwrites. If compiling
        fails, a warning says why and the step keeps the eager pass."""
        n = rows.anchor_ids.shape[0]
        if not self.compile_drafter or self.compile_error is not None or n in self.drafter_passes:
            return
        # A warning, not an info line: the call waits tens of seconds on a cold compile cache, and transformers shows
        # only warnings by default.
        logger.warning_once(
            "DFlash: compiling the drafter's pass of the fast path with torch.compile, for each batch size the step "
            "runs at (about half a minute per batch size on an H200 with a cold compile cache; that call takes "
            "longer, later ones are faster); pass dflash_compile=False to generate to keep it eager."
        )
        started = time.perf_counter()
        compiled = compile_drafter_pass(self.draft)
        try:
            with grouped_attention(self.drafter):
                # Eagerly first: the grouped attention asks torch's sdpa dispatcher once per kind of call and keeps the
                # answer, which a compiled trace can read but not ask (dflash_attention.py).
                self.draft(rows)
                compiled(rows)
        except Exception as error:  # any failure to compile leaves the eager pass, never a failed call
            lines = str(error).strip().splitlines()
            self.compile_error = f"{type(error).__name__}: {lines[0][:300] if lines else ''}"
            logger.warning_once(
                f"DFlash: compiling the drafter's pass failed ({self.compile_error}); the fast path runs it eagerly "
                "(the same tokens, each step somewhat slower). Pass dflash_compile=False to generate to skip the "
                "attempt."
            )
            return
        logger.info(f"DFlash: compiled the drafter's pass for {n} rows in {time.perf_counter() - started:.1f} s")
        self.drafter_passes[n] = compiled

    def _run_static(self, part: StepPart, n: int, span: int, scoring: RowScoring) -> bool:
        """`part` of the padded step at shape (n, span): on a CUDA device its first run is eager, on a side stream (the
        warm-up a capture needs; it is a real step), its second records the graph, which then replays; elsewhere
        eager. Returns whether its time is a step's (a replay, or an eager run without graphs), not a first run's."""
        shape = (part, n, span, scoring)
        if not self.use_graphs:
            self._run_rows(n, span, scoring, part)
            return True
        if shape in self.graphs:
            self.graphs[shape].replay()
            return True
        if shape not in self.warmed_shapes:
            side = self.warm_up_stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._run_rows(n, span, scoring, part)
            torch.cuda.current_stream().wait_stream(side)
            self.warmed_shapes.add(shape)
        else:  # recording runs nothing: the replay right after it is the step
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                self._run_rows(n, span, scoring, part)
            self.graphs[shape] = graph
            graph.replay()
        return False

    def _width_bucket(self, width: int) -> int:
        """The width a step in parts verifies for a chosen `width`: the next power of two, at most `verify_cap`
        (more verified drafts never change the output, and at most log2(B) + 1 verify graphs per shape)."""
        return min(1 << (width - 1).bit_length(), self.verify_cap)

    def _static_parts(self) -> list[StepPart]:
        """Every part a static step may run under the current policy and cap."""
        if self.policy is None:
            return [StepPart("step", self.verify_cap)]
        widths = {self._width_bucket(width) for width in range(1, self.verify_cap + 1)}
        return [StepPart("draft", self.block_size), StepPart("plain", 1), *(StepPart("verify", w) for w in widths)]

    @torch.no_grad()
    def record_shapes(self) -> None:
        """With static shapes and no sequence running, run the step of greedy rows (or under a policy each of its
        parts, `_static_parts`) twice at every row bucket and span bucket up to `RECORD_SPAN_LIMIT` positions (the
        largest shapes first, so that on a GPU the smaller graphs reuse their memory in the shared pool), over idle
        rows: on a CUDA device its eager run, then its recording,
        so that requests of up to that many positions never wait for a new shape while they are served, as
        transformers' manager records its graphs in `warmup`. Idle rows commit nothing and write only the scratch
        pages. Nothing to do without static shapes or while sequences run."""
        if not self.static_shapes or self.sequences:
            return
        greedy = RowScoring(sampled=False, penalized=False)
        longest = min(self.max_sequence_length + self.block_size, RECORD_SPAN_LIMIT)
        shapes = {self._static_shape(n, span) for n in range(1, self.max_batch_size + 1)
                  for span in [*range(1, longest, STATIC_SPAN_BUCKET), longest]}
        for rows, span in sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape), reverse=True):
            for part in self._static_parts():
                for _ in range(2):
                    self._run_static(part, rows, span, greedy)

    @torch.no_grad()
    def run_step(self) -> dict[Hashable, list[int]]:
        """One verify step over every row, at the full width or at the policy's; returns per sequence the tokens it
        committed (1 to the width; the step reads the device once, twice under the policy). The caller retires what
        ended (eos, its max_new_tokens) before the next step, and makes room for its writes (`pages_short`)."""
        n = len(self.sequences)
        if n == 0:
            return {}
        self._grow()
        span = self._step_span()
        scoring = RowScoring.of([sequence.sampling for sequence in self.sequences])
        keys = [sequence.key for sequence in self.sequences]
        width, confidence, draft_seconds, verify_started = self.verify_cap, None, None, None
        # Eager, at the running rows' shape: processors called on the host, or without static shapes a width chosen
        # between draft and verify
        on_host = self.call_tokens is not None or not self.static_shapes and (
            self.policy is not None or self.verify_cap < self.block_size
        )
        widths = None  # a ragged step's per sequence
        if on_host:
            with one_call_at_a_time(self.target, self.drafter), self.proposer.capture:
                started = time.perf_counter()
                rows = self._rows(n, span, scoring)
                width, confidence, draft_probs, waits = self._draft_at_width(rows, keys)
                if isinstance(width, list):
                    widths, width = width, max(width)
                verify_started = time.perf_counter()
                draft_seconds = None if confidence is None else verify_started - started
                packed = None if widths is None else PackedQueries.of(widths, self.anchor_ids.device, span)
                self.verify(rows, draft_probs, width, self.waiting_rows if waits else None, packed)
        elif self.static_shapes and self.policy is not None:
            width, confidence, draft_seconds, verify_started = self._run_in_parts(n, span, scoring, keys)
        elif self.static_shapes:
            self._run_static(StepPart("step", width), *self._static_shape(n, span), scoring)
        else:
            self._run_rows(n, span, scoring)
        out = self.out[:n].tolist()  # the step's host synchronization (the policy's second)
        accepted = [row[self.block_size] for row in out]
        if self.call_cache is not None:
            self.call_cache.commit(width, accepted)
        if self.policy is not None:
            verify_seconds = None if verify_started is None else time.perf_counter() - verify_started
            self.policy.record(keys, widths or width, accepted, confidence, draft_seconds, verify_seconds)
        if on_host:
            if waits:  # a plain step's row joins those waiting
                self.waiting_rows = self.context_rows = self.waiting_rows + 1
            else:
                self.context_rows = max(accepted) + 1
                self.waiting_rows = accepted[0] + 1 if len(set(accepted)) == 1 else None
        else:
            self.context_rows, self.waiting_rows = self.block_size, None
        self.width_steps[width] += 1
        self.verified_rows_total += width * n if widths is None else sum(widths)
        self.ragged_steps += widths is not None
        self.row_steps += n
        self.accepted_drafts += sum(accepted)
        logprobs = None if self.logprobs is None else self.logprobs[:n].tolist()
        committed = {}
        for i, (sequence, row, taken) in enumerate(zip(self.sequences, out, accepted)):
            sequence.position += taken + 1
            committed[sequence.key] = row[: taken + 1]
            if logprobs is not None:
                sequence.logprobs += logprobs[i][: taken + 1]
        return committed

    def take_logprobs(self, key: Hashable) -> list[float]:
        """The log-probabilities of the tokens `key` committed since the last call (its first token's included), in
        order; empty unless the engine keeps them (`return_logprobs`)."""
        if self.logprobs is None:  # the manager asks at every commit: no search over the rows when none are kept
            return []
        sequence = next(sequence for sequence in self.sequences if sequence.key == key)
        taken, sequence.logprobs = sequence.logprobs, []
        return taken

    def _run_in_parts(
        self, n: int, span: int, scoring: RowScoring, keys: list[Hashable]
    ) -> tuple[int, list[list[float]] | None, float | None, float | None]:
        """A step at a static shape whose width the policy chooses: the drafter's part, the host's choice from the
        drafts' confidence, then the verify's part at that width's bucket (`_width_bucket`); or, when the policy
        skips the drafter, the plain part. Returns the width verified, the drafts' confidence (None on a plain step),
        the drafter part's seconds, and when the verify part started (each None where that part ran for the first
        time at its shape: a warm-up or a recording is no step's timing)."""
        rows, span = self._static_shape(n, span)
        cap = self._width_cap()
        confidence, draft_seconds, part = None, None, StepPart("plain", 1)
        if cap > 1 and self.policy.should_draft(keys):
            started = time.perf_counter()
            timed = self._run_static(StepPart("draft", self.block_size), rows, span, scoring)
            # Read from the drafter's state alone (`width_confidence`), as in `_draft_at_width`.
            confidence = self.confidence[:n].tolist()
            draft_seconds = time.perf_counter() - started if timed else None
            part = StepPart("verify", self._width_bucket(self.policy.width(keys, confidence, cap)))
        verify_started = time.perf_counter()
        timed = self._run_static(part, rows, span, scoring)
        return part.width, confidence, draft_seconds, verify_started if timed else None

    def _draft_at_width(
        self, rows: EngineRows, keys: list[Hashable]
    ) -> tuple[int | list[int], list[list[float]] | None, torch.Tensor | None, bool]:
        """Before the verify of a step whose width is chosen: draft, and take the width the drafts' confidence pays
        for under the policy (or the cap without one); or under the policy a plain step (width 1, the drafter's
        layers skipped), which stores the captured rows as context or leaves them waiting for the next drafted step
        (one pass of the drafter's context weights costs about as much for many rows as for one on a CPU). Returns
        the width (with `ragged_verify`, per sequence where the policy chose different ones), the drafts' confidence
        (n, B - 1) as read back (None on a plain step or without a policy), the distributions the drafts were
        sampled from under rejection sampling (else None) and whether the captured rows wait."""
        cap = self._width_cap()
        if self.policy is None:
            return cap, None, self.propose(rows, self.context_rows)[0].probs, False
        if cap > 1 and self.policy.should_draft(keys):
            # The width is read from the drafter's state alone, never from a sampled draft or the target's random
            # draws (`width_confidence`): the verified drafts and the acceptance rule stay those of a full step.
            proposal, draft_logits = self.propose(rows, self.context_rows)
            confidence = width_confidence(proposal, draft_logits, self.drafter.config.is_dflash2).tolist()
            if not self.ragged_verify:
                return self.policy.width(keys, confidence, cap), confidence, proposal.probs, False
            caps = [min(self.verify_cap, sequence.room) for sequence in self.sequences]
            widths = self.policy.row_widths(keys, confidence, caps)
            return widths if len(set(widths)) > 1 else widths[0], confidence, proposal.probs, False
        if self.waiting_rows is not None and self.waiting_rows < self.block_size:  # room behind them
            return 1, None, None, True
        self.store_context(rows, self.context_rows)
        return 1, None, None, False


__all__ = [
    "CPU_PACK_TOKENS", "DEFAULT_MEMORY_SEQUENCES", "DRAFTER_RECOMPILE_LIMIT", "DFlashEngine", "EngineRows", "StepPart",
    "DflashProposerState", "PREFILL_CHUNK", "PagedHybridCache", "PagedTargetCache", "RECORD_SPAN_LIMIT", "SPAN_BUCKET",
    "STATIC_SPAN_BUCKET", "bucket_size", "compile_drafter_pass",
]
