"""`DFlashContinuousBatchingManager`: transformers' continuous-batching manager API over the DFlash engine.

`target.init_continuous_batching(..., assistant_model=drafter)` returns one (dflash_dispatch.py), and so code written
for transformers' continuous batching (`transformers serve`, `generate_batch`, a loop over `add_request` and
`get_result`) speculates with the drafter and changes nothing else. The public methods and attributes are those of
transformers' `ContinuousBatchingManager` (5.17 to 5.25): `start`, `stop`, `join`, `is_running`, `destroy`,
`warmup`, `pause`, `add_request(s)`, `cancel_request`, `get_result`, iteration, `request_id_iter`,
`register_result_handler`, `background_thread_status.fatal_error`, `logit_processor.supported_keys`, and
`batch_processor.scheduler` with `active_requests` / `waiting_requests` (None before the worker starts); outputs are
transformers' `GenerationOutput`, a failed request's with its `error`. Beyond them, `run_until_done` serves the
queued requests in the calling thread, with no worker thread (what `generate_batch` does).

A worker thread runs the loop: take new requests and cancellations, admit waiting requests in arrival order while a
row and their first pages are free (dflash_engine.py), run one verify step over the running rows, hand each request
its committed tokens (every step when it streams, at the end otherwise; cumulative, as transformers does), and retire
what ended (its eos, its max_new_tokens, a cancellation) in the same step, so its row and pages serve the next
request at once. Requests take pages as they grow; when the next step would need more than are free, the requests
that arrived last are preempted (`_preempt`): back to the front of the queue, they are admitted again later with
what they generated, and go on from there. A request that fails in its prefill fails alone; one step that raises
fails the requests in it, and the worker keeps serving.

Per request: max_new_tokens, eos_token_id, temperature / top_k / top_p and repetition_penalty
(dflash_row_sampling.py); greedy requests equal plain greedy `generate` token for token (with their penalty, if
any), sampled ones follow the target's distribution.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus
from transformers.utils import logging

from .dflash_checks import rope_switch
from .dflash_engine import PREFILL_CHUNK, DFlashEngine
from .dflash_openmp import release_openmp_threads
from .dflash_policy import VerifyPolicy
from .dflash_row_sampling import PER_REQUEST, SamplingSettings

logger = logging.get_logger(__name__)

# Rows when the continuous-batching config does not say (`max_requests_per_batch`). Memory does not grow with them
# (the engine's pools hold DEFAULT_MEMORY_SEQUENCES long requests by default): shorter requests fill more rows. With
# the verify policy a wide batch pays on a CPU too (measured: docs/continuous-batching.md); 8 rows kept 56 of 64
# clients of `hf-dflash serve` waiting.
DEFAULT_MAX_BATCH_SIZE = 64
# The `ContinuousBatchingConfig` settings the manager applies. Requests are always processed per request here
# (`per_request_processors`), and options a request cannot have are refused rather than dropped
# (`drop_unsupported_processors`). The others size, schedule or compile transformers' own manager: one set away from
# its default is named in a warning, so that no one takes it for applied.
APPLIED_CONFIG = frozenset({
    "max_requests_per_batch", "num_blocks", "page_size", "block_size", "max_batch_tokens", "use_cuda_graph",
    "return_logprobs", "max_queue_size", "per_request_processors", "drop_unsupported_processors",
})


@dataclass
class Request:
    """One request through its life: waiting, running in a row, finished or failed."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    eos: frozenset[int]
    sampling: SamplingSettings
    streaming: bool
    timestamps: list[float] | None
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None  # the generated tokens' log-probabilities, when the manager returns them
    status: RequestStatus = RequestStatus.PENDING
    error: str | None = None
    created_time: float = field(default_factory=time.perf_counter)
    started_time: float = -1.0
    finished_time: float = -1.0

    @property
    def context(self) -> list[int]:
        """What the engine prefills when it admits the request: its prompt, and what it generated before it was
        preempted."""
        return self.prompt + self.generated

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def take(self, tokens: list[int], logprobs: list[float]) -> bool:
        """Append committed tokens (and their log-probabilities, where kept) up to and including an eos, and at most
        max_new_tokens in all; True when the request has ended."""
        for i, token in enumerate(tokens):
            self.generated.append(token)
            if self.logprobs is not None:
                self.logprobs.append(logprobs[i])
            if self.timestamps is not None:
                self.timestamps.append(time.perf_counter())
            if token in self.eos or len(self.generated) >= self.max_new_tokens:
                return True
        return False

    def output(self) -> GenerationOutput:
        return GenerationOutput(
            request_id=self.request_id,
            prompt_ids=list(self.prompt),
            generated_tokens=list(self.generated),
            logprobs=[] if self.logprobs is None else list(self.logprobs),
            error=self.error,
            status=self.status,
            created_time=self.created_time,
            lifespan=(self.started_time, self.finished_time),
            timestamps=None if self.timestamps is None else list(self.timestamps),
        )


