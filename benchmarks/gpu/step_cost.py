"""One fast-path step at Qwen3-8B shape against the target's own 1-token step, with each attention the fast path could
use, side by side in one process (GPU; random weights, batch 1, bf16; about a minute on an H200).

Per context (512, 2048, 8192 tokens) one greedy fast-path call of 32 new tokens leaves its step held with the
sequence finished, so a replay repeats the same work. Then, as CUDA graphs (median of 30 replays):
- `target_1_token_ms`: the target's own 1-token decode step on the held step's own cache and masks (its last token
  at its position), through transformers' sdpa: `hf-dflash bench`'s target_1_token_graph_ms, the same function;
  `target_1_token_grouped_ms`: the same under the grouped attention, for reference.
- verify (the target's forward over B rows and acceptance), propose (context keys/values, drafter, lm_head) and the
  whole step, under each variant of the fast path's forwards:
  * `before`: transformers' sdpa, which copies every key/value head G times per layer when a mask is given, and the
    drafter's context gathered slot by slot through the block tables (the fast path until issue 15 item 4);
  * `fold`: the grouped attention with the query heads of a group always folded into rows (the fast path until
    2026-12-03's third session);
  * `fast_path`: sdpa with `enable_gqa=True` where torch's dispatcher serves the call with a fused kernel, the fold
    elsewhere (modeling/dflash_attention.py), and the drafter's pass eager;
  * `compiled`: the fast path now: the same, with the drafter's pass compiled by torch.compile before the graph records
    it (`DFlashStaticStep.prepare_drafter`); `compile_s` is the time that compile took (the first call of that shape).
One profiled verify per variant records the sdpa ops it ran, so the backend torch picked is on record.
`--profile` adds, at one context, the CUDA kernels of an eager verify, an eager propose, a propose with the compiled
drafter pass, and the target's eager 1-token forward (the one target_1_token_ms records), grouped by name with their
launches and total time (the top ones of each in the JSON), so one run shows where a step's time goes. That pass runs last, after every context's timings, on a
fresh call at its context: the CUDA profiler (CUPTI) can leave overhead on the launches that follow it in the
process, and when the profile ran first the 1-token step read 11.27 ms at 512 tokens on an H200, against 9.58 ms in
`hf-dflash bench` and 8.71 ms of kernels in the profile itself (the per-variant sdpa-op record asks the profiler for
CPU activity only). `--device cpu` runs a tiny random pair through the same call, compile and profile (CPU ops instead
of kernels, no timings; inductor's CPU kernels are not aten ops, so a compiled propose there lists only its matmuls and
attention): a smoke test of the script.
Writes <out>.json and <out>.png and prints a table with step / 1-token ratios.

    python benchmarks/gpu/step_cost.py --out "$OUT/step_cost" --profile
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

sys.path.insert(0, ".")
from hf_dflash.bench import (  # noqa: E402
    _graph_ms, random_pair, run_environment, target_1_token_graph_ms, target_one_token_step,
)
from hf_dflash.modeling import dflash_attention  # noqa: E402
from hf_dflash.modeling.dflash_attention import GROUPED_SDPA, grouped_attention, grouped_sdpa_attention  # noqa: E402
from hf_dflash.modeling.dflash_fast_path import DFlashStaticStep, release_fast_path  # noqa: E402
from hf_dflash.modeling.dflash_paged_cache import PagedView  # noqa: E402
from hf_dflash.modeling.dflash_static_cache import page_slots  # noqa: E402


def folded_sdpa_attention(*args: Any, **kwargs: Any) -> Any:
    """The grouped attention with the query always folded, never `enable_gqa` (the fast path before this choice)."""
    with mock.patch.object(dflash_attention, "fused_kernel_takes_grouped_heads", lambda *_: False):
        return grouped_sdpa_attention(*args, **kwargs)


# variant -> (the function the fast path's forwards call, whether the drafter reads through its contiguous view,
# whether the drafter's pass is compiled); the compiled one last, as compiling it changes the held step
VARIANTS = {
    "before": (sdpa_attention_forward, False, False),
    "fold": (folded_sdpa_attention, True, False),
    "fast_path": (grouped_sdpa_attention, True, False),
    "compiled": (grouped_sdpa_attention, True, True),
}


@contextlib.contextmanager
def fast_path_attention(function: Any):
    """The fast path's forwards call `function` while inside (grouped_attention points them at GROUPED_SDPA)."""
    AttentionInterface.register(GROUPED_SDPA, function)
    try:
        yield
    finally:
        AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)


