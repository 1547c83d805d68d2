"""Serving with a DFlash drafter behind `transformers serve`, the OpenAI-compatible server of transformers.

transformers serve batches continuously through `model.init_continuous_batching(...)`. hf-dflash attaches a drafter
to the target there, so that the manager transformers serve starts speculates, and changes nothing else: the
endpoints, chat templates, streaming, tool calls and every option are transformers serve's own.

Three ways in, from the most to the least managed:

    hf-dflash serve TARGET --drafter DRAFTER [transformers serve's options]       # the command (serve_cli.py)

    from transformers.cli.serve import Serve                                      # transformers' server, started
    served = ServedTarget.for_serving("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16")   # from Python
    with drafter_in_transformers_serve(served):
        Serve(served.name, continuous_batching=True, host="127.0.0.1", port=8000)

    attach_drafter(target, drafter)          # any code that calls target.init_continuous_batching(...) itself

`ServedTarget` is what travels to the process that loads the model (transformers serve loads it in a process of
its own from 5.25): which target, which drafter, and what a request may ask for. Its `prepare` runs there, on the
loaded target, and attaches the drafter; everything version-dependent about how it gets there is in
`serve_transformers.py`.
"""

from __future__ import annotations

import functools
import signal
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .modeling import DFlashDraftModel
from .modeling.dflash_checks import check_drafter_fits, fit_problems
from .serve_requests import RequestLimits
from .serve_transformers import drafter_in_transformers_serve, run_serve

# The one bundled target `hf-dflash serve` knows by name: SmolLM2-135M-Instruct (a chat model), served from the
# dense copy `bundled_models` keeps of it. The shipped drafter is trained for it.
BUNDLED_TARGET = "smollm2"


# --------------------------------------------------------------------------------------------------
# The drafter on a loaded target
# --------------------------------------------------------------------------------------------------


@dataclass
class DrafterAttachment:
    """A drafter attached to a target, and the continuous-batching managers the target started with it.

    drafter: the DFlash drafter, or None for transformers' own manager without one (the baseline a load test
        compares against, and the way to test the serving layer alone).
    adaptive: the engine's verify policy (`dflash_adaptive`): None for on where it runs on a CPU, True, False.
    """

    drafter: torch.nn.Module | None
    adaptive: bool | None = None
    managers: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    def manager_arguments(self) -> dict[str, Any]:
        """What `init_continuous_batching` gets on top of its caller's arguments: the drafter and its verify policy,
        when there is a drafter."""
        return {} if self.drafter is None else {"assistant_model": self.drafter, "dflash_adaptive": self.adaptive}

    def running_manager(self) -> Any | None:
        """The manager whose worker runs now (transformers serve keeps one per model), or None."""
        return next((manager for manager in self.managers if manager.is_running()), None)


# target -> its attachment; weak, so that attaching keeps no model alive.
_ATTACHMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attach_drafter(
    target: torch.nn.Module, drafter: torch.nn.Module | None, limits: RequestLimits = RequestLimits(),
    adaptive: bool | None = None,
) -> DrafterAttachment:
    """Make every continuous-batching manager `target` starts speculate with `drafter`.

    After this call `target.init_continuous_batching(...)`, as transformers serve (or any other code) calls it,
    returns a manager running the DFlash engine with `drafter`; the caller's own arguments pass through. A second
    call replaces the first. `drafter=None` keeps transformers' own manager (the managers are still recorded, for
    `served_state`). The managers refuse, with a ValueError naming the limit, a request whose prompt and
    `max_new_tokens` together exceed `limits.max_request_tokens`. `adaptive`: the engine's verify policy (None: on
    where the engine runs on a CPU; see dflash_engine.py). Raises ValueError, naming the fix, for a drafter that does
    not fit the target.
    """
    if drafter is not None:
        check_drafter_fits(drafter, target)
    attachment = DrafterAttachment(drafter, adaptive)
    plain = type(target).init_continuous_batching.__get__(target)  # the class's: a second attach replaces the first

    @functools.wraps(plain)
    def init_continuous_batching(*args: Any, **kwargs: Any) -> Any:
        manager = plain(*args, **kwargs, **attachment.manager_arguments())
        if limits.max_request_tokens is not None:
            refuse_what_never_fits(manager, limits)
        attachment.managers.add(manager)
        return manager

    target.init_continuous_batching = init_continuous_batching
    _ATTACHMENTS[target] = attachment
    return attachment


def refuse_what_never_fits(manager: Any, limits: RequestLimits) -> None:
    """`manager.add_request` raises ValueError for a request longer than `limits.max_request_tokens`, prompt and
    answer: past it the answer would be wrong (beyond the context) or would never be admitted."""
    add_request = manager.add_request

    @functools.wraps(add_request)
    def add_request_that_fits(input_ids: list[int], *args: Any, max_new_tokens: int | None = None, **kwargs: Any):
        length = len(input_ids) + (max_new_tokens or 0)
        if length > limits.max_request_tokens:
            raise ValueError(
                f"the prompt ({len(input_ids)} tokens) and max_tokens ({max_new_tokens}) come to {length} tokens, "
                f"more than a request can hold here: {limits.max_request_tokens} ({limits.limited_by}); send a "
                "shorter prompt or a smaller max_tokens"
            )
        return add_request(input_ids, *args, max_new_tokens=max_new_tokens, **kwargs)

    manager.add_request = add_request_that_fits


