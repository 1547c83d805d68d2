"""Capture of the target's hidden states at the drafter's `target_layer_ids`, through forward hooks, and what keeps
DFlash calls from several threads apart.

Only the chosen decoder layers are hooked (no `output_hidden_states` over all layers). Each hook copies its layer's
output rows into a slice of a caller-provided scratch buffer (b, t, k * H_target): layer j of the list fills
columns [j * H, (j + 1) * H). Used as a context manager, the hooks exist only inside the `with` block, so the target
is left exactly as it was found, also when generation raises.

Threads (`one_call_at_a_time`): a DFlash call holds its target's lock and its drafter's lock from its first check to
its output, so DFlash calls on one target, or with one drafter (whose fast-path step and its buffers are held on the
drafter), take turns, in any thread; calls on different targets with different drafters run at once. The hooks, like
every other change a call makes to the target while it runs (dflash_compat.py), act only in the thread that installed
them: plain generate on the same target in another thread runs beside a DFlash call, unaffected and not waited for.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

# model -> the lock its DFlash calls take turns on; weak, so that a model is not kept alive by having been used.
_CALL_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_CALL_LOCKS_GUARD = threading.Lock()


def _call_lock(model: nn.Module) -> threading.RLock:
    with _CALL_LOCKS_GUARD:
        lock = _CALL_LOCKS.get(model)
        if lock is None:
            lock = _CALL_LOCKS[model] = threading.RLock()
        return lock


@contextmanager
def one_call_at_a_time(target: nn.Module, drafter: nn.Module | None) -> Iterator[None]:
    """Hold `target`'s lock, then `drafter`'s, for a DFlash call (see the module docstring). Always in that order, and
    a drafter is never a target, so two calls cannot each hold what the other waits for. Reentrant: a call made from
    inside another on the same thread (a stopping criterion that generates) does not wait for itself."""
    with ExitStack() as held:
        for model in (target, drafter) if drafter is not None else (target,):
            held.enter_context(_call_lock(model))
        yield


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The target's stack of decoder layers (`model.layers` for Llama/Qwen-style models and their relatives)."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    for candidate in (decoder, getattr(target, "model", None), target):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(
        f"cannot find the decoder layers of {type(target).__name__} (looked for `.layers` on get_decoder(), "
        "`.model` and the model itself); DFlash needs them to capture hidden states"
    )


class TargetHiddenCapture:
    """Forward hooks on the target's captured layers, writing into `self.destination` while it is set, for forwards
    run by the thread that entered the `with` block (another thread's forward of the target passes untouched)."""

    def __init__(self, target: nn.Module, layer_ids: list[int], hidden_size: int):
        layers = decoder_layers(target)
        bad = [i for i in layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(
                f"the drafter captures target layers {bad}, but {type(target).__name__} has {len(layers)} decoder "
                "layers (0-based ids); this drafter was built for another target"
            )
        self.layers = [layers[i] for i in layer_ids]
        self.hidden_size = hidden_size
        self.destination: torch.Tensor | None = None  # (b, t, k * H) rows of the forward in flight
        self.owner: int | None = None  # the thread whose forwards the hooks capture
        self._handles: list[Any] = []

    def _hook(self, column: int):
        start, end = column * self.hidden_size, (column + 1) * self.hidden_size

        def copy_rows(module: nn.Module, args: Any, output: Any) -> None:
            if self.destination is None or threading.get_ident() != self.owner:
                return
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            rows = self.destination.shape[1]
            self.destination[:, :, start:end].copy_(hidden[:, -rows:])

        return copy_rows

    def __enter__(self) -> "TargetHiddenCapture":
        self.owner = threading.get_ident()
        self._handles = [layer.register_forward_hook(self._hook(j)) for j, layer in enumerate(self.layers)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.destination = None
        self.owner = None


__all__ = ["TargetHiddenCapture", "decoder_layers", "one_call_at_a_time"]
