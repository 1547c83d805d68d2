"""Capture of the target's hidden states at the drafter's `target_layer_ids`, through forward hooks.

Only the chosen decoder layers are hooked (no `output_hidden_states` over all layers). Each hook copies its layer's
output rows into a slice of a caller-provided scratch buffer (b, t, k * H_target): layer j of the list fills
columns [j * H, (j + 1) * H). Used as a context manager, the hooks exist only inside the `with` block, so the target
is left exactly as it was found, also when generation raises.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


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
    """Forward hooks on the target's captured layers, writing into `self.destination` while it is set."""

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
        self._handles: list[Any] = []

    def _hook(self, column: int):
        start, end = column * self.hidden_size, (column + 1) * self.hidden_size

        def copy_rows(module: nn.Module, args: Any, output: Any) -> None:
            if self.destination is None:
                return
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            rows = self.destination.shape[1]
            self.destination[:, :, start:end].copy_(hidden[:, -rows:])

        return copy_rows

    def __enter__(self) -> "TargetHiddenCapture":
        self._handles = [layer.register_forward_hook(self._hook(j)) for j, layer in enumerate(self.layers)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.destination = None


__all__ = ["TargetHiddenCapture", "decoder_layers"]
