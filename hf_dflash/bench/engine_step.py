"""The continuous-batching engine's step, eager and at static shapes (recorded as CUDA graphs on a GPU), side by side.

For each `--requests` count, two engines (modeling/dflash_engine.py) over the same target and drafter admit that
many requests of `--prompt-tokens` random prompt tokens and run `--warmup` steps, then `--steps` timed ones (the
device synchronized around them):
- `eager`: every step at the running batch's own shape, op by op;
- `static`: every step padded to its bucketed shape (rows and span rounded up to powers of two), which a GPU runs
  once, then records as a CUDA graph and replays; on a CPU the padded step runs eagerly, which shows what the padding
  costs there;
- `policy` (with `--modes`): `static` with the engine's verify policy choosing each step's width, the step in the
  parts a GPU records (the drafter's, then the verify at the chosen width, or a plain step).
`--shape smollm2` (the default) is SmolLM2-135M-Instruct's shape with random weights and the shipped drafter;
`qwen3-8b` Qwen3-8B's shape (as a Llama: the same matrices) with a random 5-layer drafter of block 16, the size of
the published ones; `tiny` a small Llama and a random drafter for it (for checks). Random weights accept almost no
drafts, so a full-width step verifies a whole block for every request and commits one token each: the figure is what
a step costs. Each mode also reports the tokens it committed per request and step, and tokens per second: where
drafts are never accepted, what the policy saves by verifying fewer rows, or none (plain steps), shows there.

Before the steps, the same requests' admission is timed both ways, each in a fresh engine after one untimed round
(the first forward at a new shape costs more): `alone`, one prefill forward per request (`admit`), and `packed`,
the prompts packed end to end into forwards of at most `--prefill-chunk` tokens, at most `CPU_PACK_TOKENS` on a CPU
(`admit_many`, what the continuous-batching manager does with requests that wait together).

Last, what a new shape costs (`new_shapes`): one engine at static shapes admits the largest `--requests` count,
then, for each count from the largest down (as requests end and the batch shrinks), runs three steps, each timed
alone: the first at a shape the engine has not run (on a GPU: its first run, before any recording), the second and
the third (recorded, then replayed). Then the same in a fresh engine that first ran `record_shapes`, as the
manager's `warmup` does (`recorded_ahead`, and its time, `record_shapes_ms`): its first steps replay, every row and
span bucket up to `RECORD_SPAN_LIMIT` positions having been recorded. The report adds the device memory the process
held at its peak in each.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from . import harness

# target shapes: Llama configurations with random weights
SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    tie_word_embeddings=True),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     rope_theta=1000000.0),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024),
}
# the random drafters of the shapes without a shipped one: (layers, block size); smollm2's is the shipped drafter
RANDOM_DRAFTERS = {"qwen3-8b": (5, 16), "tiny": (1, 8)}
MODES = {"eager": (False, False), "static": (True, False), "policy": (True, True)}  # -> (static_shapes, adaptive)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=list(SHAPES), default="smollm2",
                        help="smollm2 (default: its shape, random weights, the shipped drafter), qwen3-8b or tiny")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=["eager", "static"],
                        help="how the engine steps (default: eager static; policy adds the verify policy at static "
                        "shapes)")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16], help="running requests, one row each")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--prefill-chunk", type=int, default=2048,
                        help="the most prompt tokens of one packed prefill forward (transformers' max_batch_tokens)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per mode and request count")
    parser.add_argument("--warmup", type=int, default=8,
                        help="untimed steps first (a static shape runs once, then is recorded, before timing)")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                        help="auto (default): bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import at_least, check_device

    for value in args.requests:
        at_least("--requests", value, 1)
    for option in ("prompt_tokens", "prefill_chunk", "steps"):
        at_least("--" + option.replace("_", "-"), getattr(args, option), 1)
    at_least("--warmup", args.warmup, 2, " (a static shape is seen twice before it replays)")
    check_device("--device", args.device)


def models(args: argparse.Namespace, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..generate_cli import DEFAULT_DRAFTER
    from ..modeling import DFlashConfig, DFlashDraftModel

    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: a CPU takes minutes to initialize 8B random weights
        target = LlamaForCausalLM(LlamaConfig(**SHAPES[args.shape])).to(dtype).eval()
    if args.shape == "smollm2":
        drafter = DFlashDraftModel.from_pretrained(DEFAULT_DRAFTER, dtype=dtype)
    else:
        layers, block = RANDOM_DRAFTERS[args.shape]
        drafter = DFlashDraftModel(DFlashConfig.for_target(target.config, num_hidden_layers=layers, block_size=block,
                                                           mask_token_id=SHAPES[args.shape]["vocab_size"] - 1))
    return target, drafter.to(device, dtype).eval()


def drafter_block_size(shape: str) -> int:
    """The block size of `models`' drafter for `shape`, read without building it."""
    if shape in RANDOM_DRAFTERS:
        return RANDOM_DRAFTERS[shape][1]
    from ..generate_cli import DEFAULT_DRAFTER
    from ..modeling import DFlashConfig

    return DFlashConfig.from_pretrained(DEFAULT_DRAFTER).block_size


