"""The target's cache through a DFlash generation: prepared before the prompt, rolled back exactly after each verify.

A verify forward appends B rows per sequence to every layer of the target; the sequence then keeps only the rows it
accepted. Plain decoding never writes a row it does not keep, so what "keep" means depends on the layer kind:

- full attention (`DynamicLayer`): crop to the longest acceptance of the batch; a sequence that accepted fewer keeps
  the rows it rejected as holes, masked out of the 2D attention mask for good (positions come from each sequence's
  own length, so a hole is never seen again).
- sliding-window attention (gpt-oss's `sliding_attention` layers, and every layer of a Mistral-style config that
  sets `sliding_window` without `layer_types`): transformers' `DynamicSlidingWindowLayer` keeps only the last W - 1
  slots and cannot crop past them. Here such a layer keeps full history instead (a plain `DynamicLayer`), and the
  window is applied by the mask, on positions rather than slots: with holes, the last W slots of a sequence are not
  its last W tokens. Slots that no sequence can see again (older than every sequence's window) are dropped from the
  front after each step, so a sliding layer holds about W + B slots, as in plain decoding. gpt-oss's attention sinks
  are learned per-head logits, not cached rows, so no row is kept for them.
- linear attention (Gated DeltaNet in Qwen3-Next / Qwen3.5: a conv state and a recurrent state per sequence, no rows
  to crop): rolled back by the one rule of the fast path and the continuous-batching engine (dflash_linear_state.py's
  `LinearStates`). The verify forward takes a `LinearVerifyCache`: the DynamicCache itself for every call but the
  Gated DeltaNet layers', which go to a `LinearStates` over the DynamicCache's own state tensors. It leaves the states
  as they were and records each layer's conv window and chunked-rule call; after acceptance `commit` gathers each
  sequence's conv state at its kept rows and re-runs only the rule, once for the batch, with its gates zeroed past
  each sequence's kept rows: the layers' projections do not run again (benchmarks/families.md weighs the ways).

`TransformersTargetCache` prepares the cache, runs the target's forwards over it and rolls it back; the engine's step
(dflash_engine.py) talks to it when a generate call's target keeps its keys/values in transformers' cache rather than in
the engine's pools (the targets `fast_path_blocker` keeps off them: split over devices, other quantizers, untested
families, other attention, a hybrid's padding between real tokens, or `dflash_fast_path=False`).

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .dflash_capture import decoder_layers
from .dflash_compat import (
    CHUNK_RULE, attention_implementation, chunk_rule_reachable, drop_front_slots, full_history_layer, is_dynamic_layer,
    is_linear_cache_layer, linear_states, linear_token_count, set_linear_states, set_linear_token_count,
)
from .dflash_linear_state import LinearStates
from .dflash_masks import FULL, LINEAR, SLIDING, in_window, target_attention_mask


def layer_kinds(cache: Any) -> list[str]:
    """FULL, SLIDING or LINEAR for every layer of a transformers cache, from the layer objects generate built; the
    class name of a layer that is none of them (a static sliding layer, or a layer that cannot crop)."""
    kinds = []
    for layer in cache.layers:
        if is_linear_cache_layer(layer):
            kinds.append(LINEAR)
        elif getattr(layer, "is_sliding", False):
            kinds.append(SLIDING if is_dynamic_layer(layer) else type(layer).__name__)
        elif hasattr(layer, "crop"):  # DynamicLayer; StaticLayer from transformers 5.24
            kinds.append(FULL)
        else:
            kinds.append(type(layer).__name__)
    return kinds


def sliding_windows(cache: Any) -> set[int]:
    """The windows of the cache's sliding layers (empty without them)."""
    return {layer.sliding_window for layer, kind in zip(cache.layers, layer_kinds(cache)) if kind == SLIDING}


