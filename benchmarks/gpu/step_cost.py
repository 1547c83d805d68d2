"""One fast-path step at Qwen3-8B shape against the target's own 1-token step, with each attention the fast path could
use, side by side in one process (GPU; random weights, batch 1, bf16; about 2 minutes on an H200).

Per context (512, 2048, 8192 tokens) one greedy fast-path call of 32 new tokens leaves its step held with the
sequence finished, so a replay repeats the same work. Then, as CUDA graphs (median of 30 replays):
- `target_1_token_ms`: the target's own 1-token decode step on a static cache of the same size, through transformers'
  sdpa (`hf-dflash bench`'s target_1_token_graph_ms); `target_1_token_grouped_ms`: the same under the grouped
  attention, for reference.
- verify (the target's forward over B rows and acceptance), propose (context keys/values, drafter, lm_head) and the
  whole step, under each variant of the fast path's forwards:
  * `before`: transformers' sdpa, which copies every key/value head G times per layer when a mask is given, and the
    drafter's context gathered slot by slot through the block tables (the fast path until issue 15 item 4);
  * `expanded_view`: transformers' sdpa with the drafter's contiguous view (the view alone);
  * `enable_gqa`: torch's sdpa with the mask and `enable_gqa=True` (the grouping left to whichever kernel torch picks);
  * `grouped`: query groups folded into rows (modeling/dflash_attention.py) and the contiguous view (the fast path now).
One profiled verify per variant records the sdpa ops it ran, so the backend torch picked is on record.
Writes <out>.json and <out>.png and prints a table with step / 1-token ratios.

    python benchmarks/gpu/step_cost.py --out "$OUT/step_cost"
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

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

sys.path.insert(0, ".")
from hf_dflash.bench import _graph_ms, random_pair, run_environment, target_graph_step_ms  # noqa: E402
from hf_dflash.modeling.dflash_attention import GROUPED_SDPA, grouped_attention, grouped_sdpa_attention  # noqa: E402
from hf_dflash.modeling.dflash_decoding import _cache_argument  # noqa: E402
from hf_dflash.modeling.dflash_paged_cache import PagedView  # noqa: E402
from hf_dflash.modeling.dflash_static_cache import page_slots  # noqa: E402


def sdpa_enable_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """torch's sdpa with the mask and grouped heads in one call: query (b, h, q, d), key/value (b, g, L, d)."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


# variant -> (the function the fast path's forwards call, whether the drafter reads through its contiguous view)
VARIANTS = {
    "before": (sdpa_attention_forward, False),
    "expanded_view": (sdpa_attention_forward, True),
    "enable_gqa": (sdpa_enable_gqa, True),
    "grouped": (grouped_sdpa_attention, True),
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


@torch.no_grad()
def measure(target: Any, drafter: Any, context: int, new_tokens: int) -> dict[str, Any]:
    # random ids below the mask token's (random weights: the text does not matter, only its length)
    prompt = torch.randint(0, drafter.config.mask_token_id, (1, context), generator=torch.Generator().manual_seed(0))
    target.generate(prompt.to(target.device), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                    assistant_model=drafter, dflash_fast_path=True)
    step = drafter._dflash_static_step[1]
    rows = step.rows(step.batch_size)  # the sequence is finished: replays repeat the same work
    cache_argument = _cache_argument(target)
    result: dict[str, Any] = {"context": context, "num_slots": step.num_slots}
    result["target_1_token_ms"] = target_graph_step_ms(target, 1, step.num_slots, cache_argument)
    with grouped_attention(target):
        result["target_1_token_grouped_ms"] = target_graph_step_ms(target, 1, step.num_slots, cache_argument)
    with step.generator.capture:
        for name, (function, view) in VARIANTS.items():
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
    drafter._dflash_static_step = None
    torch.cuda.empty_cache()
    return result


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    contexts = [r["context"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(contexts, [r["target_1_token_ms"] for r in rows], "k--", marker="o", label="target 1-token step")
    for name in VARIANTS:
        left.plot(contexts, [r[name]["step_ms"] for r in rows], marker="o", label=f"step, {name}")
        right.plot(contexts, [r[name]["step_over_1_token"] for r in rows], marker="o", label=name)
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
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("step_cost.py times CUDA graphs: run it on a machine with a GPU")
        return 2
    started = time.time()
    target, drafter = random_pair("qwen3-8b", torch.bfloat16, "cuda")
    print(f"built the Qwen3-8B-shape target and drafter in {time.time() - started:.0f} s", flush=True)
    results = []
    for context in args.contexts:
        results.append(measure(target, drafter, context, args.new_tokens))
    report = {**run_environment("cuda"), "command": " ".join(["python", *sys.argv]), "results": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    try:
        plot(report, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed (pip install 'hf-dflash[bench]'): no plot, the JSON has every figure")
    print("\n| context | 1-token ms | " + " | ".join(f"{n} step ms (x)" for n in VARIANTS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in VARIANTS) + " |")
    for r in results:
        cells = " | ".join(f"{r[n]['step_ms']:.2f} ({r[n]['step_over_1_token']:.2f})" for n in VARIANTS)
        print(f"| {r['context']} | {r['target_1_token_ms']:.2f} | {cells} |")
    first, last = results[0], results[-1]
    flat = last["grouped"]["step_over_1_token"] / first["grouped"]["step_over_1_token"]
    print(f"grouped: ratio at {last['context']} / ratio at {first['context']} = {flat:.3f} (goal <= 1.10); "
          f"wrote {out.with_suffix('.json')} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
