"""Grouped-query attention for the fast path's forwards, reading the caches without expanding key/value heads.

Given a mask, transformers' sdpa attention copies every key/value head G times (`repeat_kv`, G = heads per key/value
head) before calling `scaled_dot_product_attention`, because torch's fused CUDA kernels do not all take a mask and
grouped heads together. A verify step attends 16 rows to every position the step reads back, so that copy of all L slots
of every layer dominates its growth with context (benchmarks/step-cost.md).

Two ways to read each key/value head once, chosen per call:
- On CUDA, torch's sdpa takes grouped heads itself (`enable_gqa=True`) when its dispatch serves the call with a fused
  kernel (cuDNN's attention, or the memory-efficient one where it takes grouped heads): that kernel reads key/value
  head i // G for query head i in place, and the (b, 1, q, L) mask broadcasts over the heads as it is. Whether a
  fused kernel takes the call depends on the torch build (cuDNN version, GPU, and each torch release's own checks),
  so the call asks torch's own dispatcher (`_fused_sdp_choice`, the function `scaled_dot_product_attention` itself
  consults) instead of guessing from version numbers. When only the math backend would take it, enable_gqa would
  copy every key/value head (`repeat_interleave`), so that call folds.
- Elsewhere (CPU, or a CUDA call no fused kernel takes) the G query heads of a group become G blocks of rows of one
  head: query (b, h, q, d) is viewed as (b, g, G * q, d) against key/value (b, g, L, d), and the mask is repeated
  over the group's rows. This is an ordinary multi-head sdpa call with a mask, which every sdpa backend that takes a
  mask serves. transformers does the same for one query row (`pack_gqa`, 5.24).
On an H200 with torch 2.11 both ran cuDNN's attention, and enable_gqa was 2.5-4.5% faster per step: it copies
neither the query nor the mask per layer (benchmarks/step-cost.md).

`grouped_attention(*models)` switches the models whose attention is "sdpa" to this function for the forwards inside
it (it is registered in transformers' AttentionInterface under `GROUPED_SDPA`) and puts every config back on exit,
also on an exception. The switch is seen by this thread's forwards only: in another thread the function is plain sdpa.

A ragged verify (the engine's policy verifying a different number of rows per sequence) packs its queries: the
target's forward runs on one row of T = sum of the widths tokens, so that its linear layers cost the rows verified
and no padding, while each sequence's keys/values are read back per sequence as always. Inside
`packed_queries(layout)`, this thread's grouped attention places the packed queries at their sequence and column of
a padded (n, W) block (`PackedQueries`), attends per sequence under the verify's (n, 1, W, L) mask, and packs the
output again. Padding costs attention only, never a linear layer; where one sequence verifies far more rows than
the others, the block's columns are attended in spans (all sequences up to a column, the wider ones past it), so
that the narrow ones are not padded to the widest.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import SDPBackend
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .dflash_compat import (
    attention_implementation, has_attention_implementation, register_attention, sdpa_backend_choice,
    sdpa_backends_enabled, set_attention_implementation,
)

# No "flash" in the name: transformers takes any implementation whose name contains it for flash attention.
GROUPED_SDPA = "grouped_query_sdpa"
# torch's SDPBackend numbers of its fused kernels (flash, memory-efficient, cuDNN); 0 is the math backend.
FUSED_SDPA_BACKENDS = frozenset(
    int(getattr(SDPBackend, name)) for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
)

# The dispatcher's answers so far: (metadata of query, key, value and mask, device, dropout, scale, enabled backends)
# -> whether a fused kernel takes grouped heads.
FUSED_CHOICES: dict[tuple, bool] = {}
# What one more attention call of a ragged verify costs, in padded query rows times key positions attended: on a CPU
# a call's fixed cost is about that of 32 more rows over 512 positions (benchmarks/batches-and-serving.md).
SPAN_CALL_COST = 32 * 512
# Per thread: how many `grouped_attention` blocks it is inside, and the layout of its packed queries while in
# `packed_queries`.
_GROUPED_HERE = threading.local()


def fused_kernel_takes_grouped_heads(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, dropout: float, scale: float | None
) -> bool:
    """Whether torch's sdpa would serve this masked call with `enable_gqa=True` by a fused CUDA kernel, which reads
    the grouped key/value heads in place. Asked of torch's own dispatcher for the exact tensors (shapes, strides,
    dtypes, mask), its priority order and the backends the user left enabled; host work only, so a CUDA graph records
    the call it picks. Off CUDA: False (the CPU kernels are left to the fold, which every backend serves)."""
    if query.device.type != "cuda":
        return False
    return dispatcher_takes_grouped_heads(query, key, value, mask, dropout, scale)


def dispatcher_takes_grouped_heads(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, dropout: float, scale: float | None
) -> bool:
    """torch's sdpa dispatcher's answer for this call with `enable_gqa=True`: a fused kernel or not. The answer depends
    only on the tensors' metadata and the enabled backends (the priority order is taken as set once per process), so
    it is asked once per kind of call and kept (`FUSED_CHOICES`). Keeping it also lets a compiled forward read it:
    torch.compile cannot trace the dispatcher's integer answer, so the fast path runs each drafter pass it compiles
    eagerly once first (dflash_fast_path.py)."""
    call = (
        *((tuple(t.shape), t.stride(), t.dtype) for t in (query, key, value, mask)), query.device, dropout, scale,
        *sdpa_backends_enabled(),
    )
    if call not in FUSED_CHOICES:
        FUSED_CHOICES[call] = sdpa_backend_choice(query, key, value, mask, dropout, scale) in FUSED_SDPA_BACKENDS
    return FUSED_CHOICES[call]


def cuts(widths: list[int], key_positions: int) -> list[int]:
    """The ends of the column spans a ragged verify's attention runs in (`PackedQueries.spans`), the last being the
    widest width: of the cuts at the sequences' widths, those of the least attention, a span from column a to b
    costing (sequences wider than a) x (b - a) x key_positions, plus `SPAN_CALL_COST` for its call (a shortest path
    over the distinct widths)."""
    ends = sorted(set(widths))
    wider = {first: sum(width > first for width in widths) for first in (0, *ends)}
    best = {0: (0.0, [])}  # column -> (least cost of spans up to it, their ends)
    for end in ends:
        best[end] = min(
            (cost + SPAN_CALL_COST + wider[first] * (end - first) * key_positions, [*path, end])
            for first, (cost, path) in best.items()
        )
    return best[ends[-1]][1]


@dataclass(frozen=True)
class ColumnSpan:
    """Columns first..first + width - 1 of the padded block, for the sequences that verify past column `first`:
    attention runs them in one call, each padded to the span's end. `rows`: which sequences (None: all of them, in
    order); `tokens`: the span's queries among the T packed ones, each at sequence `row` of the span (0..m-1) and
    column `column` within it."""

    rows: torch.Tensor | None  # (m,) long
    first: int
    width: int
    tokens: torch.Tensor  # (T_s,) long
    row: torch.Tensor  # (T_s,) long
    column: torch.Tensor  # (T_s,) long


@dataclass(frozen=True)
class PackedQueries:
    """Where the T packed queries of a ragged verify sit in the padded block (n, W): query t is column `column[t]` of
    sequence `sequence[t]`, sequence i's w_i queries in order (T = sum w_i, W = max w_i).

    `spans`: how attention covers the block (`ColumnSpan`). Each query row attends on its own, so the block may be
    cut by columns: all sequences up to some column, then the ones still going up to a later column, and so on, so
    that a sequence verifying one row beside one verifying sixteen is not attended at sixteen; only the keys/values
    of the sequences past the first span are copied. Where to cut (`cuts`): at the fewest padded query rows times
    key positions, each span charged `SPAN_CALL_COST` more for its call.
    """

    sequence: torch.Tensor  # (T,) long
    column: torch.Tensor  # (T,) long
    widths: torch.Tensor  # (n,) long, w_i
    width: int  # W
    spans: tuple[ColumnSpan, ...]

    @classmethod
    def of(cls, widths: list[int], device: torch.device, key_positions: int = 0) -> "PackedQueries":
        """The layout of sequences verifying widths[i] rows each, whose attention reads `key_positions` positions
        (0: one span)."""
        sequence = torch.repeat_interleave(torch.arange(len(widths)), torch.tensor(widths))
        column = torch.cat([torch.arange(width) for width in widths])
        starts = [0, *itertools.accumulate(widths)]
        spans, first = [], 0
        for end in cuts(widths, key_positions):
            members = [i for i, width in enumerate(widths) if width > first]
            counts = [min(widths[i], end) - first for i in members]
            spans.append(ColumnSpan(
                rows=None if first == 0 else torch.tensor(members, device=device),
                first=first,
                width=end - first,
                tokens=torch.cat([torch.arange(starts[i] + first, starts[i] + first + count)
                                  for i, count in zip(members, counts)]).to(device),
                row=torch.repeat_interleave(torch.arange(len(members)), torch.tensor(counts)).to(device),
                column=torch.cat([torch.arange(count) for count in counts]).to(device),
            ))
            first = end
        return cls(sequence.to(device), column.to(device), torch.tensor(widths, device=device), max(widths),
                   tuple(spans))

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(n, W, ...) -> (1, T, ...): each sequence's first w_i columns, in order."""
        return padded[self.sequence, self.column][None]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(1, T, ...) -> (n, W, ...), zeros past each sequence's width."""
        padded = packed.new_zeros(self.widths.shape[0], self.width, *packed.shape[2:])
        padded[self.sequence, self.column] = packed[0]
        return padded


