"""The one change this bundle makes to transformers: an `assistant_model=<DFlash drafter>` argument runs DFlash.

`GenerationMixin.generate` is wrapped once per process. The wrapper looks at `assistant_model`: if it is a DFlash
drafter, generate runs with our decoding loop as its `custom_generate` (so generate still prepares the config,
logits processors, stopping criteria and cache exactly as usual); anything else, and transformers' own DFlash path
(`speculation_type="dflash"`, kept as the baseline), goes to the original method untouched.

Continuous batching's three entry points (`init_continuous_batching`, `continuous_batching_context_manager`,
`generate_batch`, on `ContinuousMixin`) gain an `assistant_model` argument, visible in their signatures: with a DFlash
drafter they run `DFlashContinuousBatchingManager` (dflash_continuous.py), without one transformers' own manager,
untouched. With a drafter they also take `dflash_adaptive` (as generate does): the engine's verify policy, None (the
default) for on where the engine runs on a CPU, True, False or a `VerifyPolicy`.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.generation.continuous_batching import ContinuousMixin
from transformers.generation.utils import GenerationMixin
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.integrations.fsdp import is_fsdp_managed_module
from transformers.utils.logging import tqdm

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


def _check_continuous_drafter(drafter: Any) -> None:
    if not is_dflash_drafter(drafter):
        raise ValueError(
            f"continuous batching takes a DFlash drafter as assistant_model, got {type(drafter).__name__}: "
            "transformers' continuous batching has no other assistant; leave assistant_model unset for it"
        )


def _taking_assistant_model(original: Callable[..., Any], run_with_drafter: Callable[..., Any]) -> Callable[..., Any]:
    """`original` with keyword-only `assistant_model` and `dflash_adaptive` (in its signature too): no drafter calls
    `original` untouched, a DFlash drafter calls `run_with_drafter(self, drafter, **the other arguments by name,
    dflash_adaptive=...)`."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def method(self, *args: Any, assistant_model: Any = None, dflash_adaptive: Any = None, **kwargs: Any) -> Any:
        if assistant_model is None:
            if dflash_adaptive is not None:
                raise ValueError("dflash_adaptive sets the DFlash engine's verify policy; pass it with "
                                 "assistant_model=<DFlash drafter>, or leave it out")
            return original(self, *args, **kwargs)
        _check_continuous_drafter(assistant_model)
        arguments = signature.bind(self, *args, **kwargs).arguments
        arguments.pop("self")
        arguments.update(arguments.pop("kwargs", {}))
        return run_with_drafter(self, assistant_model, **arguments, dflash_adaptive=dflash_adaptive)

    parameters = list(signature.parameters.values())
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
             for name in ("assistant_model", "dflash_adaptive")]
    at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
    method.__signature__ = signature.replace(parameters=[*parameters[:at], *extra, *parameters[at:]])
    method._dflash_dispatch = True
    return method


def _dflash_manager(
    model: Any, drafter: Any, generation_config: Any = None, continuous_batching_config: Any = None,
    workload_hints: Any = None, dflash_adaptive: Any = None,
) -> Any:
    """`init_continuous_batching` with a drafter: the manager kept by `stop(keep_for_next_session=True)` for this
    drafter, or a new one. (Workload hints size transformers' cache; the engine is sized by the config.)"""
    from .dflash_continuous import DFlashContinuousBatchingManager

    kept = getattr(model, "_dflash_continuous_batching_manager", None)
    if kept is not None and kept.drafter is drafter:
        return kept
    return DFlashContinuousBatchingManager(
        model, drafter, generation_config, continuous_batching_config, adaptive=dflash_adaptive
    )


@contextmanager
def _dflash_manager_context(
    model: Any, drafter: Any, generation_config: Any = None, block: bool = True, timeout: float | None = None,
    continuous_batching_config: Any = None, persistent_manager: bool = False, warmup: bool = True,
    workload_hints: Any = None, dflash_adaptive: Any = None,
) -> Iterator[Any]:
    """`continuous_batching_context_manager` with a drafter: a started manager, stopped on the way out."""
    manager = model.init_continuous_batching(
        generation_config=generation_config, continuous_batching_config=continuous_batching_config,
        assistant_model=drafter, dflash_adaptive=dflash_adaptive,
    )
    if warmup:
        manager.warmup()
    manager.start()
    try:
        yield manager
    finally:
        manager.stop(block=block, timeout=timeout, keep_for_next_session=persistent_manager)
        if not persistent_manager:
            manager.destroy()


def _dflash_generate_batch(
    model: Any, drafter: Any, inputs: list[list[int]], generation_config: Any = None,
    continuous_batching_config: Any = None, record_timestamps: bool = False, progress_bar: bool = False,
    persistent_manager: bool = False, warmup: bool = True, max_new_tokens: int | None = None,
    dflash_adaptive: Any = None, **unknown: Any,
) -> dict[str, Any]:
    """`generate_batch` with a drafter: every prompt through the manager, served in the calling thread
    (`run_until_done`: the call waits anyway, so a worker thread would only add a hand-off per step); {request id:
    GenerationOutput} in the order of `inputs` (a failed request's output carries its error), with transformers'
    progress bar when `progress_bar`."""
    if unknown:
        raise ValueError(f"generate_batch takes max_new_tokens and no other generation option ({', '.join(unknown)}); "
                         "set them in generation_config")
    if not inputs:
        return {}
    manager = model.init_continuous_batching(
        generation_config=generation_config, continuous_batching_config=continuous_batching_config,
        assistant_model=drafter, dflash_adaptive=dflash_adaptive,
    )
    if warmup:
        manager.warmup()
    requests = [manager.make_request(prompt, max_new_tokens=max_new_tokens, record_timestamps=record_timestamps)
                for prompt in inputs]  # every prompt checked before any work
    request_ids = [request.request_id for request in requests]
    waiting = requests[::-1]
    results: dict[str, Any] = {}
    with tqdm(total=len(inputs), disable=not progress_bar, desc=f"Solving {len(inputs)} requests",
              unit="request") as bar:

        def after_turn() -> None:
            # requests go in as the queue takes them (`max_queue_size` may bound it), finished outputs come out
            while waiting and not manager.input_queue.full():
                manager.queue(waiting.pop())
            while (result := manager.get_result(timeout=0)) is not None:
                if result.is_finished():
                    results[result.request_id] = result
                    bar.update(1)

        after_turn()
        manager.run_until_done(after_turn)
        after_turn()
    if persistent_manager:  # as stop(keep_for_next_session=True) keeps it
        model._dflash_continuous_batching_manager = manager
    return {request_id: results[request_id] for request_id in request_ids if request_id in results}


def install_continuous_batching_dispatch() -> None:
    """Give `ContinuousMixin`'s entry points their `assistant_model` (idempotent)."""
    for name, run_with_drafter in (
        ("init_continuous_batching", _dflash_manager),
        ("continuous_batching_context_manager", _dflash_manager_context),
        ("generate_batch", _dflash_generate_batch),
    ):
        original = getattr(ContinuousMixin, name, None)
        if original is not None and not getattr(original, "_dflash_dispatch", False):
            setattr(ContinuousMixin, name, _taking_assistant_model(original, run_with_drafter))


__all__ = ["install_continuous_batching_dispatch", "install_generate_dispatch", "is_dflash_drafter"]