def with_gathered_context(step: Any, rows: Any) -> Any:
    """`rows` whose drafter reads every context slot by a gather through the block tables, as before the view."""
    n = rows.anchor_ids.shape[0]
    read_slots = page_slots(rows.block_tables, step.draft_key_positions.expand(n, -1))  # (n, S)
    view = PagedView(step.generator.cache, block_slots=rows.drafter_view.block_slots, read_slots=read_slots)
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
        if cuda:
            torch.cuda.synchronize()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in profile.key_averages() if e.device_type == kind and (cuda or e.key.startswith("aten::"))]
    timed = sorted(
        ((e.key, e.count, (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1000) for e in events),
        key=lambda entry: -entry[2],
    )
    return {
        "what": "CUDA kernels, device time" if cuda else "CPU aten ops, self time",
        "launches": sum(count for _, count, _ in timed),
        "total_ms": sum(ms for *_, ms in timed),
        "top": [{"name": name[:160], "calls": count, "total_ms": round(ms, 4)} for name, count, ms in timed[:top]],
    }


@torch.no_grad()
def held_step(target: Any, drafter: Any, context: int, new_tokens: int) -> Any:
    """The fast-path step a greedy call of `new_tokens` on a random `context`-token prompt leaves held, its one
    sequence finished (so a replay repeats the same work)."""
    # random ids below the mask token's (random weights: the text does not matter, only its length)
    prompt = torch.randint(0, drafter.config.mask_token_id, (1, context), generator=torch.Generator().manual_seed(0))
    # every token real: without a mask generate would take a random id equal to pad_token_id for padding
    prompt = prompt.to(target.device)
    target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, do_sample=False,
                    pad_token_id=0, assistant_model=drafter, dflash_fast_path=True, dflash_compile=False)
    return drafter._dflash_static_step[1]


def compile_drafter(step: DFlashStaticStep) -> dict[str, Any]:
    """Compile the held step's drafter pass at its batch size, as a compiling call does before recording its graph;
    returns the seconds it took (dynamo, inductor and the kernels' first run), and why it failed if it did."""
    started = time.perf_counter()
    step.bind(step.processors, step.rule, False, False, compile_drafter=True)
    step.prepare_drafter(step.batch_size)
    seconds = time.perf_counter() - started
    print(f"  compiled the drafter pass in {seconds:.1f} s" + (f": FAILED, {step.compile_error}" if step.compile_error
                                                               else ""), flush=True)
    return {"compile_s": round(seconds, 2), "compile_error": step.compile_error}


def release(drafter: Any) -> None:
    """Drop the held step and its buffers before the next context, and give their memory back to the device."""
    release_fast_path(drafter)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def profile(target: Any, drafter: Any, context: int, new_tokens: int, top: int) -> dict[str, Any]:
    """Kernels of an eager verify and propose under the fast path's attention as it is now, and of the target's eager
    1-token forward that target_1_token_ms records (outside the capture hooks, as it is timed). Run after every
    timing: see the module's docstring."""
    step = held_step(target, drafter, context, new_tokens)
    rows = step.rows(step.batch_size)
    with step.generator.capture:
        found = {
            "verify": kernel_profile(lambda: step.verify(rows, None), top),
            "propose": kernel_profile(lambda: step.propose(rows), top),
        }
        if compile_drafter(step)["compile_error"] is None:
            rows = step.rows(step.batch_size)
            found["propose_compiled"] = kernel_profile(lambda: step.propose(rows), top)
    found["target_1_token"] = kernel_profile(target_one_token_step(step), top)
    for part, kernels in found.items():
        print(f"  ctx {context} {part:>14}: {kernels['launches']} {kernels['what']}, {kernels['total_ms']:.2f} ms",
              flush=True)
    release(drafter)
    return found


@torch.no_grad()
def measure(target: Any, drafter: Any, context: int, new_tokens: int) -> dict[str, Any]:
    step = held_step(target, drafter, context, new_tokens)
    rows = step.rows(step.batch_size)
    result: dict[str, Any] = {"context": context, "num_slots": step.num_slots}
    if not torch.cuda.is_available():  # the CPU smoke run: the compile, no graphs to time
        with step.generator.capture:
            result.update(compile_drafter(step))
        release(drafter)
        return result
    result["target_1_token_ms"] = target_1_token_graph_ms(step)
    with grouped_attention(target):
        result["target_1_token_grouped_ms"] = target_1_token_graph_ms(step)
    with step.generator.capture:
        for name, (function, view, compiled) in VARIANTS.items():
            if compiled:
                result.update(compile_drafter(step))
                if result["compile_error"] is not None:
                    continue
                rows = step.rows(step.batch_size)  # the step's views, made again by `bind`
            variant_rows = rows if view else with_gathered_context(step, rows)
            with fast_path_attention(function):
                parts = {
                    "verify_ms": _graph_ms(lambda: step.verify(variant_rows, None)),
                    "propose_ms": _graph_ms(lambda: step.propose(variant_rows)),
                    "step_ms": _graph_ms(lambda: step.step(variant_rows)),
                    "verify_sdpa_ops": sdpa_ops(step, variant_rows),
                }
            parts["step_over_1_token"] = parts["step_ms"] / result["target_1_token_ms"]
            result[name] = parts
            print(f"  ctx {context} {name:>13}: step {parts['step_ms']:6.2f} ms (verify {parts['verify_ms']:6.2f} + "
                  f"propose {parts['propose_ms']:5.2f}), {parts['step_over_1_token']:.2f}x the 1-token step "
                  f"{result['target_1_token_ms']:.2f} ms; sdpa ops {parts['verify_sdpa_ops']}", flush=True)
    release(drafter)
    return result