@contextmanager
def packed_queries(layout: PackedQueries) -> Iterator[None]:
    """Within (and inside `grouped_attention`): this thread's grouped attention takes packed queries (1, h, T, d)
    of `layout` against per-sequence keys/values (n, g, L, d) and returns packed output (1, T, h, d)."""
    _GROUPED_HERE.packed = layout
    try:
        yield
    finally:
        _GROUPED_HERE.packed = None


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """sdpa over query (b, h, q, d) and key/value (b, g, L, d) with h = G * g, under `attention_mask` (bool, or
    additive float) broadcastable to (b, h, q, L). Returns (b, q, h, d) and no weights, as transformers' sdpa does.
    Inside `packed_queries`, query (1, h, T, d) holds the packed queries of b sequences (returns (1, T, h, d)).

    Without a mask (transformers' sdpa then uses grouped heads natively), with one head per group, or with an
    argument only transformers' sdpa handles (position bias, softcap), the call goes to transformers' sdpa as is."""
    # Only packed queries attend one row of queries to several sequences' keys/values. Testing the shapes first keeps
    # the thread-local lookup out of every other call, the drafter's compiled pass among them.
    if query.shape[0] == key.shape[0]:
        return _grouped_sdpa(module, query, key, value, attention_mask, dropout, scaling, kwargs), None
    queries = query[0].transpose(0, 1)  # (T, h, d)
    spans = _GROUPED_HERE.packed.spans
    out = None if len(spans) == 1 else query.new_empty(queries.shape[0], queries.shape[1], value.shape[-1])
    for span in spans:
        keys, values, mask = key, value, attention_mask
        if span.rows is not None:
            keys, values = key.index_select(0, span.rows), value.index_select(0, span.rows)
            mask = None if mask is None else mask.index_select(0, span.rows)
        if mask is not None and mask.shape[2] > 1:  # (m, 1 or h, W, L): the span's columns
            mask = mask[:, :, span.first : span.first + span.width]
        padded = queries.new_zeros(keys.shape[0], span.width, *queries.shape[1:])  # (m, w, h, d)
        padded[span.row, span.column] = queries[span.tokens]
        attended = _grouped_sdpa(module, padded.transpose(1, 2), keys, values, mask, dropout, scaling, kwargs)
        if out is None:  # one span: its tokens are all T, in order
            return attended[span.row, span.column][None], None
        out[span.tokens] = attended[span.row, span.column]
    return out[None], None


