"""Caches with fixed addresses for the fast path (dflash_fast_path.py), where one verify step is a CUDA graph.

A graph replays the kernels it recorded on the buffers it recorded, so nothing here allocates, grows or reads a
length on the host after construction; every index is a device tensor that the step itself updates.

- `StaticTargetCache`: the target's keys/values, one (b, g, L, d) buffer per layer. Slot s of a sequence is column
  s of its left-padded row, so every sequence writes its own block at its own slots. Rejecting drafts needs no crop:
  the sequence's anchor simply stays behind, the rejected slots fall outside its mask and the next block overwrites
  them. The target's attention reads all L slots under a 4D mask that the fast path builds. When sequences finish,
  the fast path reorders the rows (running ones first) and runs on a `head` of them.
- `page_slots`: the drafter's paged cache (dflash_paged_cache.py) addressed from device tensors, so the fast path can
  write context and block rows at slots computed on the device.
- `ContiguousPagedView`: the drafter's reads in the fast path. The step reserves every page of every sequence at once,
  in row order, so row r owns pages [r * P, (r + 1) * P) of each pool: its slots are one stretch of memory and each
  layer reads them as a view, with no gather of the whole context per layer per step.

`StaticTargetCache` and `ContiguousPagedView` speak the one method of transformers' Cache API that attention layers
call: `update`.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import torch

from .dflash_paged_cache import PAGE_SIZE, PagedDrafterCache


class StaticTargetCache:
    """The target's keys/values in preallocated (b, g, L, d) buffers (empty for `keyless_layers`); `write_slots`
    (b, q) says where the rows of the forward in flight go (set it before the forward; the fast path points it at a
    buffer its step refills)."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_key_value_heads: int,
        head_dim: int,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        keyless_layers: frozenset[int] = frozenset(),
    ):
        shape = (batch_size, num_key_value_heads, num_slots, head_dim)
        empty = (batch_size, 0)  # a layer that attends to no keys (a hybrid target's linear layers) holds none
        self.keys = [
            torch.zeros(empty if i in keyless_layers else shape, dtype=dtype, device=device) for i in range(num_layers)
        ]
        self.values = [torch.zeros_like(key) for key in self.keys]
        self.write_slots: torch.Tensor | None = None

    def head(self, rows: int) -> "StaticTargetCache":
        """A cache over the first `rows` sequences only, sharing this one's memory (the fast path's smaller batches)."""
        view = object.__new__(type(self))  # a subclass adds its own buffers' rows (`HybridStaticCache.head`)
        view.keys = [key[:rows] for key in self.keys]
        view.values = [value[:rows] for value in self.values]
        view.write_slots = None
        return view

    def carried_state(self) -> list[torch.Tensor]:
        """Buffers a step advances in place, which a graph recording's warm-up steps must leave as they were. None
        here: a step writes keys/values only at or after each anchor, which the next real step overwrites."""
        return []

    def reorder(self, index: torch.LongTensor) -> None:
        """Row i takes what row index[i] held (index (b,), a permutation of the sequences)."""
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer.copy_(buffer[index])

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store key/value (b, g, q, d) at `write_slots` and return the layer's whole buffers (b, g, L, d)."""
        b, g, q, d = key.shape
        index = self.write_slots[:, None, :, None].expand(b, g, q, d)
        self.keys[layer_idx].scatter_(2, index, key.to(self.keys[layer_idx].dtype))
        self.values[layer_idx].scatter_(2, index, value.to(self.values[layer_idx].dtype))
        return self.keys[layer_idx], self.values[layer_idx]


def page_slots(block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Flat pool slots of `positions` (b, n) for sequences with page tables `block_tables` (b, pages)."""
    return block_tables.gather(1, positions // PAGE_SIZE) * PAGE_SIZE + positions % PAGE_SIZE


class ContiguousPagedView:
    """The drafter's paged cache for the first `num_rows` sequences of a pool laid out row by row: sequence r owns
    pages [r * P, (r + 1) * P) of every layer's pool, P = slots_per_row / PAGE_SIZE. The block rows' keys/values go to
    `block_slots` (b, q) as in a `PagedView`; each layer reads back every slot of its rows as a (b, g, slots_per_row, d)
    view of the pool. Which slots a block row may see is the attention mask's business."""

    def __init__(self, cache: PagedDrafterCache, block_slots: torch.Tensor, num_rows: int, slots_per_row: int):
        self.cache = cache
        self.block_slots = block_slots
        self.num_rows = num_rows
        self.slots_per_row = slots_per_row

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.write_rows(layer_idx, self.block_slots, key, value)
        return tuple(
            pool.view(-1, self.slots_per_row, *pool.shape[1:])[: self.num_rows].transpose(1, 2)
            for pool in (self.cache.key_pools[layer_idx], self.cache.value_pools[layer_idx])
        )


def reorder_contiguous_rows(cache: PagedDrafterCache, index: torch.LongTensor, slots_per_row: int) -> None:
    """In a pool laid out row by row (`ContiguousPagedView`), row i's pages take what row index[i]'s held (index (b,),
    a permutation of the rows): the contents move, the layout stays."""
    for pool in (*cache.key_pools, *cache.value_pools):
        rows = pool.view(-1, slots_per_row, *pool.shape[1:])  # (b, slots_per_row, g, d)
        rows.copy_(rows[index])


def contiguous_block_tables(block_tables: torch.Tensor) -> bool:
    """Whether row r of `block_tables` (b, P) holds exactly pages r * P .. (r + 1) * P - 1, the layout that
    `ContiguousPagedView` reads."""
    b, pages = block_tables.shape
    expected = torch.arange(b * pages, device=block_tables.device).view(b, pages)
    return bool(torch.equal(block_tables, expected))


__all__ = [
    "ContiguousPagedView", "StaticTargetCache", "contiguous_block_tables", "page_slots", "reorder_contiguous_rows",
]
