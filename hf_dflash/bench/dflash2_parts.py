"""What a DFlash2 drafter's parts cost beside a DFlash drafter's of the same shape: the layers, DFlash2's
convolutions, the lm_head, and turning the rows into drafts (DFlash's per-row argmax, DFlash2's candidate selector).

Both drafters are built at `--shape` (SmolLM2-135M-Instruct's shipped drafter by default: 3 layers of width 576,
vocabulary 49,152) with random weights, the DFlash2 one with the published DFlash2 fields and its convolutions and
selector randomized (a fresh one's identity convolutions cost the same). Each drafts `--batch` blocks of
`--block-size` rows after `--context` context positions, as a propose step does; every part is timed alone (median
of `--repeats` calls), the two drafters alternated for `--rounds` rounds in one process:
- `layers`: the drafter forward over context and block (DFlash2's includes its convolutions);
- `convolutions` (DFlash2 only): every layer's convolution before and after attention and the MLP, on the block rows;
- `lm_head`: the block rows' logits;
- `propose`: the drafts from the rows and their logits (greedy).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from . import harness

# name -> (hidden, heads, key/value heads, intermediate, layers, vocabulary, target layers)
SHAPES = {
    "smollm2": (576, 9, 3, 1536, 3, 49152, 30),
    "qwen3-8b": (4096, 32, 8, 12288, 5, 151936, 36),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=list(SHAPES), default="smollm2",
                        help="the drafter's shape: smollm2 (the shipped drafter's, default) or qwen3-8b (z-lab's)")
    parser.add_argument("--batch", type=int, default=1, help="sequences drafting at once")
    parser.add_argument("--block-size", type=int, default=16, help="block rows, the anchor included")
    parser.add_argument("--context", type=int, default=256, help="context positions before the block")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the two drafters, alternated")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per part and round")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import at_least

    for option in ("batch", "context", "rounds", "repeats"):
        at_least("--" + option, getattr(args, option), 1)
    at_least("--block-size", args.block_size, 2, " (the anchor and one draft)")


def drafters(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    """The DFlash and DFlash2 drafters at `args.shape`, sharing their DFlash weights."""
    from ..modeling import DFlashConfig, DFlashDraftModel
    from ..modeling.dflash_layouts import DFLASH2_DEFAULTS
    from ..modeling.modeling_dflash2 import DFlash2DraftModel

    hidden, heads, kv_heads, intermediate, layers, vocab, target_layers = SHAPES[args.shape]
    fields = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                  vocab_size=vocab, num_target_layers=target_layers, block_size=args.block_size,
                  mask_token_id=vocab - 1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    dflash = DFlashDraftModel(DFlashConfig(**fields)).eval()
    dflash2 = DFlash2DraftModel(DFlashConfig(**fields, **DFLASH2_DEFAULTS)).eval()
    dflash2.load_state_dict(dflash.state_dict(), strict=False)
    with torch.no_grad():  # a trained drafter's convolutions and selector are not the identity and silent
        for name, param in dflash2.named_parameters():
            if "_conv." in name or "candidate_selector." in name:
                param.normal_(0, 0.02)
    return {"DFlash": dflash, "DFlash2": dflash2}


def part_timers(drafter: torch.nn.Module, args: argparse.Namespace) -> dict[str, object]:
    """A function per part of `drafter`'s propose step, on fixed random inputs."""
    from ..modeling.dflash_acceptance import DecodingRule

    config = drafter.config
    generator = torch.Generator().manual_seed(1)
    block, hidden_size = args.block_size, config.hidden_size
    noise = torch.randn(args.batch, block, hidden_size, generator=generator)
    context = torch.randn(args.batch, args.context, config.num_context_features, generator=generator)
    positions = torch.arange(args.context + block).expand(args.batch, -1)
    lm_head = torch.randn(config.vocab_size, hidden_size, generator=generator) / hidden_size**0.5
    with torch.no_grad():
        rows = drafter(noise_embeds=noise, context_hidden_states=context, position_ids=positions).last_hidden_state
    rows = rows[:, 1:]
    logits = rows @ lm_head.T
    anchors = torch.zeros(args.batch, 1, dtype=torch.long)
    greedy = DecodingRule(do_sample=False, rejection=False)
    timers = {
        "layers": lambda: drafter(noise_embeds=noise, context_hidden_states=context, position_ids=positions),
        "lm_head": lambda: rows @ lm_head.T,
        "propose": lambda: drafter.propose(rows, anchors, lambda _: logits, greedy),
    }
    convolutions = [conv for layer in drafter.layers for conv in (getattr(layer, "attention_conv", None),
                                                                   getattr(layer, "mlp_conv", None)) if conv]
    if convolutions:
        def convolve() -> None:
            for conv in convolutions:
                convolved, after = conv.prepare(noise)
                conv.finish(convolved, after)

        timers["convolutions"] = convolve
    return timers


def run(args: argparse.Namespace) -> int:
    report = harness.header(args, "cpu")
    timers = {name: part_timers(drafter, args) for name, drafter in drafters(args).items()}
    parts: dict[str, dict[str, list[float]]] = {}
    with torch.no_grad():
        for name, parts_of in timers.items():
            for part, fn in parts_of.items():
                parts.setdefault(part, {})[name] = []
        for _ in range(args.rounds):
            for name, parts_of in timers.items():
                for part, fn in parts_of.items():
                    parts[part][name].append(harness.time_call(fn, repeats=args.repeats, warmup=1).median_ms)
    for part, by_drafter in parts.items():
        print(f"{part:>13}: " + ", ".join(f"{name} {min(values):.2f} ms" for name, values in by_drafter.items()),
              flush=True)
    report.update(shape=args.shape, batch=args.batch, block_size=args.block_size, context=args.context,
                  statistic=f"median of {args.repeats} calls per round, {args.rounds} rounds alternated",
                  parts_ms=parts)
    harness.write_report(args.out, report, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    parts = list(report["parts_ms"])
    fig, axis = plt.subplots(figsize=(7, 3.6))
    harness.grouped_bars(axis, parts, {
        name: [min(report["parts_ms"][part].get(name, [0.0])) for part in parts] for name in ("DFlash", "DFlash2")
    }, "ms per call (best round's median)")
    axis.set_title(f"a propose step's parts, {report['shape']} shape, batch {report['batch']}, "
                   f"{report['machine']} ({report['date'][:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