@dataclass
class WorkerStatus:
    """What transformers' `background_thread_status` tells callers: the error that stopped the worker, if any."""

    fatal_error: str | None = None


class RequestOptions:
    """`manager.logit_processor` as transformers serve reads it: the sampling options a request may set itself."""

    supported_keys = PER_REQUEST


class DFlashScheduler:
    """The requests the worker holds, by id, as transformers' scheduler shows them."""

    def __init__(self) -> None:
        self.waiting_requests: OrderedDict[str, Request] = OrderedDict()
        self.active_requests: dict[str, Request] = {}


@dataclass
class DFlashBatchProcessor:
    """`manager.batch_processor` while the worker runs: its scheduler, and the engine as its cache."""

    scheduler: DFlashScheduler
    cache: DFlashEngine


def _warn_unapplied(config: Any) -> None:
    """Warn, naming them, of the settings of a `ContinuousBatchingConfig` away from their defaults that the manager
    does not apply (APPLIED_CONFIG)."""
    if config is None or not is_dataclass(config):
        return
    defaults = type(config)()
    unapplied = sorted(
        item.name for item in fields(config)
        if item.name not in APPLIED_CONFIG and getattr(config, item.name) != getattr(defaults, item.name)
    )
    if unapplied:
        logger.warning(
            "DFlash continuous batching does not apply these ContinuousBatchingConfig settings: "
            f"{', '.join(unapplied)} (they size, schedule or compile transformers' own manager; the DFlash engine "
            "reads max_requests_per_batch, num_blocks x page_size, max_batch_tokens, use_cuda_graph, return_logprobs "
            "and max_queue_size)"
        )