def admissions(args: argparse.Namespace, requests: int, vocab: int, max_new_tokens: int | None = None) -> list[tuple]:
    """`requests` requests of `--prompt-tokens` random tokens, greedy, as `admit` and `admit_many` take them, each
    asking `max_new_tokens` (default: room for the warm-up and timed steps)."""
    from transformers import GenerationConfig

    from ..modeling.dflash_row_sampling import SamplingSettings

    greedy = SamplingSettings.from_config(GenerationConfig(do_sample=False))
    generator = torch.Generator().manual_seed(0)
    return [(key, torch.randint(0, vocab, (args.prompt_tokens,), generator=generator).tolist(),
             max_new_tokens or args.warmup + args.steps + 1, greedy) for key in range(requests)]


@torch.no_grad()
def admit_seconds(engine: object, requests: list[tuple], packed: bool) -> float:
    """Seconds to admit `requests`: one `admit` each, or `admit_many` over packs of at most the engine's
    `pack_tokens` tokens."""
    device = engine.anchor_ids.device
    harness.synchronize(device)
    start = time.perf_counter()
    if not packed:
        for request in requests:
            engine.admit(*request)
    else:
        pack: list[tuple] = []
        for request in requests:
            if pack and sum(len(prompt) for _, prompt, _, _ in pack) + len(request[1]) > engine.pack_tokens:
                engine.admit_many(pack)
                pack = []
            pack.append(request)
        engine.admit_many(pack)
    harness.synchronize(device)
    return time.perf_counter() - start


@torch.no_grad()
def seconds_per_step(engine: object, args: argparse.Namespace, requests: int, vocab: int) -> tuple[float, float]:
    """Seconds per timed step, and tokens committed per request and step."""
    for request in admissions(args, requests, vocab):
        engine.admit(*request)
    for _ in range(args.warmup):
        engine.run_step()
    device = engine.anchor_ids.device
    harness.synchronize(device)
    committed = 0
    start = time.perf_counter()
    for _ in range(args.steps):
        committed += sum(map(len, engine.run_step().values()))
    harness.synchronize(device)
    return (time.perf_counter() - start) / args.steps, committed / (requests * args.steps)


