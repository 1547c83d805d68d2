"""The linear-attention states of hybrid targets (Qwen3-Next, Qwen3.5, Qwen3.6: Gated DeltaNet layers between
full-attention ones) and the one exact rollback of the linear layers after a verify, wherever the target's
keys/values live (the engine's pool, or transformers' cache): no host sync, no data-dependent shape, so the fast path's
whole step stays one CUDA graph.

A Gated DeltaNet layer keeps per sequence a conv state (its last K conv inputs, (conv_dim, K)) and a recurrent state
((value heads, dk, dv), float32). The verify runs the B rows of a block through each such layer as one chunk, as
transformers does for any multi-token forward; the sequence then keeps only its first `taken` rows (anchor and
accepted drafts; 0 for a finished sequence). `LinearStates` leaves the states untouched during the verify and
remembers, per layer, what the layer handed it: the conv window [conv state | block inputs] (b, conv_dim, K + B), and
the arguments of its chunked gated-delta-rule call (queries, keys, values, gates g and beta per block row). After
acceptance, `commit(taken)`:

- conv state = the K columns of the window that end at row `taken - 1`: a gather at taken + 0..K-1.
- recurrent state = the same chunked rule again from the state before the block, with g and beta zeroed on the rows
  past `taken`. A row with g = 0 and beta = 0 leaves the state as it was (decay exp(0) = 1, update scaled by 0), which
  is how the rule's own kernels pad a chunk; so one call gives every sequence its state after exactly its own rows.
  It re-reads no weights (the projections are not run again) and costs one more pass of the recurrence over B rows:
  benchmarks/families.md, "hybrid targets on the fast path", has the measurements and the other ways weighed.

`LinearStates` holds this rule over per-sequence state buffers its owner hands it; the full-attention layers keep
their keys/values beside it: in the engine's page pool (dflash_engine.py's `PagedHybridCache`, over the engine's
per-row state buffers; the fast path and continuous batching), or in transformers' own DynamicCache
(dflash_target_cache.py's `LinearVerifyCache`, over that cache's state tensors, for a verify over it).

The layers talk to their cache through transformers' linear-attention methods, renamed between 5.17, 5.24 and 5.25
(dflash_compat.py's `LinearAttentionCacheMethods` speaks all of them). The chunked rule's arguments are not handed to
the cache, so during the verify each call of the rule by this thread is recorded (dflash_compat.py's
`recording_chunk_rule`: forwards of other threads are not) and runs unchanged (`deferring`). A CUDA graph records the
kernels of that forward, so replays need no Python wrapper.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .dflash_capture import decoder_layers
from .dflash_compat import CHUNK_RULE, LinearAttentionCacheMethods, chunk_rule_reachable, recording_chunk_rule

# Text model types of the hybrid families the fast path serves (a multimodal wrapper's text config has the same).
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def linear_attention_modules(target: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Layer index -> the Gated DeltaNet module (`linear_attn`) of each linear-attention decoder layer."""
    return {i: layer.linear_attn for i, layer in enumerate(decoder_layers(target)) if hasattr(layer, "linear_attn")}


def hybrid_blocker(target: torch.nn.Module) -> str | None:
    """Why the fast path and the engine cannot serve this hybrid target, or None (called only for HYBRID_FAMILIES)."""
    text = target.config.get_text_config()
    modules = linear_attention_modules(target)
    if not modules:
        return f"this {text.model_type} target has no Gated DeltaNet (`linear_attn`) layers where the fast path looks"
    for module in modules.values():
        if not chunk_rule_reachable(module):
            return (
                f"{type(module).__module__} has no {CHUNK_RULE} (this transformers changed how its Gated DeltaNet "
                "layers are called)"
            )
    return None  # MoE experts, as in every family: dflash_fast_path_blockers._experts_blocker


@dataclass
class _Pending:
    """What a verify handed one linear layer's cache: the conv window (n, conv_dim, K + q), the chunked rule's call
    (the function, its arguments) and the state after all q rows (n, value heads, dk, dv)."""

    window: torch.Tensor
    rule: Callable[..., Any] | None = None
    args: tuple = ()
    kwargs: dict | None = None
    final: torch.Tensor | None = None