def rollback_problem(target: torch.nn.Module, cache: Any) -> str | None:
    """Why DFlash cannot roll this target's `cache` back after a verify, or None when it can; from the target and
    the cache generate built, before any forward."""
    text = target.config.get_text_config()
    family = text.model_type
    if cache is None or not hasattr(cache, "layers") or not hasattr(cache, "crop"):
        return (
            "the DFlash path needs a cache whose layers can be cropped after each verify (DynamicCache, the default); "
            f"got {type(cache).__name__}. Drop cache_implementation / the cache argument"
        )
    kinds = layer_kinds(cache)
    unknown = sorted({kind for kind in kinds if kind not in (FULL, SLIDING, LINEAR)})
    if unknown:
        return (
            f"the DFlash path needs a cache whose layers can be cropped after each verify (DynamicCache, the "
            f"default); got {type(cache).__name__} with {', '.join(unknown)} layers for this {family} target. Drop "
            "cache_implementation / the cache argument"
        )
    layers = decoder_layers(target)
    recurrent = [i for i, kind in enumerate(kinds) if kind == LINEAR and not hasattr(layers[i], "linear_attn")]
    if recurrent:  # we roll back Gated DeltaNet layers (`linear_attn`), not other recurrences
        return (
            f"DFlash cannot decode {family} targets: layers {recurrent} keep recurrent or convolution states that "
            "it cannot roll back (it rolls back Gated DeltaNet layers, as in Qwen3-Next and Qwen3.5)"
        )
    # the rollback re-runs the chunked rule the layers called (dflash_linear_state.py)
    linear = [i for i, kind in enumerate(kinds) if kind == LINEAR]
    unreachable = [i for i in linear if not chunk_rule_reachable(layers[i].linear_attn)]
    if unreachable:
        return (
            f"DFlash cannot roll back the Gated DeltaNet layers {unreachable} of this {family} target: their modeling "
            f"file has no {CHUNK_RULE} (this transformers changed how they are called)"
        )
    windows = sliding_windows(cache)
    if len(windows) > 1:
        return f"DFlash needs one sliding window per target; this {family} target's layers use {sorted(windows)}"
    implementation = attention_implementation(text)
    if windows and implementation not in ("eager", "sdpa"):
        return (
            f"on sliding-window targets ({family}) DFlash applies the window through its own masks, which "
            f"{implementation!r} attention does not read; load the target with attn_implementation='eager' "
            "or 'sdpa'"
        )
    return None


class LinearVerifyCache(LinearStates):
    """transformers' `cache` (a DynamicCache) as a verify forward over it sees it: the Gated DeltaNet layers'
    calls go to `LinearStates` over the cache's own conv and recurrent tensors of `linear_modules` (layer index ->
    module), so `deferring` + `commit` roll them back as in the fast path; every other call and attribute (the
    attention layers' `update`, what the model's mask builders read) is the cache's own. One per verify (between
    verifies `keep` replaces the cache's tensors)."""

    def __init__(self, cache: Any, linear_modules: dict[int, torch.nn.Module]):
        self.cache = cache
        states = {i: linear_states(cache.layers[i]) for i in linear_modules}
        self.bind_linear_states(
            {i: conv for i, (conv, _) in states.items()},  # (b, conv_dim, K)
            {i: recurrent for i, (_, recurrent) in states.items()},  # (b, value heads, dk, dv)
            list(linear_modules.values()),
            len(cache.layers),
        )

    def __getattr__(self, name: str) -> Any:
        """What this object does not define is the DynamicCache's (called only for names not found here)."""
        if name == "cache":  # not set yet (a copy being built): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.cache, name)