def tiny_pair() -> tuple[Any, Any]:
    """A small random Qwen3 target and drafter of the same layout (grouped heads, block 16), for the CPU smoke run."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hf_dflash import DFlashConfig, DFlashDraftModel

    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(config).eval()
    drafter = DFlashDraftModel(DFlashConfig.for_target(config, num_hidden_layers=2, block_size=16,
                                                       mask_token_id=511)).eval()
    return target, drafter


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    contexts = [r["context"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(contexts, [r["target_1_token_ms"] for r in rows], "k--", marker="o", label="target 1-token step")
    for name in VARIANTS:
        timed = [r for r in rows if name in r]  # a failed compile leaves its variant out
        left.plot([r["context"] for r in timed], [r[name]["step_ms"] for r in timed], marker="o", label=f"step, {name}")
        right.plot([r["context"] for r in timed], [r[name]["step_over_1_token"] for r in timed], marker="o", label=name)
    right.axhline(1.3, color="gray", linestyle=":", label="goal 1.3x")
    for ax, label in ((left, "ms (CUDA graph replay, median)"), (right, "our step / target 1-token step")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.set_xlabel("tokens of context")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(f"Qwen3-8B shape, random weights, batch 1, bf16: {report['machine']} ({report['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/step_cost", help="writes <out>.json and <out>.png")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--profile", action="store_true", help="kernels of a verify, a propose and a 1-token step")
    parser.add_argument("--profile-context", type=int, default=512, help="the one context --profile profiles")
    parser.add_argument("--profile-top", type=int, default=25, help="kernel names kept per part, by total time")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a smoke run of the call and the profile on a tiny random pair (no timings)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("step_cost.py times CUDA graphs: run it on a machine with a GPU (or --device cpu for a smoke run)")
        return 2
    if args.profile and args.profile_context not in args.contexts:
        print(f"--profile-context {args.profile_context} is not one of --contexts {args.contexts}: add it there")
        return 2
    started = time.time()
    target, drafter = random_pair("qwen3-8b", torch.bfloat16, "cuda") if args.device == "cuda" else tiny_pair()
    print(f"built the target and drafter in {time.time() - started:.0f} s", flush=True)
    results = [measure(target, drafter, context, args.new_tokens) for context in args.contexts]
    if args.profile:  # last: a CUDA profiler can slow the replays timed after it
        profiled = results[args.contexts.index(args.profile_context)]
        profiled["profile"] = profile(target, drafter, args.profile_context, args.new_tokens, args.profile_top)
    report = {**run_environment(args.device), "command": " ".join(["python", *sys.argv]), "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    if args.device == "cpu":
        print(f"smoke run: wrote {out.with_suffix('.json')} in {time.time() - started:.0f} s")
        return 0
    try:
        plot(report, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed (pip install 'hf-dflash[bench]'): no plot, the JSON has every figure")
    print("\n| context | 1-token ms | " + " | ".join(f"{n} step ms (x)" for n in VARIANTS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in VARIANTS) + " |")
    for r in results:
        cells = " | ".join(
            f"{r[n]['step_ms']:.2f} ({r[n]['step_over_1_token']:.2f})" if n in r else "compile failed" for n in VARIANTS
        )
        print(f"| {r['context']} | {r['target_1_token_ms']:.2f} | {cells} |")
    for r in results:
        if "compiled" in r:
            print(f"ctx {r['context']}: compiled propose {r['compiled']['propose_ms']:.2f} ms against "
                  f"{r['fast_path']['propose_ms']:.2f} eager; step {r['compiled']['step_ms']:.2f} against "
                  f"{r['fast_path']['step_ms']:.2f}; compile {r['compile_s']:.1f} s")
    first, last = results[0], results[-1]
    for name in ("fast_path", "compiled"):
        if name in first and name in last:
            flat = last[name]["step_over_1_token"] / first[name]["step_over_1_token"]
            print(f"{name}: ratio at {last['context']} / ratio at {first['context']} = {flat:.3f} (goal <= 1.10)")
    print(f"wrote {out.with_suffix('.json')} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
