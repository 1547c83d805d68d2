"""What top-k followed by top-p costs as transformers' two warpers (top-p sorts the whole vocabulary) against the one
step the verify applies (`TopKTopP`: sorts only top-k's survivors), on a sampled batch-16 step's rows (16 x 16 rows of
SmolLM2's 49,152 logits; CPU, float32), with generate's settings for Llama 3.1 and Qwen3 (temperature 0.6 applied
first, untimed). Also counts the rows whose result differs from transformers' pair, on float32 logits and on logits
rounded through bf16 (many exact ties), and from the pair with a stable sort (the order of ties TopKTopP follows).

The logits are random normal with standard deviation 3 (no model is loaded), so only the timings and the tie counts
of that shape mean anything.

    python benchmarks/top_k_top_p_cost.py                 # writes results/top_k_top_p_cost_cpu.json
    python benchmarks/top_k_top_p_cost.py --device cuda   # results/top_k_top_p_cost_cuda.json, also at Qwen3-8B's
                                                          # batch-1 verify rows (16 x 151,936)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from hf_dflash.bench import _graph_ms, run_environment
from hf_dflash.modeling.dflash_processors import TopKTopP

RESULTS = Path(__file__).parent / "results"
TEMPERATURE = 0.6
SETTINGS = {"llama3 (top_k 50, top_p 0.9)": (50, 0.9), "qwen3 (top_k 20, top_p 0.95)": (20, 0.95)}
# (rows, vocab): SmolLM2's batch-16 verify (16 x 16 rows); on a GPU also Qwen3-8B's batch-1 verify (16 rows).
SHAPES = {"cpu": [(256, 49152)], "cuda": [(256, 49152), (16, 151936)]}
REPEATS = {"cpu": 5, "cuda": 50}


def timer_ms(device: str):
    """A function timing calls: on the CPU the fastest of 5 after a warm-up (shared with other jobs, the minimum is
    the stable figure); on a GPU the median of 50, synchronized before each clock read."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def measure(fn) -> float:
        fn()
        sync()
        times = []
        for _ in range(REPEATS[device]):
            start = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - start) * 1e3)
        return round(min(times) if device == "cpu" else statistics.median(times), 3)

    return measure


def stable_pair(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' pair with top-p's sort made stable (ties: lower token index first)."""
    scores = TopKLogitsWarper(top_k)(None, scores.clone())
    ascending, order = torch.sort(scores, stable=True)
    cut = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
    cut[..., -1:] = False
    return scores.masked_fill(cut.scatter(1, order, cut), -float("inf"))


def differing_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a != b).any(-1).sum())


@torch.no_grad()
def measure(top_k: int, top_p: float, rows: int, vocab: int, device: str) -> dict:
    """Rows differing from transformers' pair (its default sort, ties in no set order) and from the stable-sort
    pair, on float32 and bf16-rounded logits; then milliseconds per call on the float32 rows."""
    top_k_warper, top_p_warper, merged = TopKLogitsWarper(top_k), TopPLogitsWarper(top_p), TopKTopP(top_k, top_p, 1)
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(device)
    fastest_ms = timer_ms(device)
    result = {}
    for name, rows in {"float32": logits, "bf16_rounded": logits.bfloat16().float()}.items():
        scores = rows / TEMPERATURE
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
    result["ms"] = {
        "transformers_pair": fastest_ms(lambda: top_p_warper(None, top_k_warper(None, scores.clone()))),
        "merged_step": fastest_ms(lambda: merged(None, scores.clone())),
        "transformers_top_k_alone": fastest_ms(lambda: top_k_warper(None, scores.clone())),
        "transformers_top_p_on_top_k_output": fastest_ms(lambda: top_p_warper(None, top_k_output.clone())),
        "sort_of_top_k_output": fastest_ms(lambda: torch.sort(top_k_output)),  # what the pair's top-p sorts
        "sort_of_raw_scores": fastest_ms(lambda: torch.sort(scores)),  # what a top-p without top-k sorts
        "torch_topk_alone": fastest_ms(lambda: scores.topk(top_k)),
    }
    if device == "cuda":
        # Recorded as CUDA graphs, as the fast path's step records them: launches cost what they cost inside the step.
        pair_call = lambda: top_p_warper(None, top_k_warper(None, scores.clone()))  # noqa: E731
        result["ms"]["transformers_pair_graph"] = round(_graph_ms(pair_call, replays=50), 3)
        result["ms"]["merged_step_graph"] = round(_graph_ms(lambda: merged(None, scores.clone()), replays=50), 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shapes", nargs="+", metavar="ROWSxVOCAB", default=None,
                        help="rows x vocabulary sizes to measure, e.g. 64x49152 (default: the device's SHAPES)")
    parser.add_argument("--out", default=None, help="report file (default: results/top_k_top_p_cost_DEVICE.json)")
    args = parser.parse_args()
    device = args.device
    shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes] if args.shapes else SHAPES[device]
    if device == "cpu":
        torch.set_num_threads(2)
    report = {
        **run_environment(device), "temperature": TEMPERATURE, "logits": "random normal, std 3",
        "statistic": "fastest of 5" if device == "cpu" else "median of 50, synchronized",
        "shapes": {
            f"{rows} x {vocab}": {
                name: measure(top_k, top_p, rows, vocab, device) for name, (top_k, top_p) in SETTINGS.items()
            }
            for rows, vocab in shapes
        },
    }
    if device == "cpu":
        report["threads"] = 2
    result = Path(args.out) if args.out else RESULTS / f"top_k_top_p_cost_{device}.json"
    result.parent.mkdir(exist_ok=True)
    result.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["shapes"], indent=2))


if __name__ == "__main__":
    main()