@torch.no_grad()
def new_shape_steps(
    target: torch.nn.Module, drafter: torch.nn.Module, args: argparse.Namespace, recorded_ahead: bool
) -> tuple[list[dict], float | None]:
    """Milliseconds of three steps at each running-request count, largest first (see the module docstring); with
    `recorded_ahead`, after the engine's `record_shapes` (what the manager's `warmup` does), whose milliseconds come
    second (None without)."""
    from ..modeling.dflash_engine import DFlashEngine
    from ..modeling.dflash_paged_cache import PAGE_SIZE

    counts = sorted(set(args.requests), reverse=True)
    steps = 3 * len(counts)
    length = args.prompt_tokens + steps * drafter.config.block_size  # room for every step to commit a whole block
    pages = -(-(length + drafter.config.block_size) // PAGE_SIZE)  # what `DFlashEngine.pages_for` reserves
    engine = DFlashEngine(target, drafter, max_batch_size=counts[0], max_sequence_length=length,
                          max_tokens=counts[0] * pages * PAGE_SIZE, static_shapes=True, adaptive=False)
    device = engine.anchor_ids.device
    record_ms = None
    if recorded_ahead:
        harness.synchronize(device)
        start = time.perf_counter()
        engine.record_shapes()
        harness.synchronize(device)
        record_ms = 1000 * (time.perf_counter() - start)
        print(f"recording every row and span bucket ahead: {record_ms:.0f} ms", flush=True)
    for request in admissions(args, counts[0], target.config.vocab_size, length - args.prompt_tokens):
        engine.admit(*request)
    rows = []
    for count in counts:
        while len(engine.sequences) > count:
            engine.retire(engine.sequences[-1].key)
        times = []
        for _ in range(3):
            harness.synchronize(device)
            start = time.perf_counter()
            engine.run_step()
            harness.synchronize(device)
            times.append(1000 * (time.perf_counter() - start))
        rows.append({"requests": count, "first_ms": times[0], "second_ms": times[1], "third_ms": times[2]})
        print(f"{count:>3} requests, {'recorded ahead' if recorded_ahead else 'a new shape'}: the first step "
              f"{times[0]:.1f} ms, then {times[1]:.1f} and {times[2]:.1f} ms", flush=True)
    return rows, record_ms


def run(args: argparse.Namespace) -> int:
    from ..modeling.dflash_engine import DFlashEngine

    device = args.device or harness.default_device()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype)
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    target, drafter = models(args, device, dtype)
    report = harness.header(args, device)
    rows = []
    length = args.prompt_tokens + args.warmup + args.steps + 1
    rows_memory = max(args.requests) * (length + drafter.config.block_size + 16)  # whole pages for every request

    def engine_for(static: bool, adaptive: bool = False) -> DFlashEngine:
        return DFlashEngine(target, drafter, max_batch_size=max(args.requests), max_sequence_length=length,
                            max_tokens=rows_memory, prefill_chunk=args.prefill_chunk, static_shapes=static,
                            adaptive=adaptive)

    for requests in args.requests:
        row = {"requests": requests}
        for packed in (False, True):
            work = admissions(args, requests, target.config.vocab_size)
            admit_seconds(engine_for(False), work, packed)  # untimed: new shapes cost more once
            seconds = admit_seconds(engine_for(False), work, packed)
            row[f"admit_{'packed' if packed else 'alone'}_ms"] = 1000 * seconds
        row["admit_alone_over_packed"] = row["admit_alone_ms"] / row["admit_packed_ms"]
        for mode in args.modes:
            engine = engine_for(*MODES[mode])
            seconds, tokens = seconds_per_step(engine, args, requests, target.config.vocab_size)
            row[f"{mode}_ms_per_step"] = 1000 * seconds
            row[f"{mode}_tokens_per_step"] = tokens  # per request
            row[f"{mode}_tokens_per_s"] = requests * tokens / seconds
            row[f"{mode}_graphs"] = len(engine.graphs)
            if MODES[mode][1]:  # what the policy chose over the warm-up and timed steps
                row[f"{mode}_width_steps"] = {str(width): n for width, n in sorted(engine.width_steps.items())}
            print(f"{requests:>3} requests, {mode}: {1000 * seconds:.2f} ms per step, {tokens:.2f} tokens per "
                  f"request and step, {row[f'{mode}_tokens_per_s']:.0f} tokens/s ({len(engine.graphs)} CUDA graphs)",
                  flush=True)
        if {"eager", "static"} <= set(args.modes):
            row["eager_over_static"] = row["eager_ms_per_step"] / row["static_ms_per_step"]
        if {"policy", "static"} <= set(args.modes):
            row["policy_over_static_tokens_per_s"] = row["policy_tokens_per_s"] / row["static_tokens_per_s"]
        print(f"{requests:>3} requests admitted one by one {row['admit_alone_ms']:.1f} ms, packed "
              f"{row['admit_packed_ms']:.1f} ms ({row['admit_alone_over_packed']:.2f}x)", flush=True)
        rows.append(row)
    for recorded_ahead, name in ((False, "new_shapes"), (True, "recorded_ahead")):
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        report[name], record_ms = new_shape_steps(target, drafter, args, recorded_ahead)
        if record_ms is not None:
            report["record_shapes_ms"] = record_ms
        if device.startswith("cuda"):
            report[f"{name}_peak_memory_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    report.update(shape=args.shape, modes=args.modes, dtype=str(dtype).removeprefix("torch."),
                  prompt_tokens=args.prompt_tokens, prefill_chunk=args.prefill_chunk,
                  pack_tokens=engine_for(False).pack_tokens,
                  statistic=f"mean of {args.steps} steps after {args.warmup} warm-up steps; admission: one round "
                  "after an untimed one", rows=rows)
    harness.write_report(args.out, report, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    figure, (axis, admit_axis) = plt.subplots(1, 2, figsize=(10, 3.5))
    rows = report["rows"]
    groups = [str(row["requests"]) for row in rows]
    graphs = any(row.get("static_graphs") or row.get("policy_graphs") for row in rows)
    labels = {"eager": "eager", "static": "CUDA graphs" if graphs else "static shapes, eager",
              "policy": "verify policy, " + ("CUDA graphs" if graphs else "static shapes, eager")}
    harness.grouped_bars(axis, groups, {labels[mode]: [row[f"{mode}_tokens_per_s"] for row in rows]
                                        for mode in report["modes"]}, "committed tokens / s")
    axis.set_xlabel("running requests")
    axis.set_title(f"engine step, {report['shape']} shape ({report['dtype']}), {report['machine']} "
                   f"({report['date'][:10]})", fontsize=9)
    harness.grouped_bars(admit_axis, groups, {
        "one prefill per request": [row["admit_alone_ms"] for row in rows],
        "packed prefills": [row["admit_packed_ms"] for row in rows],
    }, "ms to admit them all")
    admit_axis.set_xlabel("requests admitted")
    admit_axis.set_title(f"admission, {report['prompt_tokens']} prompt tokens each", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
