"""One fast-path verify step against the target's own 1-token decode step, at a published shape, per context length.

The target and drafter are a published shape (`--shape`, random weights: see `published.py`), batch 1. Per context,
one greedy fast-path call of `--new-tokens`, whose sequence is then held in the call's engine frozen (`hold`), so
that every replay repeats the same work. Then, as CUDA graphs (median of 30 replays; on a CPU the same calls eagerly,
a smoke run of a scaled-down shape):
- `target_1_token_ms`: the target's own 1-token decode forward on the held step's cache and masks (its last token at
  its position), through the target's own attention: the floor a verify step is compared against (`hf-dflash bench
  decode` reports the same figure as `target_1_token_graph_ms`); `target_1_token_grouped_ms`: the same under the
  fast path's grouped attention, for reference.
- verify (the target over B rows, and acceptance), propose (context keys/values, drafter, lm_head) and the whole
  step, under each `--variants` of the fast path's forwards:
  * `before`: transformers' sdpa, which copies every key/value head per layer when a mask is given, and the
    drafter's context gathered slot by slot through the block tables;
  * `fold`: the grouped attention with the query heads of a group always folded into rows;
  * `fast_path`: the fast path as it runs with `dflash_compile=False`: sdpa with `enable_gqa=True` where torch's
    dispatcher serves the call with a fused kernel, the fold elsewhere, the drafter's pass eager;
  * `compiled`: the fast path's default, the drafter's pass compiled before the graph records it (`compile_s` is the
    time that compile took: the first call of a batch size and cache length waits that long).
  One profiled verify per variant records the sdpa ops it ran, so the backend torch picked is on record.
`--profile` adds, at one context and after every timing (a CUDA profiler can slow the launches that follow it), the
kernels of an eager verify, an eager and a compiled propose, and the target's eager 1-token forward, grouped by name.
On a hybrid shape (qwen3.5-4b) transformers runs flash-linear-attention's kernels for the Gated DeltaNet layers where
it is installed, else its PyTorch rule; `--without-fla` hides the package from this process (the report says which):
run once with and once without to compare the two.

This module is the one place `hf-dflash bench` reaches into the fast path's engine (its rows and the step's parts);
`decode` takes its GPU figures from here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from . import harness
from .published import RANDOM_SHAPES, random_pair, scaled_down

VARIANTS = ("before", "fold", "fast_path", "compiled")  # the compiled one last: compiling changes the held step
TARGET_1_TOKEN_BASELINE = (
    "the target's own forward of one token per sequence (its last committed token, at its position), with the "
    "target's own attention implementation, on the engine's target cache (with the Gated DeltaNet states for hybrid "
    "targets) under the engine's masks (sliding windows applied as the fast path applies them; attention sinks inside "
    "eager attention), recorded once as a CUDA graph after our last call of the setting; median of 30 replays. GPU "
    "only: absent from rows measured elsewhere."
)


# ------------------------------------------------------------------------------------------------------------------
# The held step and its parts (what `decode` reports on a GPU, and what the scenario below times per variant)
# ------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class HeldCall:
    """A fast-path call's sequences held in the engine that served it, frozen (their anchors no longer move), so that
    every step over `rows` repeats the same work: rows 0..n-1 of `engine` at the call's span (`hold`)."""

    engine: Any
    rows: Any

    def carried_state(self) -> list[torch.Tensor]:
        """What a step advances beyond the frozen anchors: a hybrid target's conv and recurrent states."""
        return [*self.engine.conv.values(), *self.engine.recurrent.values()]

    def remake_rows(self) -> None:
        """The rows again, after `bind` changed what they read."""
        self.rows = rows_of(self.engine, self.rows.anchor_ids.shape[0])


def rows_of(engine: Any, count: int) -> Any:
    """The engine's first `count` rows at the shape its step runs them."""
    from ..modeling.dflash_engine import RowScoring

    span = engine._step_span()
    if engine.static_shapes:
        count, span = engine._static_shape(count, span)
    return engine._rows(count, span, RowScoring(sampled=False, penalized=False))