def _grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                  kwargs: dict[str, Any]) -> torch.Tensor:
    """`grouped_sdpa_attention`'s output (b, q, h, d) for unpacked queries."""
    b, h, q, d = query.shape
    g = key.shape[1]
    groups = h // g
    if attention_mask is None or groups == 1 or kwargs.get("position_bias") is not None or kwargs.get("softcap"):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )[0]
    if fused_kernel_takes_grouped_heads(query, key, value, attention_mask, dropout, scaling):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )  # (b, h, q, d_v)
        return out.transpose(1, 2).contiguous()
    # Query head i reads key/value head i // G (transformers' repeat_kv order), so heads [j * G, (j + 1) * G) become
    # the rows of head j. Only the query (q rows) may be copied here; the keys/values (L slots) are read in place.
    folded = query.reshape(b, g, groups * q, d)  # (b, g, G * q, d)
    mask = attention_mask  # (b, 1 or h, q or 1, L)
    mask_batch, mask_heads, mask_rows, kv = mask.shape
    if mask_heads == 1 and mask_rows > 1:  # (b, 1, q, L) -> (b, 1, G * q, L): every head's rows see the same keys
        mask = mask[:, :, None].expand(mask_batch, 1, groups, q, kv).reshape(mask_batch, 1, groups * q, kv)
    elif mask_heads > 1:  # (b, h, q, L) -> (b, g, G * q, L), the same grouping as the query
        mask = mask.expand(mask_batch, h, q, kv).reshape(mask_batch, g, groups * q, kv)
    # else (b, 1, 1, L): one row of keys for every query row, which broadcasts over the folded rows as it is
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )  # (b, g, G * q, d_v)
    return out.reshape(b, h, q, -1).transpose(1, 2).contiguous()


