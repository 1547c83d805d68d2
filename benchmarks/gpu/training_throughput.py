"""Training throughput of `hf-dflash train` on one GPU: anchor blocks per second and a model-FLOPs utilization.

Random weights in SmolLM2-135M-Instruct's shape (speed does not depend on the values), the shipped drafter's
shape (3 layers, block 16, 5 target layers), and a pool of sequences whose lengths spread as regenerated chat data
does (prompts 20-300 tokens, answers 30-256). Each setting trains on batches drawn from that pool (random order, or
length-grouped), warms up (FlexAttention compiles for new shapes), then times steps: target forward, drafter,
loss, backward, AdamW, bf16 autocast.

- "plain" loss: the lm_head over every block row, then cross-entropy over the full (rows, 49152) logits (the
  shipped drafter's run);
- "sparse" loss: the lm_head over labelled rows only, in chunks, the gradient formed chunk by chunk
  (`sparse_block_loss`); "compiled": the same with its element-wise work through torch.compile; optionally with
  distillation against the target's top-k.

Anchor blocks: blocks with at least one label (`LossOutput.num_blocks`). Model FLOPs count the useful work only:
2 x target parameters x real tokens, 6 x drafter parameters x labelled blocks x block size, and 4 x hidden x vocab
x labelled rows (the lm_head forward and its input gradient); MFU divides by the H200's dense bf16 peak (989
TFLOP/s by the datasheet; a large matmul measured about 790 on these machines).

    python benchmarks/gpu/training_throughput.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_dflash.bench import run_environment
from hf_dflash.training.data import LengthGroupedSampler, RegeneratedData, TrainingSequences, collate_right_padded
from hf_dflash.training.drafter import new_drafter
from hf_dflash.training.objective import (
    DFlashObjective,
    block_loss,
    build_blocks,
    dense_block_mask,
    flex_block_mask,
    sample_anchors,
    sparse_block_loss,
)

SMOLLM2_SHAPE = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192,
)
PEAK_BF16_FLOPS = 989e12
# (name, loss, batch size, length-grouped, distill top-k): the shipped run first. "compiled": the sparse loss's
# element-wise work through torch.compile.
SETTINGS = [
    ("shipped: plain loss, batch 16", "plain", 16, False, 0),
    ("sparse loss, batch 16", "sparse", 16, False, 0),
    ("sparse compiled, batch 16", "compiled", 16, False, 0),
    ("sparse compiled, batch 64", "compiled", 64, False, 0),
    ("sparse compiled, batch 64, grouped", "compiled", 64, True, 0),
    ("sparse compiled, batch 128, grouped", "compiled", 128, True, 0),
    ("compiled + distill top-32, b 64, grouped", "compiled", 64, True, 32),
]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_loss(objective: DFlashObjective, drafter, batch, generator):
    """The objective as the shipped drafter was trained: lm_head over all rows, full logits, then cross-entropy."""
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    seq_len, block_size = input_ids.shape[1], objective.config.block_size
    context, _ = objective.context(input_ids, batch["attention_mask"])
    anchors, keep = sample_anchors(loss_mask, objective.max_anchors, generator)
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, block_size, objective.config.mask_token_id)
    make_mask = flex_block_mask if objective.attention == "flex" else dense_block_mask
    with torch.no_grad():
        noise = objective.target.get_input_embeddings()(blocks.block_ids)
    hidden = drafter(noise_embeds=noise, context_hidden_states=context, position_ids=blocks.position_ids,
                     attention_mask={"full_attention": make_mask(anchors, seq_len, block_size)}).last_hidden_state
    lm_head = objective.target.get_output_embeddings()
    logits = lm_head(hidden.to(lm_head.weight.dtype))
    return block_loss(logits.view(*anchors.shape, block_size, -1), blocks.labels, objective.weights)


def compiled_loss_check(device: str) -> dict:
    """The compiled loss against the eager one, on random rows at the real vocabulary (relative errors)."""
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(2, 64 * 16, 576, generator=generator).to(device, torch.bfloat16).requires_grad_()
    weight = (torch.randn(49152, 576, generator=generator) * 0.05).to(device, torch.bfloat16)
    labels = torch.randint(0, 49152, (2, 64, 16), generator=generator).to(device)
    labels[:, :, 0] = -100
    weights = torch.linspace(1, 0.1, 16)
    out = {}
    for compiled in (False, True):
        loss = sparse_block_loss(rows, weight, labels, weights, chunk_rows=1000, compiled=compiled)
        (grad,) = torch.autograd.grad(loss.loss, rows)
        out[compiled] = (loss.loss.float(), grad.float())
    return {"loss_rel_error": float((out[True][0] - out[False][0]).abs() / out[False][0].abs()),
            "grad_rel_error": float((out[True][1] - out[False][1]).norm() / out[False][1].norm())}


def sequence_pool(count: int, seed: int = 0) -> TrainingSequences:
    generator = torch.Generator().manual_seed(seed)
    sequences = []
    for _ in range(count):
        prompt_len = int(torch.randint(20, 301, (1,), generator=generator))
        answer_len = int(torch.randint(30, 257, (1,), generator=generator))
        sequences.append((torch.randint(100, 49000, (prompt_len,), generator=generator).tolist(),
                          torch.randint(100, 49000, (answer_len,), generator=generator).tolist()))
    return TrainingSequences(RegeneratedData.from_sequences(sequences), 4096)


def measure(target, pool: TrainingSequences, loss: str, batch_size: int, grouped: bool, topk: int, attention: str,
            steps: int, warmup: int) -> dict:
    device = target.device
    torch.manual_seed(0)
    drafter = new_drafter(target, num_layers=3, mask_token_id=16, target_layer_ids=[1, 8, 15, 21, 28])
    drafter = drafter.to(device).train()
    if attention == "flex":
        drafter.set_attn_implementation("flex_attention")
    objective = DFlashObjective(target, drafter.config, max_anchors=512, attention=attention, distill_topk=topk,
                                compile_loss=loss == "compiled")
    if grouped:
        order = list(LengthGroupedSampler(pool.answer_lengths(), batch_size, seed=0))
    else:
        order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(0)).tolist()
    batches = [order[i : i + batch_size] for i in range(0, (warmup + steps) * batch_size, batch_size)]
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    generator = torch.Generator(device=device).manual_seed(0)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    drafter_params = sum(p.numel() for p in drafter.parameters())
    target_params = sum(p.numel() for n, p in target.named_parameters() if "embed" not in n)
    hidden, vocab = target.config.hidden_size, target.config.vocab_size
    seconds = blocks = flops = padded = real = 0.0
    for i, indices in enumerate(batches):
        batch = collate_right_padded([pool[j] for j in indices])
        batch = {k: v.to(device) for k, v in batch.items()}
        synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
            out = (plain_loss if loss == "plain" else objective.__class__.__call__)(objective, drafter, batch,
                                                                                   generator)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if i < warmup:
            continue
        seconds += time.perf_counter() - start
        tokens = int(batch["attention_mask"].sum())
        rows = out.num_blocks * (drafter.config.block_size - 1)  # about: rows past a sequence's end have no label
        blocks += out.num_blocks
        real, padded = real + tokens, padded + batch["attention_mask"].numel()
        flops += 2 * target_params * tokens + 6 * drafter_params * out.num_blocks * drafter.config.block_size
        flops += 4 * hidden * vocab * rows + (2 * hidden * vocab * tokens if topk else 0)
    return {"loss": loss, "batch_size": batch_size, "grouped": grouped, "distill_topk": topk, "attention": attention,
            "steps": steps, "ms_per_step": round(1000 * seconds / steps, 1),
            "anchor_blocks_per_s": round(blocks / seconds), "token_padding_share": round(1 - real / padded, 3),
            "model_tflops_per_s": round(flops / seconds / 1e12, 1),
            "mfu": round(flops / seconds / PEAK_BF16_FLOPS, 4),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if on_gpu else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", help="cpu only checks that the script runs (dense attention)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per setting")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles)")
    parser.add_argument("--settings", type=int, nargs="+", help="indices into SETTINGS (default: all)")
    parser.add_argument("--pool", type=int, default=4096, help="sequences in the pool batches are drawn from")
    parser.add_argument("--scale", type=float, default=1.0, help="batch sizes times this (CPU smoke runs: 0.125)")
    args = parser.parse_args()
    torch.manual_seed(0)
    on_gpu = args.device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    target = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).to(args.device, dtype).eval()
    pool = sequence_pool(args.pool)
    report = {**run_environment(args.device), "shape": "SmolLM2-135M target, 3-layer drafter, random weights",
              "training": []}
    try:
        report["compiled_loss_check"] = compiled_loss_check(args.device)
    except Exception as error:
        report["compiled_loss_check"] = {"error": f"{type(error).__name__}: {error}"[:300]}
    print("compiled loss against eager:", report["compiled_loss_check"], flush=True)
    chosen = [SETTINGS[i] for i in (args.settings if args.settings is not None else range(len(SETTINGS)))]
    for name, loss, batch_size, grouped, topk in chosen:
        batch_size = max(1, round(batch_size * args.scale))
        try:
            row = measure(target, pool, loss, batch_size, grouped, topk, "flex" if on_gpu else "dense", args.steps,
                          args.warmup)
        except torch.OutOfMemoryError:
            row = {"loss": loss, "batch_size": batch_size, "error": "out of memory"}
        except Exception as error:  # a setting that fails (e.g. a compile error) is reported, the others still run
            row = {"loss": loss, "batch_size": batch_size, "error": f"{type(error).__name__}: {error}"[:300]}
        if on_gpu:
            torch.cuda.empty_cache()
        row = {"setting": name, **row}
        report["training"].append(row)
        print("training", json.dumps(row), flush=True)
    base = report["training"][0].get("anchor_blocks_per_s")
    print(f"\n{'setting':45s} {'blocks/s':>9s} {'x base':>7s} {'ms/step':>8s} {'MFU':>6s} {'pad':>5s} {'GiB':>6s}")
    for row in report["training"]:
        if "error" in row:
            print(f"{row['setting']:45s} {row['error']}")
            continue
        speedup = row["anchor_blocks_per_s"] / base if base else float("nan")
        print(f"{row['setting']:45s} {row['anchor_blocks_per_s']:9d} {speedup:7.2f} {row['ms_per_step']:8.1f} "
              f"{row['mfu']:6.3f} {row['token_padding_share']:5.2f} {row['peak_gib'] or 0:6.1f}")
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