@torch.no_grad()
def hold(drafter: torch.nn.Module, sequences: torch.LongTensor, attention_mask: torch.Tensor) -> HeldCall | None:
    """Hold a greedy fast-path call's output `sequences` (b, L), left-padded as `attention_mask` says, in the engine
    that served it: admitted again without their last token, which the admission chooses again (their anchor), then
    frozen. None when the call's target kept its keys/values in transformers' cache (no pool to hold them in)."""
    held = getattr(drafter, "_dflash_engine", None)
    if held is None or not held[1].target_pool.holds_keys:
        return None
    engine = held[1]
    engine.retire_all()
    engine.admit_call(sequences[:, :-1], attention_mask[:, :-1], sequences.shape[1], engine.processors)
    engine.active.zero_()
    return HeldCall(engine, rows_of(engine, len(engine.sequences)))


def graph_ms(fn: Any) -> float:
    """Median ms of `fn` recorded as a CUDA graph and replayed (the harness's graph timer)."""
    return harness.time_graph(fn).median_ms


def target_one_token_step(held: HeldCall) -> Any:
    """The target's own 1-token decode forward on the held call's target cache, as plain decoding's next step would
    run it: each sequence's last committed token at its own position, seeing every position before it (the engine's
    masks: a sliding layer only its window), through the target's own attention. Returns a function that runs it
    and returns the logits (b, 1, V). A hybrid target's linear states advance at each call (restore them with
    `carried_state`)."""
    step, rows = held.engine, held.rows
    positions = rows.anchor_pos[:, None]  # (b, 1) the token's own position
    visible = rows.key_positions <= positions[:, :, None]  # (b, 1, L)
    mask = step.target_masks(visible, positions, rows.key_positions)
    cache = rows.target_cache

    @torch.no_grad()
    def forward() -> torch.Tensor:
        cache.write_slots = positions
        return step.target(
            input_ids=rows.anchor_ids, position_ids=positions, attention_mask=mask, use_cache=True, logits_to_keep=1,
            **{step.cache_argument: cache},
        ).logits

    return forward


@torch.no_grad()
def target_1_token_ms(held: HeldCall, timer: Any = None) -> float:
    """`target_one_token_step` of a held call, timed by `timer` (default: as a CUDA graph, median of its replays);
    see TARGET_1_TOKEN_BASELINE. The carried states (a hybrid target's linear layers) are put back after."""
    saved = [state.clone() for state in held.carried_state()]
    try:
        return (timer or graph_ms)(target_one_token_step(held))
    finally:
        for state, value in zip(held.carried_state(), saved):
            state.copy_(value)


@torch.no_grad()
def step_parts_ms(held: HeldCall, timer: Any = None) -> dict[str, float]:
    """Our step's parts, timed by `timer` (default: each as a CUDA graph), over a held call (every sequence frozen,
    so each call repeats the same work): propose (context keys/values + drafter + lm_head), verify (target forward +
    acceptance) and the whole step."""
    timer = timer or graph_ms
    step, rows = held.engine, held.rows
    with step.proposer.capture:
        return {"propose_graph_ms": timer(lambda: step.propose(rows)),
                "verify_graph_ms": timer(lambda: step.verify(rows, None)),
                "step_graph_ms": timer(lambda: step.step(rows))}


def gpu_step_figures(
    target: torch.nn.Module, drafter: torch.nn.Module, batch: dict[str, torch.Tensor], max_new_tokens: int
) -> dict[str, float]:
    """On a GPU: a greedy fast-path call on `batch`, then, over its held sequences, our step's parts and the target's
    1-token step on the same cache, as CUDA graphs; {} when the call kept its keys/values in transformers' cache."""
    out = target.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=drafter)
    prompt_mask = batch["attention_mask"]
    mask = torch.nn.functional.pad(prompt_mask, (0, out.shape[1] - prompt_mask.shape[1]), value=1)
    held = hold(drafter, out, mask)
    if held is None:
        return {}
    try:
        return {**step_parts_ms(held), "target_1_token_graph_ms": target_1_token_ms(held)}
    finally:
        held.engine.retire_all()


# ------------------------------------------------------------------------------------------------------------------
# The scenario: variants of the fast path's forwards, per context
# ------------------------------------------------------------------------------------------------------------------


