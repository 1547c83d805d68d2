"""What top-k followed by top-p costs as transformers' two warpers against the one merged step the verify can apply.

transformers' TopK -> TopP pair sorts the whole vocabulary row in top-p; `TopKTopP` (modeling/dflash_processors.py)
applies the same pair as one step that sorts only top-k's survivors. Per `--shapes` (rows x vocabulary: by default
SmolLM2's batch-16 verify, 16 x 16 rows of 49,152; on a GPU also Qwen3-8B's batch-1 verify, 16 x 151,936), with
generate's settings for Llama 3.1 and Qwen3 (temperature 0.6 applied first, untimed): milliseconds per call of the
pair, the merged step and their pieces (median of `--repeats` synchronized calls; on a GPU also both recorded as CUDA
graphs, as inside the fast path's step). Also counts the rows whose result differs from transformers' pair, on
float32 logits and on logits rounded through bf16 (many exact ties), and from the pair with a stable sort (the order
of ties `TopKTopP` follows). The logits are random normal with standard deviation 3 (no model is loaded), so only
the timings and the tie counts of that shape mean anything.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from . import harness

TEMPERATURE = 0.6
SETTINGS = {"llama3 (top_k 50, top_p 0.9)": (50, 0.9), "qwen3 (top_k 20, top_p 0.95)": (20, 0.95)}
SHAPES = {"cpu": ["256x49152"], "cuda": ["256x49152", "16x151936"]}


def stable_pair(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' pair with top-p's sort made stable (ties: lower token index first)."""
    from transformers.generation.logits_process import TopKLogitsWarper

    scores = TopKLogitsWarper(top_k)(None, scores.clone())
    ascending, order = torch.sort(scores, stable=True)
    cut = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
    cut[..., -1:] = False
    return scores.masked_fill(cut.scatter(1, order, cut), -float("inf"))


def differing_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a != b).any(-1).sum())


@torch.no_grad()
def measure(top_k: int, top_p: float, rows: int, vocab: int, device: str, repeats: int) -> dict:
    """Rows differing from transformers' pair (its default sort, ties in no set order) and from the stable-sort
    pair, on float32 and bf16-rounded logits; then milliseconds per call on the float32 rows."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from ..modeling.dflash_processors import TopKTopP

    top_k_warper, top_p_warper, merged = TopKLogitsWarper(top_k), TopPLogitsWarper(top_p), TopKTopP(top_k, top_p, 1)
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(device)
    result = {}
    for name, values in {"float32": logits, "bf16_rounded": logits.bfloat16().float()}.items():
        scores = values / TEMPERATURE
        theirs = top_p_warper(None, top_k_warper(None, scores.clone()))
        ours = merged(None, scores.clone())
        result[name] = {
            "rows_differing_from_transformers": differing_rows(ours, theirs),
            "rows_differing_from_stable_sort_pair": differing_rows(ours, stable_pair(scores, top_k, top_p)),
            "kept_tokens_mean": round(float((ours > -float("inf")).sum(-1).float().mean()), 2),
            "rows_with_ties_at_kth_value": int(((scores == scores.topk(top_k).values[:, -1:]).sum(-1) > 1).sum()),
        }
    scores = logits / TEMPERATURE
    top_k_output = top_k_warper(None, scores.clone())

    def pair() -> torch.Tensor:
        return top_p_warper(None, top_k_warper(None, scores.clone()))

    def merged_step() -> torch.Tensor:
        return merged(None, scores.clone())

    calls = {
        "transformers_pair": pair,
        "merged_step": merged_step,
        "transformers_top_k_alone": lambda: top_k_warper(None, scores.clone()),
        "transformers_top_p_on_top_k_output": lambda: top_p_warper(None, top_k_output.clone()),
        "sort_of_top_k_output": lambda: torch.sort(top_k_output),  # what the pair's top-p sorts
        "sort_of_raw_scores": lambda: torch.sort(scores),  # what a top-p without top-k sorts
        "torch_topk_alone": lambda: scores.topk(top_k),
    }
    result["ms"] = {name: harness.time_call(call, repeats=repeats).median_ms for name, call in calls.items()}
    if device == "cuda":  # as the fast path's step records them: a launch costs there what it costs in a graph
        result["ms"]["transformers_pair_graph"] = harness.time_graph(pair, replays=repeats).median_ms
        result["ms"]["merged_step_graph"] = harness.time_graph(merged_step, replays=repeats).median_ms
    return result


def parse_shape(text: str) -> tuple[int, int]:
    rows, vocab = (int(part) for part in text.lower().split("x"))
    return rows, vocab


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shapes", nargs="+", metavar="ROWSxVOCAB", default=None,
                        help="rows x vocabulary sizes to measure, e.g. 64x49152 (default: 256x49152 on a CPU, and "
                        "16x151936 too on a GPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls each (default: 5 on a CPU, 50 on a GPU)")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import BadArgument, at_least, check_device

    check_device("--device", args.device)
    at_least("--repeats", args.repeats, 1)
    for text in args.shapes or []:
        try:
            rows, vocab = parse_shape(text)
        except ValueError:
            raise BadArgument(f"--shapes {text}: write rows x vocabulary, e.g. 64x49152") from None
        if rows < 1 or vocab < max(top_k for top_k, _ in SETTINGS.values()):
            raise BadArgument(f"--shapes {text}: at least 1 row and a vocabulary of at least 50 (top_k)")


def run(args: argparse.Namespace) -> int:
    repeats = args.repeats or (50 if args.device == "cuda" else 5)
    report = harness.header(args, args.device)
    shapes = {}
    for text in args.shapes or SHAPES[args.device]:
        rows, vocab = parse_shape(text)
        shapes[f"{rows} x {vocab}"] = {name: measure(top_k, top_p, rows, vocab, args.device, repeats)
                                       for name, (top_k, top_p) in SETTINGS.items()}
        for name, result in shapes[f"{rows} x {vocab}"].items():
            print(f"{rows} x {vocab}, {name}: pair {result['ms']['transformers_pair']:.2f} ms, merged "
                  f"{result['ms']['merged_step']:.2f} ms", flush=True)
    report.update(temperature=TEMPERATURE, logits="random normal, std 3",
                  statistic=f"median of {repeats} synchronized calls", shapes=shapes)
    harness.write_report(args.out, report, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    """Per shape and setting, the pair against the merged step (and their graphs, where measured)."""
    plt = harness.pyplot()
    groups = [f"{shape}\n{setting.split(' ')[0]}" for shape, settings in report["shapes"].items()
              for setting in settings]
    cells = [result["ms"] for settings in report["shapes"].values() for result in settings.values()]
    names = [n for n in ("transformers_pair", "merged_step", "transformers_pair_graph", "merged_step_graph")
             if all(n in cell for cell in cells)]
    fig, axis = plt.subplots(figsize=(max(6, 2 * len(groups)), 3.8))
    harness.grouped_bars(axis, groups, {name: [cell[name] for cell in cells] for name in names}, "ms per call (median)")
    axis.set_title(f"top-k -> top-p, {report['machine']} ({report['date'][:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