def linear_state_buffers(
    modules: dict[int, torch.nn.Module], rows: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Zeroed states for `rows` sequences of each Gated DeltaNet layer in `modules` (`linear_attention_modules`):
    conv (rows, conv_dim, K) in `dtype`, recurrent (rows, value heads, dk, dv) in float32, as the rule returns it."""
    conv, recurrent = {}, {}
    for i, module in modules.items():
        conv[i] = torch.zeros(rows, module.conv_dim, module.conv_kernel_size, dtype=dtype, device=device)
        recurrent[i] = torch.zeros(
            rows, module.num_v_heads, module.head_k_dim, module.head_v_dim, dtype=torch.float32, device=device
        )
    return conv, recurrent


class LinearStates(LinearAttentionCacheMethods):
    """The linear-attention layers' states of a target cache, one row per sequence, and the one rollback rule of a
    verify: `prefilling` for a prompt, `deferring` + `commit` for a verify (the module docstring). Mixed into a cache
    that keeps the full-attention layers' keys/values: the engine's paged cache (dflash_engine.py), which serves the
    fast path and continuous batching, and `LinearVerifyCache` over transformers' cache (dflash_target_cache.py), which
    hand it views of tensors they hold (`bind_linear_states`)."""

    def bind_linear_states(
        self,
        conv: dict[int, torch.Tensor],
        recurrent: dict[int, torch.Tensor],
        linear_layers: list[torch.nn.Module],
        num_layers: int,
    ) -> None:
        """Read and write these states (layer index -> (n, ...) tensors: `linear_state_buffers`' shapes) for the
        Gated DeltaNet modules `linear_layers`, in a target of `num_layers` decoder layers."""
        self.conv = conv  # (n, conv_dim, K) the last K conv inputs
        self.recurrent = recurrent  # (n, value heads, dk, dv) float32
        self.linear_layers = linear_layers
        self.layers = self.linear_layer_views(num_layers)  # what 5.17 reads
        self.fresh = False  # True during the prompt's forward: the layers start from empty states, as in generate
        self.pending: dict[int, _Pending] | None = None  # per linear layer, while a verify is deferred
        self.current_layer: int | None = None

    @property
    def kernel_size(self) -> int:
        return next(iter(self.conv.values())).shape[-1]

    # ---- the prompt ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def prefilling(self) -> Iterator[None]:
        """The prompt's forward: states start empty (the layers see no previous state, as on generate's first
        forward) and are written directly."""
        for states in (self.conv, self.recurrent):
            for state in states.values():
                state.zero_()
        self.fresh = True
        try:
            yield
        finally:
            self.fresh = False

    # ---- the verify ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """The verify's forward: the linear layers read the committed states and leave them as they are; what
        `commit` needs is remembered instead, with this thread's calls of the chunked rule. (A one-row verify is
        told the cache records its past, so that its conv, too, hands its window over rather than update the state
        in place.)"""
        self.pending = {}

        def record(rule: Callable[..., Any], args: tuple, kwargs: dict) -> None:
            pending = self.pending[self.current_layer]
            pending.rule, pending.args, pending.kwargs = rule, args, kwargs

        views = [view for view in self.layers if view is not None]
        try:
            for view in views:  # 5.17 reads it there; later versions ask `is_recording_past`
                view.record_past = True
            with recording_chunk_rule(self.linear_layers, record):
                yield
        finally:
            for view in views:
                view.record_past = False

    def commit(self, taken: torch.LongTensor) -> None:
        """Advance each linear layer's states over the first taken[i] rows of the block just verified (n,): 0 keeps a
        sequence's states as they were, all of them takes the whole block."""
        kernel = self.kernel_size
        for i, pending in self.pending.items():
            window = pending.window  # (n, conv_dim, K + q)
            # one row: the layer ran the recurrent rule, not the chunked one, and handed over its state after the row
            one_row = pending.rule is None and pending.final is not None and window.shape[-1] == kernel + 1
            if not one_row and (pending.rule is None or "g" not in pending.kwargs or "beta" not in pending.kwargs):
                raise RuntimeError(
                    f"layer {i}'s verify did not call the chunked gated delta rule with g= and beta= as expected; "
                    "DFlash cannot roll back this transformers version's Gated DeltaNet layers"
                )
            taken = taken.to(window.device)  # a no-op unless the target's layers sit on several devices
            columns = taken[:, None] + torch.arange(kernel, device=taken.device)  # (n, K)
            self.conv[i].copy_(window.gather(2, columns[:, None, :].expand(-1, window.shape[1], -1)))
            if one_row:  # taken is 0 or 1
                self.recurrent[i].copy_(torch.where(taken[:, None, None, None] > 0, pending.final, self.recurrent[i]))
                continue
            g, beta = pending.kwargs["g"], pending.kwargs["beta"]  # (n, q, value heads) each
            keep = torch.arange(g.shape[1], device=taken.device) < taken[:, None]  # (n, q)
            kwargs = dict(pending.kwargs, initial_state=self.recurrent[i], output_final_state=True)
            kwargs["g"], kwargs["beta"] = g * keep[..., None], beta * keep[..., None]
            _, final = pending.rule(*pending.args, **kwargs)
            self.recurrent[i].copy_(final)
        self.pending = None

    # ---- what transformers' linear-attention cache methods do here (`LinearAttentionCacheMethods`) ---------------

    def conv_window(self, inputs: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Return [conv state | inputs] (n, conv_dim, K + q) for the layer's causal conv; keep the last K columns now
        (the prompt) or at `commit` (a verify). Before the prompt the state is zeros: the conv's own left padding."""
        window = torch.cat([self.conv[layer_idx], inputs.to(self.conv[layer_idx].dtype)], dim=-1)
        if self.pending is None:
            self.conv[layer_idx].copy_(window[..., -self.kernel_size :])
        else:
            self.pending[layer_idx] = _Pending(window)
            self.current_layer = layer_idx  # the chunked rule this layer calls next is recorded under it
        return window

    def keep_recurrent_state(self, state: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """The state after every row of the forward: kept for the prompt; during a verify `commit` decides."""
        if self.pending is None:
            self.recurrent[layer_idx].copy_(state)
        else:
            self.pending[layer_idx].final = state
        return self.recurrent[layer_idx]

    def is_recording_past(self, layer_idx: int) -> bool:
        """True during a verify: a one-row forward's conv then hands its window to `conv_window` (5.24 on)."""
        return self.pending is not None


__all__ = [
    "CHUNK_RULE", "HYBRID_FAMILIES", "LinearStates", "hybrid_blocker", "linear_attention_modules",
    "linear_state_buffers",
]