def folded_sdpa_attention(*args: Any, **kwargs: Any) -> Any:
    """The grouped attention with the query always folded, never `enable_gqa`."""
    from ..modeling import dflash_attention

    with mock.patch.object(dflash_attention, "fused_kernel_takes_grouped_heads", lambda *_: False):
        return dflash_attention.grouped_sdpa_attention(*args, **kwargs)


def variant_setup(name: str) -> tuple[Any, bool, bool]:
    """(the function the fast path's forwards call, whether the drafter reads its context through its contiguous
    view, whether the drafter's pass is compiled) of a variant."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ..modeling.dflash_attention import grouped_sdpa_attention

    return {
        "before": (sdpa_attention_forward, False, False),
        "fold": (folded_sdpa_attention, True, False),
        "fast_path": (grouped_sdpa_attention, True, False),
        "compiled": (grouped_sdpa_attention, True, True),
    }[name]


@contextlib.contextmanager
def fast_path_attention(function: Any):
    """The fast path's forwards call `function` while inside (grouped_attention points them at GROUPED_SDPA)."""
    from transformers import AttentionInterface

    from ..modeling.dflash_attention import GROUPED_SDPA, grouped_sdpa_attention

    AttentionInterface.register(GROUPED_SDPA, function)
    try:
        yield
    finally:
        AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)


def with_gathered_context(step: Any, rows: Any) -> Any:
    """`rows` whose drafter reads every context slot by a gather through the block tables (the `before` variant)."""
    from ..modeling.dflash_paged_cache import PagedView, page_slots

    n = rows.anchor_ids.shape[0]
    read_slots = page_slots(rows.block_tables, rows.draft_key_positions.expand(n, -1))  # (n, S)
    view = PagedView(step.proposer.cache, block_slots=rows.drafter_view.block_slots, read_slots=read_slots)
    return dataclasses.replace(rows, drafter_view=view)


def sdpa_ops(step: Any, rows: Any) -> dict[str, int]:
    """The sdpa and head-copy ops one eager verify runs (their names say which backend torch chose)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step.verify(rows, None)
    keep = ("scaled_dot_product", "attention", "repeat_interleave")
    return {e.key: e.count for e in profile.key_averages() if any(k in e.key for k in keep)}


def kernel_profile(fn: Any, top: int) -> dict[str, Any]:
    """What one eager call of `fn` runs, grouped by name: on CUDA its kernels (launches and device time), on CPU its
    aten ops (self time). The `top` names by total time, and the totals over all of them."""
    cuda = torch.cuda.is_available()
    fn()  # warm: the first call may pick algorithms or allocate
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as profile:
        fn()
        harness.synchronize("cuda" if cuda else "cpu")
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in profile.key_averages() if e.device_type == kind and (cuda or e.key.startswith("aten::"))]
    ranked = sorted(
        ((e.key, e.count, (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1000) for e in events),
        key=lambda entry: -entry[2],
    )
    return {
        "what": "CUDA kernels, device time" if cuda else "CPU aten ops, self time",
        "launches": sum(count for _, count, _ in ranked),
        "total_ms": sum(ms for *_, ms in ranked),
        "top": [{"name": name[:160], "calls": count, "total_ms": round(ms, 4)} for name, count, ms in ranked[:top]],
    }


@torch.no_grad()
def finished_step(target: Any, drafter: Any, context: int, new_tokens: int) -> HeldCall:
    """A greedy fast-path call of `new_tokens` on a random `context`-token prompt, its sequence then held frozen in
    the call's engine (so each step repeats the same work)."""
    # random ids below the mask token's (random weights: the text does not matter, only its length)
    prompt = torch.randint(0, drafter.config.mask_token_id, (1, context), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(target.device)
    # every token real: without a mask generate would take a random id equal to pad_token_id for padding
    out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, assistant_model=drafter, dflash_fast_path=True, dflash_compile=False)
    return hold(drafter, out, torch.ones_like(out))