class TransformersTargetCache:
    """A generate call's target keys/values in transformers' own `cache` (generate's, still empty), for the engine's
    step, prepared for DFlash and rolled back after every verify (see the module docstring).

    The engine's row i is the cache's batch row `rows[i]`. The target reads the prompt (b, P) as plain generate does,
    padding and all, and each verify appends its rows; `attention_mask` (b, L) hides the padding and the rows a
    sequence rejected. When the engine's rows move (a finished sequence's row goes, the last row takes its place) the
    cache's rows follow lazily, before the next forward: a call's last rows never leave the cache it hands back.

    Args:
        target: the model being decoded.
        cache: the cache generate built for the call (a `DynamicCache`), before the prompt's forward.
        attention_mask: the call's mask (b, P), 1 for real tokens.
        cache_argument: the target forward's name for its cache.
    """

    def __init__(self, target: torch.nn.Module, cache: Any, attention_mask: torch.Tensor, cache_argument: str):
        problem = rollback_problem(target, cache)
        if problem is not None:
            raise ValueError(problem)
        text = target.config.get_text_config()
        self.target, self.cache, self.cache_argument = target, cache, cache_argument
        self.attention_mask = attention_mask.long()
        self.rows = list(range(attention_mask.shape[0]))
        self.kinds = layer_kinds(cache)
        self.dtype = target.get_input_embeddings().weight.dtype
        windows = sliding_windows(cache)
        self.window: int | None = windows.pop() if windows else None
        # The model wants one mask per layer type when its config lists them, else one mask for every layer; the
        # linear-attention layers take the 2D mask as it is (a window is never set on a hybrid target).
        self.mask_types = sorted(set(self.kinds) - {LINEAR}) if getattr(text, "layer_types", None) is not None else None
        for i, kind in enumerate(self.kinds):
            if kind == SLIDING:
                cache.layers[i] = full_history_layer()  # the window is applied by the mask
        self.sliding_start = 0  # slots of the full layout that the sliding layers have dropped from their front
        layers = decoder_layers(target)
        self.linear_modules = {i: layers[i].linear_attn for i, kind in enumerate(self.kinds) if kind == LINEAR}
        self.linear: LinearVerifyCache | None = None  # the linear layers' view of the verify in flight

    # ---- the forwards ------------------------------------------------------------------------------------------

    def prefill(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """The prompt forward of every row (b, P), as plain generate runs it: real tokens at positions 0..n-1 of their
        row, padding hidden. Returns the last column's logits (b, 1, V)."""
        mask = self.attention_mask
        logits = self.target(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0),  # padding at position 0, as generate numbers it
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_argument: self.cache},
        ).logits
        self._drop_unseen_sliding_slots()
        return logits

    def verify(self, input_ids: torch.LongTensor, positions: torch.LongTensor) -> torch.Tensor:
        """The verify forward of the engine's rows: input_ids (n, w) at positions (n, w). Returns the logits (n, w, V);
        `commit` then keeps each row's accepted ones."""
        self._move_rows()
        device, width = self.attention_mask.device, input_ids.shape[1]
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(len(self.rows), width)], 1)
        with self._verifying() as cache:
            return self.target(
                input_ids=input_ids.to(device),
                attention_mask=self._verify_mask(width),
                position_ids=positions.to(device),
                use_cache=True,
                logits_to_keep=width,
                **{self.cache_argument: cache},
            ).logits

    def _verify_mask(self, num_rows: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """What the verify forward takes as `attention_mask`, the mask (b, L) holding the block's `num_rows` new
        columns. Without sliding layers, the 2D mask itself (the model builds a causal mask, holes included); with
        them, 4D masks that apply the window on each sequence's own positions."""
        if self.window is None:
            return self.attention_mask
        real = self.attention_mask.bool()
        positions = self.attention_mask.cumsum(dim=1) - 1  # (b, L): a slot's position in its own sequence
        queries = positions[:, -num_rows:]  # (b, q)
        visible = real[:, None, :] & (positions[:, None, :] <= queries[:, :, None])  # (b, q, L)
        windowed = real[:, None, :] & in_window(queries, positions, self.window)
        # the full layers hold every slot; the sliding layers have dropped their first `sliding_start`
        return target_attention_mask(visible, windowed[..., self.sliding_start :], self.mask_types, self.dtype)

    @contextlib.contextmanager
    def _verifying(self) -> Iterator[Any]:
        """Yields the cache the verify forward takes: without Gated DeltaNet layers transformers' cache itself, with
        them a `LinearVerifyCache` over it whose linear layers wait for `commit` to advance their states."""
        if not self.linear_modules:
            yield self.cache
            return
        self.linear = LinearVerifyCache(self.cache, self.linear_modules)
        with self.linear.deferring():
            yield self.linear

    # ---- after acceptance ------------------------------------------------------------------------------------

    def commit(self, num_rows: int, accepted: list[int]) -> None:
        """After the verify of `num_rows` rows: row i keeps the rows of its anchor and accepted[i] drafts."""
        most = max(accepted)
        surplus = num_rows - 1 - most
        if surplus:  # keep rows 0..most of every sequence; a negative crop drops the rest
            for layer, kind in zip(self.cache.layers, self.kinds):
                if kind != LINEAR:
                    layer.crop(-surplus)
            self.attention_mask = self.attention_mask[:, : self.attention_mask.shape[1] - surplus]
        for row, taken in enumerate(accepted):  # rows a sequence rejected are masked out for good
            if taken < most:
                self.attention_mask[row, taken - most :] = 0
        if self.linear is not None:
            self._commit_linear(most, accepted)
        self._drop_unseen_sliding_slots()

    def _commit_linear(self, most: int, accepted: list[int]) -> None:
        """Advance the Gated DeltaNet layers' states over each sequence's anchor and accepted drafts
        (`LinearStates.commit`)."""
        device = next(iter(self.linear.conv.values())).device
        self.linear.commit(torch.tensor(accepted, device=device) + 1)
        self.linear = None
        # From transformers 5.25 a linear layer counts the tokens it has read, and that count is what
        # `cache.get_seq_length()` reports when layer 0 is linear (Qwen3.5, Qwen3-Next). The verify's calls did not
        # reach the cache's layers: count the rows the attention layers kept, anchor and `most` drafts.
        for i in self.linear_modules:
            counted = linear_token_count(self.cache.layers[i])
            if counted is not None:
                set_linear_token_count(self.cache.layers[i], counted + most + 1)

    def _drop_unseen_sliding_slots(self) -> None:
        """Drop the front slots of the sliding layers that no sequence's next query can see: the next verify's first
        row (the anchor, right after the n cached tokens of its sequence, at position n) sees positions above n - W."""
        if self.window is None:
            return
        real = self.attention_mask.bool()
        positions = self.attention_mask.cumsum(dim=1) - 1  # (b, L)
        lengths = positions[:, -1:] + 1  # (b, 1) tokens per sequence
        seen = real & (positions > lengths - self.window)
        first_seen = int(seen.long().argmax(dim=1).min())  # a row that sees nothing (W = 1) keeps everything
        drop = first_seen - self.sliding_start
        if drop <= 0:
            return
        for layer, kind in zip(self.cache.layers, self.kinds):
            if kind == SLIDING:
                drop_front_slots(layer, drop)
        self.sliding_start = first_seen

    # ---- the engine's rows -----------------------------------------------------------------------------------

    def move(self, row: int, last: int) -> None:
        """The engine's `row` ended and its `last` row takes its place (or `row` was the last)."""
        self.rows[row] = self.rows[last]
        self.rows.pop()

    def _move_rows(self) -> None:
        """Carry on with the cache's batch rows `rows` only, in that order."""
        if self.rows == list(range(self.attention_mask.shape[0])):
            return
        index = torch.tensor(self.rows, device=self.attention_mask.device)
        for layer, kind in zip(self.cache.layers, self.kinds):
            if kind == LINEAR:
                conv, recurrent = linear_states(layer)
                set_linear_states(layer, conv[index.to(conv.device)], recurrent[index.to(recurrent.device)])
            else:
                layer.batch_select_indices(index)
        self.attention_mask = self.attention_mask[index]
        self.rows = list(range(len(self.rows)))


__all__ = [
    "LinearVerifyCache", "TransformersTargetCache", "layer_kinds", "rollback_problem", "sliding_windows",
]
