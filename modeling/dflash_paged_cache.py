"""Paged key/value memory: a page pool per layer, a free list, and the views a forward reads it through.

A slot is one position of one sequence. Slot i of a sequence holds the keys/values of its absolute position i, so a
slot's index is also its RoPE position and its sliding-window distance. Slots live in pages of `PAGE_SIZE`; every
layer has its own page pool, and one block table per sequence (a row of the engine's tables, the pages its
`DflashProposerState` holds) maps its logical pages to physical ones in all layers at once (the layers' attention
shapes are identical). The engine keeps the drafter's context in one pool and the target's keys/values in another.

Rollback is free: slots past a sequence's committed length are stale, hidden by the masks, and overwritten by the
next write.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import torch

PAGE_SIZE = 16


class PagedDrafterCache:
    """Page pools of drafter keys/values (one per layer) and the free list that hands pages to sequences. The
    continuous-batching engine keeps its target's keys/values in one too, with no pool for `keyless_layers` (a hybrid
    target's linear-attention layers, which attend to no keys; every layer where the target's keys/values live in
    transformers' cache, whose pages the engine still counts)."""

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

    @property
    def holds_keys(self) -> bool:
        """Whether any layer keeps keys/values here (an engine over transformers' cache counts its target's pages
        without them)."""
        return any(pool.shape[0] for pool in self.key_pools)

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


__all__ = ["PagedDrafterCache", "PagedView", "PAGE_SIZE", "StretchView", "page_slots"]