def compile_drafter(held: HeldCall) -> dict[str, Any]:
    """Compile the held call's drafter pass at its rows, as a compiling call does before recording its graph; the
    seconds it took (dynamo, inductor and the kernels' first run), and why it failed if it did."""
    step = held.engine
    started = time.perf_counter()
    step.bind(step.processors, step.rule, False, False, compile_drafter=True)
    held.remake_rows()
    with step.proposer.capture:
        step._prepare_drafter(held.rows)
    seconds = time.perf_counter() - started
    print(f"  compiled the drafter pass in {seconds:.1f} s" + (f": FAILED, {step.compile_error}" if step.compile_error
                                                               else ""), flush=True)
    return {"compile_s": round(seconds, 2), "compile_error": step.compile_error}


def release(drafter: Any) -> None:
    """Drop the engine and its buffers before the next context, and give their memory back to the device."""
    from ..modeling.dflash_fast_path import release_fast_path

    release_fast_path(drafter)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def part_timer(device: str) -> Any:
    """A CUDA graph's median replay on a GPU; on a CPU the median of 3 eager calls (a smoke run's figures)."""
    if device == "cuda":
        return graph_ms
    return lambda fn: harness.time_call(fn, repeats=3, warmup=1).median_ms


@torch.no_grad()
def measure(target: Any, drafter: Any, context: int, args: argparse.Namespace) -> dict[str, Any]:
    from ..modeling.dflash_attention import grouped_attention

    timer = part_timer(args.device)
    held = finished_step(target, drafter, context, args.new_tokens)
    step, rows = held.engine, held.rows
    result: dict[str, Any] = {"context": context, "span": rows.key_positions.shape[0],
                              "target_1_token_ms": target_1_token_ms(held, timer)}
    with grouped_attention(target):
        result["target_1_token_grouped_ms"] = target_1_token_ms(held, timer)
    with step.proposer.capture:
        for name in args.variants:
            function, view, compiled = variant_setup(name)
            if compiled:
                result.update(compile_drafter(held))
                if result["compile_error"] is not None:
                    continue
                rows = held.rows  # the engine's views, made again after `bind`
            variant_rows = rows if view else with_gathered_context(step, rows)
            with fast_path_attention(function):
                parts = {
                    "verify_ms": timer(lambda: step.verify(variant_rows, None)),
                    "propose_ms": timer(lambda: step.propose(variant_rows)),
                    "step_ms": timer(lambda: step.step(variant_rows)),
                    "verify_sdpa_ops": sdpa_ops(step, variant_rows),
                }
            parts["step_over_1_token"] = parts["step_ms"] / result["target_1_token_ms"]
            result[name] = parts
            print(f"  ctx {context} {name:>10}: step {parts['step_ms']:7.2f} ms (verify {parts['verify_ms']:7.2f} + "
                  f"propose {parts['propose_ms']:6.2f}), {parts['step_over_1_token']:.2f}x the 1-token step "
                  f"{result['target_1_token_ms']:.2f} ms", flush=True)
    release(drafter)
    return result


@torch.no_grad()
def profile(target: Any, drafter: Any, context: int, args: argparse.Namespace) -> dict[str, Any]:
    """Kernels of an eager verify and propose under the fast path's attention, of a compiled propose, and of the
    target's eager 1-token forward, on a fresh call at `context`."""
    held = finished_step(target, drafter, context, args.new_tokens)
    step, rows = held.engine, held.rows
    with step.proposer.capture:
        found = {
            "verify": kernel_profile(lambda: step.verify(rows, None), args.profile_top),
            "propose": kernel_profile(lambda: step.propose(rows), args.profile_top),
        }
        if compile_drafter(held)["compile_error"] is None:
            rows = held.rows
            found["propose_compiled"] = kernel_profile(lambda: step.propose(rows), args.profile_top)
    found["target_1_token"] = kernel_profile(target_one_token_step(held), args.profile_top)
    for part, kernels in found.items():
        print(f"  ctx {context} {part:>16}: {kernels['launches']} {kernels['what']}, {kernels['total_ms']:.2f} ms",
              flush=True)
    release(drafter)
    return found


