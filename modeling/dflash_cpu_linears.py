"""oneDNN matrix products with prepacked weights, for a CPU forward of a few rows (a verify of drafts, a drafter pass).

On a CPU, a float32 `nn.Linear` runs MKL's sgemm, which is fast for many rows but slow from 2 to about 64, the rows
of a verify of drafts, of a drafter's pass and of a batch's plain step; oneDNN's product over a weight reordered once
into its own blocked layout costs far less there, and no more for one row (benchmarks/step-cost.md has the figures).
`OneDNNLinears` keeps that layout for every plain float32 `nn.Linear` of a model and, inside `active()`, routes their
forwards through it.

What it changes and what not:
- Only forwards inside `active()`, and only on the thread that entered it: the engine enters it for every verify (a
  drafted step's, or a plain step's of one row per sequence) and for the drafter's pass. A prefill (a prompt's many
  rows, where MKL is as fast or faster) and every forward outside the engine run the model's own `nn.Linear`.
- The packed copy is a second copy of the weights (`nbytes`). The engine builds one only where it pays and fits (a
  CPU, float32, oneDNN present, at most a quarter of the machine's memory: `onednn_linears_blocker`) and otherwise
  says why not.
- A weight replaced or changed in place after packing (an optimizer step between calls, `load_state_dict`) is packed
  again at the next `active()`: each one's identity and version counter are checked on entry. A change made through
  `weight.data` bumps no counter and is not seen: make a new engine (or `release_fast_path`) after one.
- The products round differently from MKL's, as a 16-row product already rounds differently from a 1-row one: in
  float32 the verified argmax is that of the target's own logits up to such rounding, which is what lossless greedy
  decoding compares (the test suite checks DFlash against plain greedy with these products on).

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import copy
import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .dflash_compat import onednn_linear, onednn_pack_linear_weight, tensor_version

# The row count the weights are packed for: a drafter block. oneDNN serves other row counts from the same layout.
PACK_ROWS = 16
# The packed copies of a model may take at most this share of the machine's memory.
MEMORY_SHARE = 0.25
# Per thread: how many `active()` blocks it is inside.
_ACTIVE_HERE = threading.local()


def _inside() -> bool:
    return getattr(_ACTIVE_HERE, "depth", 0) > 0


@functools.cache
def _onednn_ops_present() -> bool:
    """Whether this torch build has oneDNN's packed linear (a tiny product is tried: some builds list the op and
    refuse it on this CPU)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = onednn_pack_linear_weight(torch.ones(8, 8), PACK_ROWS)
        out = onednn_linear(torch.ones(2, 8), weight, None)
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.equal(out, torch.full((2, 8), 8.0)))


def _packable(module: nn.Module) -> bool:
    """A plain float32 `nn.Linear` on the CPU whose forward nobody replaced (accelerate's offload hooks do)."""
    weight = getattr(module, "weight", None)
    return (
        type(module) is nn.Linear
        and "forward" not in module.__dict__
        and weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32
    )


def _machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


class OneDNNLinears:
    """The packed weights of some models' plain float32 linear layers, and the switch that routes their forwards there.

    Args:
        models: the modules whose `nn.Linear` layers are packed (other layers, and subclasses such as quantized
            layers, keep their own forward).
    """

    def __init__(self, *models: nn.Module):
        linears = (module for model in models for module in model.modules() if _packable(module))
        self.modules = list(dict.fromkeys(linears))  # a layer two models share, once
        # per module: (the weight packed, its version counter then, the packed copy)
        self.packed: dict[nn.Module, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.forwards = {}  # per module: the forward `active()` puts in place of its own
        for module in self.modules:
            self._pack(module)
            self.forwards[module] = self._forward(module)
        # how deep this thread is in this object's `active()` (the engine's call lock keeps other threads out)
        self.entered = 0

    def __deepcopy__(self, memo: dict) -> "OneDNNLinears":
        # oneDNN's packed tensors have no storage to copy (a deep copy of a drafter copies the engine it holds): the
        # copy packs its own copies of the layers
        return OneDNNLinears(*copy.deepcopy(self.modules, memo))

    @property
    def nbytes(self) -> int:
        return sum(packed.numel() * packed.element_size() for _, _, packed in self.packed.values())

    def _pack(self, module: nn.Module) -> None:
        weight = module.weight
        packed = onednn_pack_linear_weight(weight.detach(), PACK_ROWS)
        self.packed[module] = (weight, tensor_version(weight), packed)

    def _forward(self, module: nn.Module):
        own = module.forward  # the class's forward, bound: other threads' forwards take it

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not _inside():
                return own(x)
            return onednn_linear(x, self.packed[module][2], module.bias)

        return forward

    @contextmanager
    def active(self) -> Iterator[None]:
        """Forwards of this thread inside the block use the packed weights (re-packed first where a weight changed);
        every module's own forward is back on exit, also on an exception."""
        for module in self.modules:
            weight, version, _ = self.packed[module]
            if module.weight is not weight or tensor_version(module.weight) != version:
                self._pack(module)
        if self.entered == 0:
            for module, forward in self.forwards.items():
                module.forward = forward
        self.entered += 1
        _ACTIVE_HERE.depth = getattr(_ACTIVE_HERE, "depth", 0) + 1
        try:
            yield
        finally:
            _ACTIVE_HERE.depth -= 1
            self.entered -= 1
            if self.entered == 0:
                for module in self.modules:
                    del module.forward


def onednn_linears_blocker(model: nn.Module) -> str | None:
    """Why `model`'s linear layers are not packed here, or None when they are worth packing."""
    packable = [module for module in model.modules() if _packable(module)]
    if not packable:
        return "no float32 nn.Linear layer computes on the CPU"
    if not _onednn_ops_present():
        return "this torch build has no oneDNN packed linear on this CPU"
    size = sum(module.weight.numel() * module.weight.element_size() for module in packable)
    memory = _machine_memory()
    if memory is not None and size > MEMORY_SHARE * memory:
        return (f"a packed copy of its linear weights ({size / 2**30:.1f} GiB) would take more than "
                f"{MEMORY_SHARE:.0%} of this machine's {memory / 2**30:.1f} GiB")
    return None


__all__ = ["MEMORY_SHARE", "PACK_ROWS", "OneDNNLinears", "onednn_linears_blocker"]
