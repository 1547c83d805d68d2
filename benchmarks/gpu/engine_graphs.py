"""The continuous-batching engine's step, eager and recorded as CUDA graphs, side by side on one GPU.

SmolLM2-135M-Instruct's shape with random weights (bfloat16) and the shipped drafter: n requests of 128 prompt tokens
are admitted, then each mode runs warm-up steps and `--steps` timed ones (the device synchronized around them).
Random weights accept almost no drafts, so every step verifies a whole block for every request, which is what a step
costs. Writes a JSON report to `--out` and its plot beside it (.png). `python3 benchmarks/gpu/engine_graphs.py --out $OUT/engine_graphs.json`
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from hf_dflash.bench.harness import grouped_bars, pyplot, synchronize
from hf_dflash.generate_cli import DEFAULT_DRAFTER
from hf_dflash.modeling import DFlashDraftModel
from hf_dflash.modeling.dflash_engine import DFlashEngine
from hf_dflash.modeling.dflash_row_sampling import SamplingSettings
from hf_dflash.run_record import run_environment

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)


@torch.no_grad()
def step_seconds(engine: DFlashEngine, requests: int, steps: int, warmup: int) -> float:
    greedy = SamplingSettings.from_config(GenerationConfig(do_sample=False))
    generator = torch.Generator().manual_seed(0)
    for i in range(requests):
        prompt = torch.randint(0, SMOLLM2["vocab_size"], (128,), generator=generator).tolist()
        engine.admit(i, prompt, warmup + steps + 16, greedy)
    for _ in range(warmup):
        engine.run_step()
    synchronize(engine.anchor_ids.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.run_step()
    synchronize(engine.anchor_ids.device)
    seconds = (time.perf_counter() - start) / steps
    for i in range(requests):
        engine.retire(i)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a CPU runs both modes eagerly (a check of the script)
    target = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(device, torch.bfloat16).eval()
    drafter = DFlashDraftModel.from_pretrained(DEFAULT_DRAFTER, dtype=torch.bfloat16).to(device).eval()
    command = " ".join(["python3", "benchmarks/gpu/engine_graphs.py", *sys.argv[1:]])
    report = {"command": command, **run_environment(device), "rows": []}
    for requests in args.requests:
        row = {"requests": requests}
        for mode, static in (("eager", False), ("graphs", True)):
            engine = DFlashEngine(target, drafter, max_batch_size=max(args.requests), max_sequence_length=1024,
                                  static_shapes=static)
            # warm-up steps: every shape the timed steps meet is seen twice (run once, then recorded) before timing
            row[f"{mode}_ms_per_step"] = 1000 * step_seconds(engine, requests, args.steps, warmup=8)
            row[f"{mode}_graphs"] = len(engine.graphs)
        row["graphs_speedup"] = row["eager_ms_per_step"] / row["graphs_ms_per_step"]
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)
    plot(report, args.out.removesuffix(".json") + ".png")


def plot(report: dict, path: str) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.5))
    rows = report["rows"]
    grouped_bars(axis, [str(row["requests"]) for row in rows], {
        "eager": [row["eager_ms_per_step"] for row in rows],
        "CUDA graphs": [row["graphs_ms_per_step"] for row in rows],
    }, "ms per step")
    axis.set_xlabel("running requests")
    axis.set_title(f"Engine step, SmolLM2 shape (bf16, random weights), {report['machine']}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