def linear_attention_kernels(target: Any) -> dict[str, Any] | None:
    """For a target with Gated DeltaNet layers, whether flash-linear-attention was there for transformers to pick
    (its version), or hidden / not installed, when transformers runs its own PyTorch rule; None for other targets."""
    if not any(hasattr(layer, "linear_attn") for layer in target.model.layers):
        return None
    if "fla" in sys.modules and sys.modules["fla"] is None:
        return {"flash_linear_attention": "hidden (--without-fla)"}
    if importlib.util.find_spec("fla") is None:
        return {"flash_linear_attention": "not installed"}
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {"flash_linear_attention": version("flash-linear-attention")}
    except PackageNotFoundError:
        return {"flash_linear_attention": "installed (version unknown)"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=list(RANDOM_SHAPES), default="qwen3-8b",
                        help="the published target and drafter to build with random weights (default: qwen3-8b)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192], help="prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens of the call that leaves the step held")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="the fast path's forwards to time (default: all; `compiled` compiles the drafter's pass)")
    parser.add_argument("--profile", action="store_true", help="kernels of a verify, a propose and a 1-token step")
    parser.add_argument("--profile-context", type=int, default=None,
                        help="the one context --profile profiles (default: the first of --contexts)")
    parser.add_argument("--profile-top", type=int, default=25, help="kernel names kept per part, by total time")
    parser.add_argument("--without-fla", action="store_true",
                        help="hide flash-linear-attention from this process (hybrid shapes: transformers' PyTorch "
                        "rule)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="cuda (default where there is one): CUDA graphs at the published shape; cpu: the shape "
                        "scaled down, parts timed eagerly (a smoke run, not a measurement)")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import at_least, check_device, each_at_least

    each_at_least("--contexts", args.contexts, 1)
    at_least("--new-tokens", args.new_tokens, 1)
    at_least("--profile-top", args.profile_top, 1)
    check_device("--device", args.device)
    if args.profile_context is not None and args.profile_context not in args.contexts:
        from ..cli_checks import BadArgument

        raise BadArgument(f"--profile-context {args.profile_context} is not one of --contexts {args.contexts}: "
                          "add it there")


def run(args: argparse.Namespace) -> int:
    args.device = args.device or harness.default_device()
    report = harness.header(args, args.device)
    if args.without_fla:
        sys.modules["fla"] = None  # importing fla now fails: transformers falls back to its PyTorch rule
    started = time.time()
    shape = RANDOM_SHAPES[args.shape] if args.device == "cuda" else scaled_down(args.shape)
    target, drafter = random_pair(shape, torch.bfloat16 if args.device == "cuda" else torch.float32, args.device)
    print(f"built the {args.shape} pair in {time.time() - started:.0f} s", flush=True)
    results = [measure(target, drafter, context, args) for context in args.contexts]
    if args.profile:  # last: a CUDA profiler can slow the replays timed after it
        context = args.profile_context or args.contexts[0]
        results[args.contexts.index(context)]["profile"] = profile(target, drafter, context, args)
    report.update(shape=args.shape, scaled_down=args.device != "cuda",
                  linear_attention_kernels=linear_attention_kernels(target),
                  timing="CUDA graph replays, median of 30" if args.device == "cuda" else "eager calls, median of 3",
                  target_1_token_baseline=TARGET_1_TOKEN_BASELINE, results=results)
    harness.write_report(args.out, report, plot)
    return 0


def plot(report: dict[str, Any], path: Path) -> None:
    """Our step per variant against the target's 1-token step (left), and their ratio (right), per context."""
    plt = harness.pyplot()
    rows = report["results"]
    contexts = [r["context"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(contexts, [r["target_1_token_ms"] for r in rows], "k--", marker="o", label="target 1-token step")
    for name in VARIANTS:
        timed = [r for r in rows if name in r]  # a failed compile leaves its variant out
        if timed:
            left.plot([r["context"] for r in timed], [r[name]["step_ms"] for r in timed], marker="o",
                      label=f"step, {name}")
            right.plot([r["context"] for r in timed], [r[name]["step_over_1_token"] for r in timed], marker="o",
                       label=name)
    for ax, label in ((left, f"ms ({report['timing']})"), (right, "our step / target 1-token step")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.set_xlabel("tokens of context")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['shape']} shape{' (scaled down)' if report['scaled_down'] else ''}, random weights, "
                 f"batch 1: {report['machine']} ({report['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