class DFlashContinuousBatchingManager:
    """Continuous batching with a DFlash drafter, with transformers' `ContinuousBatchingManager` API.

    Args:
        model: the target.
        drafter: a DFlash drafter trained for it.
        generation_config: defaults for every request (max_new_tokens, eos_token_id, do_sample, temperature, top_k,
            top_p, repetition_penalty); options the engine does not apply per row are refused here with a ValueError.
        continuous_batching_config: transformers' `ContinuousBatchingConfig`; its `max_requests_per_batch` sets the
            rows, `num_blocks` x its page size the tokens each pool holds, and `max_batch_tokens` the most prompt
            positions one prefill forward takes (longer prompts are prefilled in chunks); `use_cuda_graph` whether
            steps run at bucketed shapes recorded as CUDA graphs (the engine's `static_shapes`; None: on a GPU);
            `return_logprobs` whether outputs carry each generated token's log-probability (as transformers' do).
        max_batch_size, max_tokens, static_shapes: the same, directly (they win over the config).
        adaptive: whether the engine's verify policy chooses each step's width (`DFlashEngine`'s `adaptive`: None,
            the default, turns it on where the engine runs on a CPU without static shapes).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        drafter: torch.nn.Module,
        generation_config: Any = None,
        continuous_batching_config: Any = None,
        max_batch_size: int | None = None,
        max_tokens: int | None = None,
        static_shapes: bool | None = None,
        adaptive: bool | VerifyPolicy | None = None,
    ):
        self.model, self.drafter = model, drafter
        self.generation_config = generation_config if generation_config is not None else model.generation_config
        config = self.generation_config
        if (getattr(config, "num_return_sequences", None) or 1) > 1 or (getattr(config, "num_beams", None) or 1) > 1:
            raise ValueError(
                "DFlash continuous batching returns one sequence per request; set num_return_sequences=1 and "
                "num_beams=1 in the generation config"
            )
        self.default_sampling = SamplingSettings.from_config(config)
        cb = continuous_batching_config
        if max_batch_size is None:
            max_batch_size = getattr(cb, "max_requests_per_batch", None) or DEFAULT_MAX_BATCH_SIZE
        if max_tokens is None and getattr(cb, "num_blocks", None):
            page = getattr(cb, "page_size", None) or getattr(cb, "block_size", None)
            max_tokens = cb.num_blocks * page if page else None
        self.continuous_batching_config = cb
        _warn_unapplied(cb)
        prefill_chunk = getattr(cb, "max_batch_tokens", None) or PREFILL_CHUNK
        if static_shapes is None:  # transformers' config: a bool, or one per path (varlen, decode) once decided
            graphs = getattr(cb, "use_cuda_graph", None)
            static_shapes = any(graphs) if isinstance(graphs, tuple) else graphs
        self.engine = DFlashEngine(
            model, drafter, max_batch_size=max_batch_size, max_tokens=max_tokens, prefill_chunk=prefill_chunk,
            static_shapes=static_shapes, adaptive=adaptive,
            return_logprobs=bool(getattr(cb, "return_logprobs", False)),
        )
        self.logit_processor = RequestOptions()
        self.background_thread_status = WorkerStatus()
        self.batch_processor: DFlashBatchProcessor | None = None
        self.warmed_up = False
        self.preemptions = 0  # requests sent back to the queue for pages since the manager was made (`_preempt`)
        # as transformers' manager: add_request waits while `max_queue_size` requests wait to be taken (0: no bound)
        self.input_queue: queue.Queue[Request] = queue.Queue(maxsize=getattr(cb, "max_queue_size", None) or 0)
        self.cancel_queue: queue.Queue[str] = queue.Queue()
        self.output_queue: queue.Queue[GenerationOutput] = queue.Queue()
        self.result_handlers: dict[str, tuple[Callable, asyncio.AbstractEventLoop]] = {}
        # The latest output of a request no handler took (a handler registered after it was produced gets it).
        self._unclaimed: dict[str, GenerationOutput] = {}
        self._outputs_lock = threading.Lock()
        self._request_counter = 0
        self._counter_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop_mode: str | None = None  # "flush" (finish what was sent) or "hard" (fail it)
        self._step_lock = threading.RLock()  # held by the worker per iteration; `pause` takes it
        self._generation_thread: threading.Thread | None = None

    # -- control ----------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def warmup(self) -> None:
        """Where the engine runs static shapes (recorded as CUDA graphs on a GPU), pay the one-time costs before
        serving, so the first real requests do not wait for them: on a GPU, record the step of greedy rows (under a
        verify policy, each of its parts) at every row bucket and span bucket for requests of up to
        `RECORD_SPAN_LIMIT` positions (`DFlashEngine.record_shapes`,
        as transformers' manager records its graphs here), then run one short greedy request (its prefill: kernels
        chosen, memory cached). Its row and pages are free again afterwards; greedy requests' tokens do not change.
        Elsewhere nothing to do, as transformers' own manager does nothing without graphs or compilation. It waits
        for the worker's step in progress, if any."""
        engine = self.engine
        with self._step_lock:
            engine.record_shapes()
            if engine.static_shapes and not engine.sequences:
                block = engine.block_size
                prompt = [0] * block  # token 0 exists in every vocabulary; what it decodes to does not matter here
                if engine.fits_now(len(prompt), 2 * block):
                    key = ("warm-up", id(self))  # not a request id: those are strings
                    engine.admit(key, prompt, 2 * block, SamplingSettings())
                    try:
                        # two steps at least (each commits at most a block): a first run and, on a GPU, its recording
                        while engine.sequences and engine.sequences[0].position < engine.sequences[0].max_length - 1:
                            engine.run_step()
                    finally:
                        engine.retire(key)
        self.warmed_up = True

    def is_running(self) -> bool:
        """Whether the worker thread has started and is alive."""
        return self._generation_thread is not None and self._generation_thread.is_alive()

    def start(self) -> None:
        """Start the worker thread. On a CPU, first free the calling thread's OpenMP threads (dflash_openmp.py): with
        them waiting beside the worker's own, the worker's steps run slower; the caller's next parallel torch op
        builds them again."""
        if self.is_running():
            logger.warning("Manager thread is already running.")
            return
        self._stop_mode = None
        self.background_thread_status = WorkerStatus()
        inference = torch.is_inference_mode_enabled()
        if self.engine.anchor_ids.device.type == "cpu" and not release_openmp_threads():
            logger.info_once(
                "DFlash continuous batching: torch does not run on GNU OpenMP here, so the calling thread's intra-op "
                "threads stay; if they are many, the worker thread's steps may run slower than in the calling thread"
            )
        self._generation_thread = threading.Thread(
            target=self._run, kwargs={"inference": inference}, name="dflash-continuous-batching", daemon=True
        )
        self._generation_thread.start()

    def stop(
        self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:
        """Stop the worker: it finishes the requests it holds (or, with hard_stop, fails them) and exits. `block`
        waits up to `timeout` seconds. `keep_for_next_session` keeps this manager on the model, for the next
        `init_continuous_batching` with the same drafter."""
        if self._generation_thread is None:
            logger.warning("Manager not started.")
            return
        self._stop_mode = "hard" if hard_stop else "flush"
        self._wake.set()
        if block:
            self.join(time.perf_counter(), timeout)
        if keep_for_next_session:
            self.model._dflash_continuous_batching_manager = self
        elif not self.is_running():
            self.batch_processor = None

    def join(self, stop_trigger_time: float, timeout: float | None = None) -> None:
        """Wait for the worker to exit, for at most `timeout` seconds."""
        if self._generation_thread is None:
            return
        self._generation_thread.join(timeout=timeout)
        if self._generation_thread.is_alive():
            logger.warning(f"Generation thread did not exit after join timeout ({timeout}).")
        else:
            logger.info(f"Background generation thread stopped after {time.perf_counter() - stop_trigger_time:.2f}s.")
            self._generation_thread = None

    def destroy(self) -> None:
        """Stop the worker if it runs. Safe to call more than once."""
        if self.is_running():
            self.stop(block=True)

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Hold the worker between two steps while the caller uses the model; its requests resume afterwards."""
        if not self.is_running():
            raise RuntimeError("Cannot pause generation while no generation loop is running.")
        with self._step_lock:
            yield

    def __enter__(self) -> "DFlashContinuousBatchingManager":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(block=True)

    # -- requests ---------------------------------------------------------------------------------------------------

    def add_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **logit_processor_kwargs: Any,
    ) -> str | None:
        """Queue a request; returns its id (None, with a warning, once the manager is stopping). Raises ValueError,
        before queueing, for a request the engine can never hold or options it does not apply per request."""
        if self._stop_mode is not None:
            logger.warning(f"The manager is stopping. Request {request_id} will be dropped.")
            return None
        request = self.make_request(
            input_ids, request_id, max_new_tokens, streaming, record_timestamps, eos_token_id, **logit_processor_kwargs
        )
        self.queue(request)
        return request.request_id

    def make_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **logit_processor_kwargs: Any,
    ) -> Request:
        """The request `add_request` queues, checked (a ValueError for one the engine can never hold or options it
        does not apply per request) but not queued: `generate_batch` checks all of its prompts before any work."""
        prompt = [int(token) for token in (input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids)]
        if prompt and isinstance(prompt[0], list):
            raise ValueError("add_request takes one prompt (a list of token ids); use add_requests for several")
        sampling = self.default_sampling.with_request(
            {name: value for name, value in logit_processor_kwargs.items() if value is not None}
        )
        if max_new_tokens is None:
            max_new_tokens = self.generation_config.max_new_tokens
        if max_new_tokens is None:  # as generate: max_length counts the prompt
            max_new_tokens = self.generation_config.max_length - len(prompt)
        self.engine.check_request(len(prompt), max_new_tokens)
        self._warn_of_rope_switch(len(prompt), max_new_tokens)
        if request_id is None:
            with self._counter_lock:
                request_id = f"req_{self._request_counter}"
                self._request_counter += 1
        return Request(
            request_id=request_id,
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            eos=self._eos(eos_token_id),
            sampling=sampling,
            streaming=streaming,
            timestamps=[] if record_timestamps else None,
            logprobs=[] if self.engine.return_logprobs else None,
        )

    def _warn_of_rope_switch(self, prompt_length: int, max_new_tokens: int) -> None:
        """Warn (once) of a request that can carry a target's length-dependent RoPE past its switch: a verify block
        reaches a block further than plain decoding, and a batch's forward rotates every row it holds alike, so the
        requests sharing its steps may be affected too."""
        block = self.engine.block_size
        found = rope_switch(self.model.config.get_text_config(), prompt_length, prompt_length + max_new_tokens, block)
        if found is not None:
            kind, switch = found
            logger.warning_once(
                f"DFlash: the target's {kind} RoPE changes its frequencies once a forward passes {switch} positions. "
                f"A request whose prompt and max_new_tokens come to more than {switch - block} tokens can get there "
                "within a verify block, and then its tokens, and those of the requests sharing its steps, may differ "
                f"from their own plain generate's; keep prompt + max_new_tokens at or below {switch - block}"
            )

    def queue(self, request: Request) -> None:
        """Queue a request from `make_request`, waiting while `max_queue_size` requests wait to be taken."""
        self.input_queue.put(request)
        self._wake.set()

    def _eos(self, eos_token_id: int | list[int] | None) -> frozenset[int]:
        """The request's eos ids: its own, else the generation config's, else the model config's (-1: none; a
        multimodal wrapper's is its text config's)."""
        model_eos = getattr(self.model.config.get_text_config(), "eos_token_id", None)
        for candidate in (eos_token_id, self.generation_config.eos_token_id, model_eos):
            if candidate is not None:
                ids = [candidate] if isinstance(candidate, int) else [int(token) for token in candidate]
                return frozenset(token for token in ids if token >= 0)
        return frozenset()

    def add_requests(
        self,
        inputs: list[list[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        **logit_processor_kwargs: Any,
    ) -> list[str]:
        """`add_request` for each prompt, in order; returns their ids."""
        return [
            self.add_request(
                prompt, max_new_tokens=max_new_tokens, streaming=streaming, record_timestamps=record_timestamps,
                **logit_processor_kwargs,
            )
            for prompt in inputs
        ]

    def cancel_request(self, request_id: str) -> None:
        """Cancel a request: it leaves the batch (its row and pages freed) before the next step; nothing more is
        delivered for it."""
        self.cancel_queue.put(request_id)
        self._wake.set()

    # -- results ----------------------------------------------------------------------------------------------------

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (of `request_id`, when given: another request's goes back to the queue and None is
        returned), waiting up to `timeout` seconds; None at once when none is queued and the worker is gone."""
        if self.output_queue.empty() and (
            self._generation_thread is None or self.background_thread_status.fatal_error is not None
        ):
            return None
        try:
            result = self.output_queue.get(block=True, timeout=timeout)
        except queue.Empty:
            return None
        if request_id is not None and result.request_id != request_id:
            self.output_queue.put(result)
            return None
        with self._outputs_lock:
            if self._unclaimed.get(result.request_id) is result:
                del self._unclaimed[result.request_id]
        return result

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Outputs as they come, while the worker runs."""
        while self.is_running():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """The outputs of one request as they come, until it ends (or the worker stops)."""
        while self.is_running():
            result = self.get_result(request_id=request_id, timeout=0.1)
            if result is not None:
                yield result
                if result.is_finished():
                    return

    def register_result_handler(self, request_id: str, callback: Callable) -> None:
        """Call `callback(output)` on the running event loop for each output of `request_id` (every step when it
        streams, once at the end otherwise), until it ends. An output produced before this call is handed over."""
        loop = asyncio.get_running_loop()

        def deliver_then_forget(result: GenerationOutput) -> None:
            callback(result)
            if result.is_finished():
                with self._outputs_lock:
                    self.result_handlers.pop(request_id, None)

        with self._outputs_lock:
            self.result_handlers[request_id] = (deliver_then_forget, loop)
            earlier = self._unclaimed.pop(request_id, None)
        if earlier is not None:
            loop.call_soon_threadsafe(deliver_then_forget, earlier)

    def _deliver(self, request: Request) -> None:
        output = request.output()
        with self._outputs_lock:
            handler = self.result_handlers.get(request.request_id)
            if handler is None:
                self._unclaimed[request.request_id] = output
                self.output_queue.put(output)
        if handler is not None:
            callback, loop = handler
            loop.call_soon_threadsafe(callback, output)

    # -- the worker -------------------------------------------------------------------------------------------------

    def run_until_done(self, after_turn: Callable[[], None] | None = None) -> None:
        """Serve, in the calling thread and with no worker thread, every request queued until none is left, calling
        `after_turn()` after each turn of the loop (it may queue more); the outputs wait for `get_result`, as the
        worker's do. `generate_batch` serves its batch this way: its caller waits anyway, so a worker thread would
        only add a hand-off per step, and on a CPU its steps would run slower whenever the caller's thread holds
        OpenMP threads again (`start`, dflash_openmp.py)."""
        if self.is_running():
            raise RuntimeError("the manager's worker thread is running: it serves the requests; stop it first")
        self._run(torch.is_inference_mode_enabled(), after_turn, until_done=True)

    def _run(self, inference: bool, after_turn: Callable[[], None] | None = None, until_done: bool = False) -> None:
        """The loop: the worker thread's until a stop, or with `until_done` (`run_until_done`) until no request is
        left."""
        scheduler = DFlashScheduler()
        self.batch_processor = DFlashBatchProcessor(scheduler, self.engine)
        try:
            with torch.inference_mode(inference), torch.no_grad():
                while (worked := self.iteration(scheduler)) is not None:
                    if after_turn is not None:
                        after_turn()
                    if until_done and not worked and not scheduler.waiting_requests and self.input_queue.empty():
                        break
                    if not worked:
                        self._wake.wait(timeout=0.1)
                        self._wake.clear()
            self._fail_all(scheduler, RuntimeError("the manager stopped before this request completed"))
        except Exception as error:  # the loop itself broke: every request fails, callers see why
            logger.error(f"Error in the DFlash continuous-batching loop: {error}", exc_info=True)
            self.background_thread_status.fatal_error = f"{type(error).__name__}: {error}"
            self._fail_all(scheduler, error)

    def iteration(self, scheduler: DFlashScheduler) -> bool | None:
        """One turn of the worker's loop: take new requests and cancellations, admit what fits, run one step.
        Returns whether a step ran (False: nothing to do yet), or None when the loop should end (a stop)."""
        with self._step_lock:
            self._take_new(scheduler)
            if self._stop_mode == "hard":
                return None
            self._admit(scheduler)
            if scheduler.active_requests:
                self._step(scheduler)
                return True
            if self._stop_mode == "flush" and not scheduler.waiting_requests:
                return None
            return False

    def _take_new(self, scheduler: DFlashScheduler) -> None:
        while not self.input_queue.empty():
            request = self.input_queue.get_nowait()
            scheduler.waiting_requests[request.request_id] = request
        while not self.cancel_queue.empty():
            request_id = self.cancel_queue.get_nowait()
            if scheduler.waiting_requests.pop(request_id, None) is None and request_id in scheduler.active_requests:
                del scheduler.active_requests[request_id]
                self.engine.retire(request_id)
            with self._outputs_lock:
                self.result_handlers.pop(request_id, None)
                self._unclaimed.pop(request_id, None)

    def _admit(self, scheduler: DFlashScheduler) -> None:
        """Admit waiting requests in arrival order while the engine has room for the first of them: those whose
        prompts come to at most the engine's `pack_tokens` tokens together, prefilled in one forward
        (`DFlashEngine.admit_many`)."""
        while scheduler.waiting_requests:
            batch, ahead = [], []
            for request in scheduler.waiting_requests.values():
                length = len(request.prompt) + len(request.generated)  # its `context`, without building it
                if ahead and sum(n for n, _ in ahead) + length > self.engine.pack_tokens:
                    break
                if not self.engine.fits_now(length, request.remaining, ahead):
                    break
                batch.append(request)
                ahead.append((length, request.remaining))
            if not batch:
                return
            for request in batch:
                del scheduler.waiting_requests[request.request_id]
                request.status = RequestStatus.PREFILLING
                if request.started_time < 0:  # not when a preempted request comes back
                    request.started_time = time.perf_counter()
            outcomes = self.engine.admit_many(
                [(request.request_id, request.context, request.remaining, request.sampling) for request in batch]
            )
            for request, outcome in zip(batch, outcomes):
                if isinstance(outcome, Exception):  # this request's prefill failed: it alone fails
                    self._fail(request, outcome)
                    continue
                request.status = RequestStatus.DECODING
                scheduler.active_requests[request.request_id] = request
                self._commit(scheduler, request, [outcome])

    def _preempt(self, scheduler: DFlashScheduler) -> None:
        """While the running requests' next step needs more pages than are free, the request that arrived last leaves
        the engine and goes back to the front of the queue: admitted again when there is room, with its prompt and
        the tokens it generated as its prompt, it goes on from where it stopped (its output so far stays; greedy
        tokens do not change). The request that arrived first always runs on: a request alone always fits."""
        while self.engine.pages_short() and len(scheduler.active_requests) > 1:
            newest = max(scheduler.active_requests.values(), key=lambda request: request.created_time)
            del scheduler.active_requests[newest.request_id]
            self.engine.retire(newest.request_id)
            newest.status = RequestStatus.PENDING
            scheduler.waiting_requests[newest.request_id] = newest
            scheduler.waiting_requests.move_to_end(newest.request_id, last=False)
            self.preemptions += 1

    def _step(self, scheduler: DFlashScheduler) -> None:
        self._preempt(scheduler)
        try:
            committed = self.engine.run_step()
        except Exception as error:  # fails the requests of this step; the worker keeps serving
            for request_id in list(scheduler.active_requests):
                self.engine.retire(request_id)
                self._fail(scheduler.active_requests.pop(request_id), error)
            return
        for request_id, tokens in committed.items():
            self._commit(scheduler, scheduler.active_requests[request_id], tokens)

    def _commit(self, scheduler: DFlashScheduler, request: Request, tokens: list[int]) -> None:
        if request.take(tokens, self.engine.take_logprobs(request.request_id)):
            request.status, request.finished_time = RequestStatus.FINISHED, time.perf_counter()
            del scheduler.active_requests[request.request_id]
            self.engine.retire(request.request_id)
            self._deliver(request)
        elif request.streaming:
            self._deliver(request)

    def _fail(self, request: Request, error: BaseException) -> None:
        request.status, request.error = RequestStatus.FAILED, str(error)
        request.finished_time = time.perf_counter()
        self._deliver(request)

    def _fail_all(self, scheduler: DFlashScheduler, error: BaseException) -> None:
        while not self.input_queue.empty():
            request = self.input_queue.get_nowait()
            scheduler.waiting_requests[request.request_id] = request
        for request_id in list(scheduler.active_requests):
            if any(sequence.key == request_id for sequence in self.engine.sequences):
                self.engine.retire(request_id)
            self._fail(scheduler.active_requests.pop(request_id), error)
        while scheduler.waiting_requests:
            self._fail(scheduler.waiting_requests.popitem(last=False)[1], error)


__all__ = ["DFlashContinuousBatchingManager"]
