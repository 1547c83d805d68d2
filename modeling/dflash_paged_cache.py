"""The drafter's memory: per-sequence `DflashProposerState` and the paged key/value cache it points into.

A slot is one position of one sequence. Slot i of a sequence holds the keys/values of its absolute position i
(context slots first, then the block rows of the latest propose), so a slot's index is also its RoPE position and
its sliding-window distance. Slots live in pages of `PAGE_SIZE`; every drafter layer has its own page pool, and one
block table per sequence maps its logical pages to physical ones in all layers at once (the layers' attention
shapes are identical).

Rollback is a length decrement: slots past a sequence's `ctx_count_drafter` are stale and get overwritten by the
next write.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .dflash_masks import FULL, SLIDING, in_window

PAGE_SIZE = 16


@dataclass
class DflashProposerState:
    """What the drafter keeps for one sequence between verify steps."""

    ctx_hidden_acc: torch.Tensor
    """[max_pending_rows, k * H_target] captured target hidden states of the slots [ctx_committed, ctx_len), row 0
    being slot ctx_committed: the rows a verify appended (the anchor's among them), waiting for the next propose to
    turn them into keys/values. Slot i sits at absolute position i. Exceeding it is an error, never a wrap-around."""
    block_table: list[int] = field(default_factory=list)
    """Physical page ids of this sequence, shared by every drafter layer's pool."""
    block_table_dev: torch.Tensor | None = None
    """The block table on the drafter's device (int64), refreshed whenever a page is added or dropped."""
    ctx_len: int = 0
    """Context slots: every committed position before the anchor, so the anchor sits at position ctx_len and the
    sequence holds ctx_len + 1 tokens (prompt and generated)."""
    ctx_committed: int = 0
    """Watermark: slots [0, ctx_committed) already have their keys/values in the pages. Each propose computes only
    [ctx_committed, ctx_len), from the accumulator."""
    ctx_count_drafter: int = 0
    """Page slots holding valid keys/values: ctx_committed, plus the block rows while a propose is pending. A propose
    reserves pages for this many slots and its block rows read exactly these."""
    context_ready: bool = False
    """The row-order rule: a verify (or the prefill) appends the rows it captured, anchor included, itself, so the
    next propose appends nothing and only consumes this flag. A propose that finds it unset would draft from a
    context that lacks the last verify's rows, and refuses to run."""

    @property
    def max_pending_rows(self) -> int:
        """Accumulator capacity: the most context rows that may wait for the next propose."""
        return self.ctx_hidden_acc.shape[0]

    def append_context(self, rows: torch.Tensor) -> None:
        """Append `rows` (n, k*H_target) as the slots ctx_len .. ctx_len + n - 1."""
        n, pending = rows.shape[0], self.ctx_len - self.ctx_committed
        if pending + n > self.max_pending_rows:
            raise ValueError(
                f"the drafter's accumulator holds {self.max_pending_rows} rows between two proposes and this "
                f"sequence needs {pending + n}; this is a bug: please report it"
            )
        self.ctx_hidden_acc[pending : pending + n].copy_(rows)
        self.ctx_len += n
        self.context_ready = True


class PagedDrafterCache:
    """Page pools of drafter keys/values (one per layer) and the free list that hands pages to sequences. The
    continuous-batching engine keeps its target's keys/values in one too, with no pool for `keyless_layers` (a hybrid
    target's linear-attention layers, which attend to no keys)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        num_key_value_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        keyless_layers: frozenset[int] = frozenset(),
    ):
        shape = (num_pages * PAGE_SIZE, num_key_value_heads, head_dim)  # flat slots: page * PAGE_SIZE + offset
        shapes = [(0, num_key_value_heads, head_dim) if i in keyless_layers else shape for i in range(num_layers)]
        self.key_pools = [torch.zeros(size, dtype=dtype, device=device) for size in shapes]
        self.value_pools = [torch.zeros(size, dtype=dtype, device=device) for size in shapes]
        self.num_pages = num_pages
        self.device = torch.device(device)
        # Stack of free page ids; popping from the end hands out low ids first.
        self.free_pages = list(range(num_pages - 1, -1, -1))

    def reserve(self, state: DflashProposerState, num_slots: int) -> None:
        """Give `state` enough pages to address slots [0, num_slots)."""
        needed = -(-num_slots // PAGE_SIZE) - len(state.block_table)
        if needed <= 0:
            return
        state.block_table.extend(self.take(needed))
        state.block_table_dev = torch.tensor(state.block_table, dtype=torch.long, device=self.device)

    def take(self, count: int) -> list[int]:
        """`count` free pages, now the caller's (low ids first)."""
        if count > len(self.free_pages):
            raise RuntimeError(
                f"the page pool is exhausted ({self.num_pages} pages of {PAGE_SIZE}, {len(self.free_pages)} free, "
                f"{count} asked for); its callers size it or check room first, so this is a bug: please report it"
            )
        return [self.free_pages.pop() for _ in range(count)]

    def give_back(self, pages: list[int]) -> None:
        """Return pages `take` handed out."""
        self.free_pages.extend(reversed(pages))

    def release(self, state: DflashProposerState) -> None:
        """Return every page of a finished sequence to the pool."""
        self.give_back(state.block_table)
        state.block_table = []
        state.block_table_dev = None
        state.ctx_count_drafter = state.ctx_committed = 0

    def slot_mapping(self, state: DflashProposerState, start: int, end: int) -> torch.Tensor:
        """Flat pool indices of this sequence's slots [start, end)."""
        slots = torch.arange(start, end, device=self.device)
        return state.block_table_dev[slots // PAGE_SIZE] * PAGE_SIZE + slots % PAGE_SIZE

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store key/value rows (n, g, d) at flat `slots` (n,)."""
        self.key_pools[layer].index_copy_(0, slots, key.to(self.key_pools[layer].dtype))
        self.value_pools[layer].index_copy_(0, slots, value.to(self.value_pools[layer].dtype))

    def write_rows(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store attention-layout keys/values (b, g, n, d) at `slots` (b, n), row by row."""
        b, g, n, d = key.shape
        self.write(
            layer, slots.reshape(b * n), key.transpose(1, 2).reshape(b * n, g, d), value.transpose(1, 2).reshape(b * n, g, d)
        )

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values at flat `slots` (b, n) -> two (b, g, n, d) tensors."""
        return self.key_pools[layer][slots].transpose(1, 2), self.value_pools[layer][slots].transpose(1, 2)

    def read_pages(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of whole `pages` (b, P) -> two (b, g, P * PAGE_SIZE, d) tensors: `read` of every slot of those
        pages, gathered a page at a time (PAGE_SIZE times fewer, longer copies than slot by slot)."""
        b, num_pages = pages.shape
        flat = pages.reshape(-1)

        def gather(pool: torch.Tensor) -> torch.Tensor:
            by_page = pool.view(-1, PAGE_SIZE, *pool.shape[1:])  # (pages, PAGE_SIZE, g, d)
            return by_page.index_select(0, flat).view(b, num_pages * PAGE_SIZE, *pool.shape[1:]).transpose(1, 2)

        return gather(self.key_pools[layer]), gather(self.value_pools[layer])

    def take_pages(self, pages: list[int]) -> list[int]:
        """These free pages, now the caller's (a row that owns a fixed stretch of the pool takes its own)."""
        taken = set(pages)
        if not taken <= set(self.free_pages):
            raise RuntimeError("a page asked for by id is not free; this is a bug: please report it")
        self.free_pages = [page for page in self.free_pages if page not in taken]
        return list(pages)

    def read_stretch(
        self, layer: int, first_slot: int, rows: int, slots_per_row: int, span: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of `rows` rows that each own one stretch of `slots_per_row` slots, row r's starting at
        `first_slot + r * slots_per_row`: the first `span` slots of each, as two (rows, g, span, d) views, with no
        copy (where `read_pages` gathers)."""

        def view(pool: torch.Tensor) -> torch.Tensor:
            stretch = pool[first_slot : first_slot + rows * slots_per_row]
            return stretch.view(rows, slots_per_row, *pool.shape[1:])[:, :span].transpose(1, 2)

        return view(self.key_pools[layer]), view(self.value_pools[layer])


def page_slots(block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Flat pool slots of `positions` (b, n) for sequences with page tables `block_tables` (b, pages), computed on the
    device (a step recorded as a CUDA graph writes context and block rows at slots it computes)."""
    return block_tables.gather(1, positions // PAGE_SIZE) * PAGE_SIZE + positions % PAGE_SIZE


class PagedView:
    """The paged cache seen by one drafter forward through the Cache API's `update`: the block rows' keys/values
    (b, g, q, d) go to `block_slots` (b * q or (b, q)), and every layer reads back the slots `read_slots` (b, kv) as
    (b, g, kv, d). Which of those a block row may see is the attention mask's business."""

    def __init__(self, cache: PagedDrafterCache, block_slots: torch.Tensor, read_slots: torch.Tensor):
        self.cache = cache
        self.block_slots = block_slots
        self.read_slots = read_slots

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.write_rows(layer_idx, self.block_slots, key, value)
        return self.cache.read(layer_idx, self.read_slots)


class StretchView(PagedView):
    """`PagedView` for rows that each own one stretch of the pool (`PagedDrafterCache.read_stretch`'s arguments in
    `stretch`): every layer reads each row's first slots as a view."""

    def __init__(self, cache: PagedDrafterCache, block_slots: torch.Tensor, stretch: tuple[int, int, int, int]):
        super().__init__(cache, block_slots, read_slots=None)
        self.stretch = stretch

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.write_rows(layer_idx, self.block_slots, key, value)
        return self.cache.read_stretch(layer_idx, *self.stretch)


class PagedCacheView(PagedView):
    """The eager loop's view for one propose over a batch of states: the block rows go to slots
    [ctx_committed, ctx_committed + q) of each sequence, and each reads its valid slots, padded to the longest
    sequence. `attention_masks` says which padded slots each block row may see (`causal_window`: how a sliding
    layer's block rows see each other, `DFlashDraftModel.causal_sliding_window`).
    """

    def __init__(
        self, cache: PagedDrafterCache, states: list[DflashProposerState], block_size: int, window: int | None,
        causal_window: bool = True,
    ):
        for state in states:  # the block rows follow the committed context
            state.ctx_count_drafter = state.ctx_committed + block_size
            cache.reserve(state, state.ctx_count_drafter)
        lengths = [s.ctx_count_drafter for s in states]
        kv_len = max(lengths)
        device = cache.device
        # Block rows' slots (b*q,) and every row's readable slots (b, kv_len); short rows repeat their own slot 0
        # (the first slot of their first page), which the mask hides.
        block_slots = torch.cat([cache.slot_mapping(s, s.ctx_committed, s.ctx_committed + block_size) for s in states])
        read_slots = torch.stack(
            [
                torch.nn.functional.pad(
                    cache.slot_mapping(s, 0, n), (0, kv_len - n), value=s.block_table[0] * PAGE_SIZE
                )
                for s, n in zip(states, lengths)
            ]
        )
        super().__init__(cache, block_slots, read_slots)
        key_pos = torch.arange(kv_len, device=device)
        query_pos = torch.tensor([s.ctx_committed for s in states], device=device)[:, None] + torch.arange(
            block_size, device=device
        )  # (b, q) absolute positions of the block rows
        valid = key_pos[None, :] < torch.tensor(lengths, device=device)[:, None]  # (b, kv)
        self.full_mask = None if all(n == kv_len for n in lengths) else valid[:, None, None, :]
        self.window_mask = None
        if window is not None:
            self.window_mask = (in_window(query_pos, key_pos, window, causal_window) & valid[:, None, :])[:, None]

    @property
    def attention_masks(self) -> dict[str, torch.Tensor | None]:
        """Per layer type, the boolean mask (b, 1, q, kv) of slots each block row may see (None: all)."""
        return {FULL: self.full_mask, SLIDING: self.window_mask}


__all__ = [
    "DflashProposerState", "PagedDrafterCache", "PagedCacheView", "PagedView", "PAGE_SIZE", "StretchView", "page_slots",
]
