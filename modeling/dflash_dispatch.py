"""The one change this bundle makes to transformers: `generate(assistant_model=<DFlash drafter>)` runs DFlash.

`GenerationMixin.generate` is wrapped once per process. The wrapper looks at `assistant_model`: if it is a DFlash
drafter, generate runs with our decoding loop as its `custom_generate` (so generate still prepares the config,
logits processors, stopping criteria and cache exactly as usual); anything else, and transformers' own DFlash path
(`speculation_type="dflash"`, kept as the baseline), goes to the original method untouched.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from transformers.generation.utils import GenerationMixin
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.integrations.fsdp import is_fsdp_managed_module

from .dflash_capture import one_call_at_a_time


def is_dflash_drafter(model: Any) -> bool:
    """True for any copy of our drafter class (the installed library's or a remote-code bundle's): its config's class
    is a DFlashConfig of one copy or another, whatever layout the files were written in."""
    return model is not None and getattr(type(getattr(model, "config", None)), "model_type", None) == "dflash"


def _asks_for_native_dflash(arguments: dict[str, Any]) -> bool:
    if arguments.get("speculation_type") == "dflash" or arguments["kwargs"].get("speculation_type") == "dflash":
        return True
    config = arguments.get("generation_config")
    return getattr(config, "speculation_type", None) == "dflash"


def _refuse_what_generate_would_drop(model: Any, arguments: dict[str, Any]) -> None:
    """Options generate handles before the decoding loop in a way that loses the drafter or the option itself."""
    kwargs = arguments["kwargs"]
    synced_gpus = arguments.get("synced_gpus")
    if synced_gpus is None:  # as generate decides it (it does not pass it on to a custom loop)
        several_processes = torch.distributed.is_available() and torch.distributed.is_initialized() and (
            torch.distributed.get_world_size() > 1
        )
        synced_gpus = several_processes and (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model))
    if synced_gpus:
        raise ValueError(
            "synced_gpus (which generate turns on for a model sharded over several processes by DeepSpeed ZeRO-3 or "
            "FSDP) keeps every process stepping until all are done, which the DFlash loops do not do: give each "
            "process a whole target (device_map may split it over that process's GPUs), and pass synced_gpus=False "
            "if generate still asks for it"
        )
    if kwargs.get("cache_implementation") == "paged":
        raise ValueError(
            "cache_implementation='paged' switches generate to continuous batching, which would drop the DFlash "
            "drafter; leave cache_implementation unset (the DFlash path batches left-padded prompts itself)"
        )
    config = arguments.get("generation_config") or model.generation_config
    if kwargs.get("stop_strings") or getattr(config, "stop_strings", None):
        # generate hands the tokenizer only to its own loops, so it would refuse stop strings for want of one
        raise ValueError(
            "stop_strings cannot reach a custom decoding loop such as DFlash's; pass them as a stopping criterion "
            "instead: stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer, stop_strings)])"
        )


def install_generate_dispatch() -> None:
    """Wrap `GenerationMixin.generate` (idempotent: a second bundle copy finds it wrapped and does nothing)."""
    original = GenerationMixin.generate
    if getattr(original, "_dflash_dispatch", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(self, *args, **kwargs)
        arguments = {**bound.arguments, "kwargs": bound.arguments.get("kwargs", {})}
        drafter = arguments.get("assistant_model")
        if not is_dflash_drafter(drafter) or _asks_for_native_dflash(arguments):
            return original(self, *args, **kwargs)
        if arguments.get("custom_generate") is not None:
            raise ValueError("assistant_model=<DFlash drafter> already sets the decoding loop; drop custom_generate")
        _refuse_what_generate_would_drop(self, arguments)
        from .dflash_decoding import dflash_generate

        bound.arguments["assistant_model"] = None
        # generate hands custom loops only the arguments of their own signature: bind the drafter and streamer here.
        bound.arguments["custom_generate"] = functools.partial(
            dflash_generate, drafter=drafter, streamer=arguments.get("streamer")
        )
        with one_call_at_a_time(self, drafter):  # threads: see dflash_capture.py
            return original(*bound.args, **bound.kwargs)

    generate._dflash_dispatch = True
    GenerationMixin.generate = generate


__all__ = ["install_generate_dispatch", "is_dflash_drafter"]