register_attention(GROUPED_SDPA, grouped_sdpa_attention)


# Per model, the configs `_configs` found: an eager step enters `grouped_attention` twice, and walking every module of
# the target each time would be host work paid at every step.
_CONFIGS: "weakref.WeakKeyDictionary[torch.nn.Module, list[Any]]" = weakref.WeakKeyDictionary()


def _configs(model: torch.nn.Module) -> list[Any]:
    """Every distinct config the model's modules read their attention implementation from (a composite model's
    sub-configs included), found once per model."""
    if model not in _CONFIGS:
        found: dict[int, Any] = {}
        for module in model.modules():
            config = getattr(module, "config", None)
            if has_attention_implementation(config):
                found.setdefault(id(config), config)
        _CONFIGS[model] = list(found.values())
    return _CONFIGS[model]


def attends_grouped(model: torch.nn.Module) -> bool:
    """Whether every attention of `model` is "sdpa", which `grouped_attention` switches to the grouped function (the
    one that takes packed queries)."""
    configs = _configs(model)
    return bool(configs) and all(attention_implementation(config) == "sdpa" for config in configs)


@contextmanager
def grouped_attention(*models: torch.nn.Module) -> Iterator[None]:
    """Within: every config of `models` whose attention is "sdpa" names `GROUPED_SDPA` instead. On exit, also on an
    exception, each one names what it named before. Only this thread's forwards attend through the grouped function:
    another thread's forward of the same model (plain generate beside a DFlash call) runs transformers' sdpa, with
    sdpa's masks (`register_attention`)."""
    switched = [
        config for model in models for config in _configs(model) if attention_implementation(config) == "sdpa"
    ]
    for config in switched:
        set_attention_implementation(config, GROUPED_SDPA)
    _GROUPED_HERE.depth = getattr(_GROUPED_HERE, "depth", 0) + 1
    try:
        yield
    finally:
        _GROUPED_HERE.depth -= 1
        for config in switched:
            set_attention_implementation(config, "sdpa")


__all__ = [
    "ColumnSpan", "FUSED_CHOICES", "GROUPED_SDPA", "PackedQueries", "SPAN_CALL_COST", "attends_grouped", "cuts",
    "dispatcher_takes_grouped_heads", "fused_kernel_takes_grouped_heads", "grouped_attention", "grouped_sdpa_attention",
    "packed_queries",
]
