"""Where the target's parts compute, and where the drafter may live beside them.

A target loaded with `device_map` (accelerate) may spread its decoder layers over several devices, or offload some
to CPU or disk: an offloaded module's weights then sit on the meta device, and accelerate's hook brings them to the
module's execution device for each forward. The DFlash runtime touches the target in three places besides its
forward: the input embedding (embeds the block), the captured decoder layers (hooks copy their outputs into the
drafter's buffers) and the lm_head (reads draft logits). So the drafter may sit on any device the target computes
on; by default on the lm_head's, where its output goes.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from .dflash_capture import decoder_layers
from .dflash_compat import accelerate_hook


def execution_device(module: nn.Module) -> torch.device:
    """The device `module` computes on: the one accelerate's hook names (dispatched or offloaded modules, whose
    weights may be on the meta device), else the device of its first parameter or buffer."""
    hook = accelerate_hook(module)
    for candidate in getattr(hook, "hooks", [hook]):  # accelerate's SequentialHook chains several hooks
        device = getattr(candidate, "execution_device", None)
        if device is not None:
            return torch.device(device)
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None)
    if tensor is None:
        raise ValueError(f"{type(module).__name__} holds no tensors and no accelerate hook: cannot tell its device")
    return tensor.device


def target_devices(target: nn.Module) -> list[torch.device]:
    """Every device the parts of the target that the drafter uses compute on (embedding, decoder layers, lm_head)."""
    modules = [target.get_input_embeddings(), *decoder_layers(target), target.get_output_embeddings()]
    return sorted({execution_device(m) for m in modules}, key=str)


def place_drafter(drafter: nn.Module, target: nn.Module, device: str | torch.device | None = None) -> nn.Module:
    """Move the drafter beside the target: to `device` if given, else to where the target's lm_head computes (the
    last device of a split target, which reads every draft). Returns the drafter."""
    return drafter.to(device if device is not None else execution_device(target.get_output_embeddings()))


def check_drafter_device(drafter: nn.Module, target: nn.Module) -> None:
    """Refuse, before any work, a drafter on a device the target does not compute on, naming the fix."""
    drafter_device = next(drafter.parameters()).device
    devices = target_devices(target)
    if drafter_device not in devices:
        head = execution_device(target.get_output_embeddings())
        raise ValueError(
            f"the drafter is on {drafter_device}, but the target computes on {', '.join(map(str, devices))}. Move "
            f"the drafter to one of them: drafter.to('{head}') (the lm_head's device, the default of "
            "hf_dflash.place_drafter(drafter, target))"
        )


__all__ = ["check_drafter_device", "execution_device", "place_drafter", "target_devices"]
