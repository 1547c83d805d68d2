"""Training throughput of `hf-dflash train`: anchor blocks per second and a model-FLOPs utilization (one GPU).

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
TFLOP/s by its datasheet).

A CPU run (dense attention instead of FlexAttention; `--shape tiny` and `--scale` to shrink the model and the
batches) only shows that it runs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import harness

@dataclass(frozen=True)
class TrainingShape:
    """A target's shape (random weights) and the drafter trained for it."""

    target: dict[str, Any]  # LlamaConfig fields
    drafter_layers: int
    target_layer_ids: list[int]  # the target layers the drafter reads


SHAPES = {
    # SmolLM2-135M-Instruct and the shipped drafter's shape
    "smollm2": TrainingShape(
        target=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
                    max_position_embeddings=8192),
        drafter_layers=3, target_layer_ids=[1, 8, 15, 21, 28],
    ),
    # the same layout at toy widths: shows that the scenario runs, in seconds on a CPU
    "tiny": TrainingShape(
        target=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True, max_position_embeddings=2048),
        drafter_layers=1, target_layer_ids=[1, 3, 4],
    ),
}
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


def plain_loss(objective: Any, drafter: Any, batch: dict, generator: torch.Generator) -> Any:
    """The objective as the shipped drafter was trained: lm_head over all rows, full logits, then cross-entropy."""
    from ..training.objective import block_loss, build_blocks, dense_block_mask, flex_block_mask, sample_anchors

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
    from ..training.objective import sparse_block_loss

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


def sequence_pool(count: int, vocab_size: int, seed: int = 0) -> Any:
    """`count` random sequences whose prompt (20-300 tokens) and answer (30-256) lengths spread as chat data's do."""
    from ..training.data import RegeneratedData, TrainingSequences

    generator = torch.Generator().manual_seed(seed)
    sequences = []
    for _ in range(count):
        prompt_len = int(torch.randint(20, 301, (1,), generator=generator))
        answer_len = int(torch.randint(30, 257, (1,), generator=generator))
        high = vocab_size - 100  # ids clear of the special tokens at either end
        sequences.append((torch.randint(100, high, (prompt_len,), generator=generator).tolist(),
                          torch.randint(100, high, (answer_len,), generator=generator).tolist()))
    return TrainingSequences(RegeneratedData.from_sequences(sequences), 4096)


def measure(target: Any, shape: TrainingShape, pool: Any, loss: str, batch_size: int, grouped: bool, topk: int,
            attention: str, steps: int, warmup: int) -> dict:
    """One setting: `warmup` untimed steps, then `steps` timed ones (target forward, drafter, loss, backward, AdamW),
    each synchronized."""
    from ..training.data import LengthGroupedSampler, collate_right_padded
    from ..training.drafter import new_drafter
    from ..training.objective import DFlashObjective

    device = target.device
    torch.manual_seed(0)
    drafter = new_drafter(target, num_layers=shape.drafter_layers, mask_token_id=16,
                          target_layer_ids=shape.target_layer_ids)
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

        def train_step() -> Any:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
                out = plain_loss(objective, drafter, batch, generator) if loss == "plain" else objective(
                    drafter, batch, generator)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return out

        out, took = harness.timed(train_step)
        if i < warmup:
            continue
        seconds += took
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=list(SHAPES), default="smollm2",
                        help="smollm2 (default): SmolLM2-135M's and the shipped drafter's; tiny: the same layout at "
                        "toy widths, to show that the scenario runs")
    parser.add_argument("--device", default=None, help="default: cuda when available; cpu only shows that it runs")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per setting")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles)")
    parser.add_argument("--settings", type=int, nargs="+", default=None,
                        help="indices into the settings (default: all): " + "; ".join(
                            f"{i} {name}" for i, (name, *_) in enumerate(SETTINGS)))
    parser.add_argument("--pool", type=int, default=4096, help="sequences in the pool batches are drawn from")
    parser.add_argument("--scale", type=float, default=1.0, help="batch sizes times this (CPU smoke runs: 0.125)")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import BadArgument, above, at_least, check_device

    at_least("--steps", args.steps, 1)
    at_least("--warmup", args.warmup, 0)
    at_least("--pool", args.pool, 1)
    above("--scale", args.scale, 0)
    check_device("--device", args.device)
    for index in args.settings or []:
        if not 0 <= index < len(SETTINGS):
            raise BadArgument(f"--settings {index}: pass indices 0 .. {len(SETTINGS) - 1} (see --help)")


def run(args: argparse.Namespace) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    device = args.device or harness.default_device()
    report = harness.header(args, device)
    torch.manual_seed(0)
    on_gpu = device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shape = SHAPES[args.shape]
    target = LlamaForCausalLM(LlamaConfig(**shape.target)).to(device, dtype).eval()
    pool = sequence_pool(args.pool, shape.target["vocab_size"])
    report.update(shape=f"{args.shape}: target {shape.target}, {shape.drafter_layers}-layer drafter, random weights",
                  training=[])
    chosen = [SETTINGS[i] for i in (args.settings if args.settings is not None else range(len(SETTINGS)))]
    if any(loss == "compiled" for _, loss, *_ in chosen):  # checked before it is timed
        try:
            report["compiled_loss_check"] = compiled_loss_check(device)
        except Exception as error:  # recorded, not hidden; each compiled setting then fails on its own below
            report["compiled_loss_check"] = {"error": f"{type(error).__name__}: {error}"[:300]}
        print("compiled loss against eager:", report["compiled_loss_check"], flush=True)
    for name, loss, batch_size, grouped, topk in chosen:
        batch_size = max(1, round(batch_size * args.scale))
        try:
            row = measure(target, shape, pool, loss, batch_size, grouped, topk, "flex" if on_gpu else "dense",
                          args.steps, args.warmup)
        except torch.OutOfMemoryError:
            row = {"loss": loss, "batch_size": batch_size, "error": "out of memory"}
        except Exception as error:  # a setting that fails (a compile error, say) is recorded; the others still run
            row = {"loss": loss, "batch_size": batch_size, "error": f"{type(error).__name__}: {error}"[:300]}
        if on_gpu:
            torch.cuda.empty_cache()
        report["training"].append({"setting": name, **row})
        print("training", report["training"][-1], flush=True)
    harness.write_report(args.out, report, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    """Anchor blocks per second and MFU per setting."""
    plt = harness.pyplot()
    rows = [r for r in report["training"] if "error" not in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    names = [r["setting"] for r in rows]
    left.barh(names, [r["anchor_blocks_per_s"] for r in rows])
    left.set_xlabel("anchor blocks / s")
    right.barh(names, [r["mfu"] for r in rows])
    right.set_xlabel("model-FLOPs utilization")
    right.set_yticks([])
    fig.suptitle(f"{report['shape'].split(':')[0]} shape, {report['machine']} ({report['date'][:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