def served_state(target: torch.nn.Module) -> dict[str, Any]:
    """What the served target's manager holds now: requests running and waiting, and with a drafter the pages of
    its two pools (`engine.pool_usage()`). All zero before the first request starts a manager."""
    attachment = _ATTACHMENTS[target]
    state: dict[str, Any] = {"drafter": attachment.drafter is not None, "requests_running": 0, "requests_waiting": 0}
    manager = attachment.running_manager()
    if manager is None:
        return state
    scheduler = manager.batch_processor.scheduler if manager.batch_processor is not None else None
    if scheduler is not None:
        state["requests_running"] = len(scheduler.active_requests)
        state["requests_waiting"] = len(scheduler.waiting_requests)
    if attachment.drafter is not None:
        state.update(manager.engine.pool_usage())
    return state


# --------------------------------------------------------------------------------------------------
# What travels to the process that loads the target
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServedTarget:
    """The target a server runs, under the name its clients use, with its drafter, and the limits of a request.

    name: the model name clients send (`model=`), and transformers serve's `force_model`.
    folder: the local folder transformers loads for `name` when `name` is a bundled target; None: `name` loads as is.
    drafter: the drafter's folder or Hub id; None serves with transformers' own manager, without a drafter.
    limits: what a request may ask for (see `serve_requests.py`).
    adaptive: the engine's verify policy: None (on where it runs on a CPU), True or False.
    """

    name: str
    folder: str | None = None
    drafter: str | None = None
    limits: RequestLimits = RequestLimits()
    adaptive: bool | None = None

    @classmethod
    def for_serving(
        cls, target: str, drafter: str | None, trust_remote_code: bool = False, max_model_len: int | None = None,
        adaptive: bool | None = None,
    ) -> "ServedTarget":
        """Reads the target's and the drafter's configs (no weights) and checks that they fit; raises ValueError
        naming the fix when they do not. `target` is a folder, a Hub id, or `smollm2` (the bundled SmolLM2)."""
        from transformers import AutoConfig

        folder = str(bundled_target_folder()) if target == BUNDLED_TARGET else None
        target_config = AutoConfig.from_pretrained(folder or target, trust_remote_code=trust_remote_code)
        context = target_config.get_text_config().max_position_embeddings
        limits = RequestLimits(context, "the target's context")
        if max_model_len is not None:
            limits = RequestLimits(max_model_len, "--max-model-len")
        if drafter is not None:
            drafter_config = drafter_config_of(drafter)
            problems = fit_problems(drafter_config, target_config)
            if problems:
                raise ValueError(
                    f"the drafter {drafter} does not fit the target {target}: {'; '.join(problems)}. Pass --drafter "
                    "with a drafter trained for this target (hf-dflash info DRAFTER --target TARGET checks a pair)"
                )
            drafter_context = drafter_config.max_position_embeddings
            if drafter_context is not None and drafter_context < (limits.max_request_tokens or drafter_context + 1):
                limits = RequestLimits(drafter_context, "the drafter's context")
        return cls(name=target, folder=folder, drafter=drafter, limits=limits, adaptive=adaptive)

    def prepare(self, target: torch.nn.Module) -> None:
        """Runs where transformers serve loaded the target, before its first request: loads the drafter in the
        target's dtype on its device and attaches it (`attach_drafter`)."""
        drafter = None
        if self.drafter is not None:
            drafter = DFlashDraftModel.from_pretrained(self.drafter, dtype=target.dtype).to(target.device).eval()
        attach_drafter(target, drafter, self.limits, self.adaptive)


def serve_until_stopped(served: ServedTarget, options: dict[str, Any], graceful_shutdown_seconds: float = 30) -> None:
    """Runs transformers serve (`Serve(served.name, **options)`) with `served`'s drafter attached, until it stops.

    SIGTERM stops it gracefully and returns: while the server runs, uvicorn takes SIGTERM itself (it stops accepting,
    lets the answers in flight finish for up to `graceful_shutdown_seconds` and cancels the rest) and raises it again
    once stopped; the handler set here takes that one, and one that arrives while the model loads, as SystemExit(0).
    """

    def stop(_signum: int, _frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    with drafter_in_transformers_serve(served, graceful_shutdown_seconds):
        run_serve(served, options)


def drafter_config_of(drafter: str) -> Any:
    """A drafter's config, read without its weights, in any layout hf-dflash loads (see cli_checks.drafter_config)."""
    from .cli_checks import drafter_config

    return drafter_config("--drafter", drafter)


def bundled_target_folder() -> Path:
    """The folder transformers serve loads the bundled SmolLM2 from (made on first use, ~30 s; see
    `bundled_models.smollm2_folder`)."""
    from .bundled_models import smollm2_folder

    return smollm2_folder()


def stop_managers(target: torch.nn.Module, timeout: float = 10) -> None:
    """Stops the workers of the managers `target` started (threads that would keep the process alive) at once,
    failing what they still hold: a server calls this once its graceful shutdown is over."""
    attachment = _ATTACHMENTS.get(target)
    for manager in list(attachment.managers) if attachment is not None else []:
        if manager.is_running():
            manager.stop(block=True, timeout=timeout, hard_stop=True)


def read_served_state(target: torch.nn.Module, processor: Any) -> dict[str, Any]:
    """`served_state`, in the shape of a function transformers serve runs in the model's process
    (`EngineClient.submit(function)` calls it with the model and its processor)."""
    return served_state(target)


__all__ = [
    "BUNDLED_TARGET",
    "DrafterAttachment",
    "ServedTarget",
    "attach_drafter",
    "drafter_in_transformers_serve",
    "serve_until_stopped",
    "served_state",
    "stop_managers",
]

