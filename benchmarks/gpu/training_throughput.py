"""How fast the two halves of `hf-dflash train` run on one GPU, to size a time-limited run before spending it.

Random weights in SmolLM2-135M-Instruct's shape (speed does not depend on the values):
- regeneration: plain `generate` at several batch sizes, every row forced to its full length (min_new_tokens);
- training: one optimizer step of the DFlash objective (target forward, 3-layer drafter, lm_head, backward, AdamW,
  bf16 autocast) at several batch sizes, with the FlexAttention block mask and with the dense one.

    python benchmarks/gpu/training_throughput.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_dflash.bench import run_environment
from hf_dflash.training.data import RegeneratedData, TrainingSequences, collate_right_padded
from hf_dflash.training.drafter import new_drafter
from hf_dflash.training.objective import DFlashObjective

SMOLLM2_SHAPE = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192,
)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def regeneration_tokens_per_s(target, batch_size: int, prompt_len: int, new_tokens: int) -> float:
    ids = torch.randint(100, 49000, (batch_size, prompt_len), device=target.device)

    def generate(length: int) -> None:
        target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=length,
                        min_new_tokens=length, do_sample=False, pad_token_id=0)

    generate(2)  # warm-up
    synchronize(target.device)
    start = time.perf_counter()
    generate(new_tokens)
    synchronize(target.device)
    return batch_size * new_tokens / (time.perf_counter() - start)


def training_step_ms(target, attention: str, batch_size: int, prompt_len: int, answer_len: int, steps: int) -> dict:
    torch.manual_seed(0)
    drafter = new_drafter(target, num_layers=3, mask_token_id=16, target_layer_ids=[1, 8, 15, 21, 28])
    drafter = drafter.to(target.device).train()
    if attention == "flex":
        drafter.set_attn_implementation("flex_attention")
    objective = DFlashObjective(target, drafter.config, max_anchors=512, attention=attention)
    sequences = [(torch.randint(100, 49000, (prompt_len,)).tolist(), torch.randint(100, 49000, (answer_len,)).tolist())
                 for _ in range(batch_size)]
    batch = collate_right_padded([TrainingSequences(RegeneratedData.from_sequences(sequences), 4096)[i]
                                  for i in range(batch_size)])
    batch = {k: v.to(target.device) for k, v in batch.items()}
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    on_gpu = target.device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps + 2):  # two warm-up steps (FlexAttention compiles on the first)
        synchronize(target.device)
        start = time.perf_counter()
        with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=on_gpu):
            out = objective(drafter, batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(target.device)
        times.append(time.perf_counter() - start)
    ms = 1000 * sorted(times[2:])[len(times[2:]) // 2]
    return {"attention": attention, "batch_size": batch_size, "ms_per_step": round(ms, 1),
            "sequences_per_s": round(1000 * batch_size / ms, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if on_gpu else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--gen-batch-sizes", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--train-batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--attention", nargs="+", default=["flex", "dense"])
    parser.add_argument("--device", default="cuda", help="cpu only checks that the script runs (dense attention)")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per setting (median reported)")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    target = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).to(args.device, dtype).eval()
    report = {**run_environment(args.device), "shape": "SmolLM2-135M, random weights"}
    report.update(regeneration=[], training=[])
    for batch_size in args.gen_batch_sizes:
        rate = regeneration_tokens_per_s(target, batch_size, prompt_len=128, new_tokens=64)
        report["regeneration"].append({"batch_size": batch_size, "prompt_len": 128, "new_tokens": 64,
                                       "tokens_per_s": round(rate)})
        print("regeneration", report["regeneration"][-1], flush=True)
    for attention in args.attention:
        for batch_size in args.train_batch_sizes:
            try:
                row = training_step_ms(target, attention, batch_size, 100, 220, args.steps)
            except torch.OutOfMemoryError:
                row = {"attention": attention, "batch_size": batch_size, "error": "out of memory"}
            torch.cuda.empty_cache()
            report["training"].append(row)
            print("training", row, flush=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
