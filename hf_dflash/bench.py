"""`hf-dflash bench`: the ways to decode with a target, measured side by side in one process on the same prompts.

Methods:
- `plain`: `target.generate` as it comes (eager, DynamicCache);
- `plain-static`: transformers' fastest plain settings (`cache_implementation="static"`, which compiles the decode
  step on a GPU);
- `native`: transformers' own DFlash loop with the same drafter (`speculation_type="dflash"`);
- `dflash`: ours (`assistant_model=drafter`: the CUDA-graph fast path on a GPU, the eager loop elsewhere).

Reported per method: tau, tokens/s, ms per verify step (per token for plain methods), time to first token, peak GPU
memory, whether the tokens equal `plain`'s, and speedups. With `--random-weights qwen3-8b` the target and drafter are
built at a published shape without weights (for speed at real scale), prompts are random ids of each
`--context-lengths`, and two GPU figures are added: the target's own 1-token step as a CUDA graph (the floor a
verify step is compared against) and our step split into its propose and verify graphs.

`--sampling qwen3` (or `llama3`) decodes every method with that model family's published sampling defaults, as a
chat model's `generation_config.json` makes `generate` do; tau and speed are then compared, not tokens (each call
is seeded). `--own-lengths` runs batch-1 prompts at their own lengths instead of left-padding them to the longest:
what a user's loop over prompts does, where compiled plain `generate` meets a new shape per prompt.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .modeling import DFlashConfig, DFlashDraftModel
from .modeling.dflash_decoding import _cache_argument
from .generate_cli import timed
from .modeling.dflash_fast_path import DFlashStaticStep, record_cuda_graph
from .modeling.dflash_static_cache import StaticTargetCache

METHODS = ("plain", "plain-static", "native", "dflash")
# Published shapes for --random-weights: the target's config and its drafter's (z-lab/Qwen3-8B-DFlash-b16).
RANDOM_SHAPES = {
    "qwen3-8b": {
        "target": dict(
            vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
            max_position_embeddings=40960, tie_word_embeddings=False,
        ),
        "drafter": dict(num_hidden_layers=5, block_size=16, mask_token_id=151669),
    },
}
# Sampling settings of `--sampling`: what the published generation_config.json of each family sets (transformers'
# defaults fill the rest, e.g. top_k 50 for Llama-3.1-Instruct, as they do for a user's call).
SAMPLING = {
    "greedy": dict(do_sample=False),
    "qwen3": dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95),
    "llama3": dict(do_sample=True, temperature=0.6, top_p=0.9),
}


@dataclass
class Measurement:
    setting: str
    method: str
    prompts: int
    new_tokens: int
    seconds: float
    ttft_s: float
    steps: int
    peak_memory_gb: float | None
    tau: float
    identical_to_plain: float | None = None
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds

    @property
    def ms_per_step(self) -> float:
        """Decode time after the first token per verify step (per token for plain methods)."""
        return 1000 * (self.seconds - self.ttft_s) / max(self.steps, 1)


class StepCounter:
    """Counts the verify steps of transformers' native DFlash loop (one candidate proposal per step)."""

    def __init__(self) -> None:
        from transformers.generation import candidate_generator

        self.cls = candidate_generator.DFlashTokenCandidateGenerator
        self.original = self.cls.get_candidates
        self.count = 0

    def __enter__(self) -> "StepCounter":
        counter = self

        def counted(generator: Any, *args: Any, **kwargs: Any) -> Any:
            counter.count += 1
            return counter.original(generator, *args, **kwargs)

        self.cls.get_candidates = counted
        return self

    def __exit__(self, *exc: object) -> None:
        self.cls.get_candidates = self.original


def _method_kwargs(method: str, drafter: torch.nn.Module) -> dict[str, Any]:
    return {
        "plain": {},
        "plain-static": {"cache_implementation": "static"},
        "native": {"assistant_model": drafter, "speculation_type": "dflash"},
        "dflash": {"assistant_model": drafter, "return_dict_in_generate": True},
    }[method]


def run_method(
    method: str, target: torch.nn.Module, drafter: torch.nn.Module, batches: list[dict[str, torch.Tensor]],
    max_new_tokens: int, setting: str, pad_token_id: int, sampling: str = "greedy",
) -> tuple[Measurement, list[list[int]]]:
    """Warm up once on the first batch (compiles and graph captures happen there), then time every batch. Sampled
    calls are seeded, so a rerun draws the same tokens."""
    kwargs = dict(pad_token_id=pad_token_id, **SAMPLING[sampling], **_method_kwargs(method, drafter))
    torch.manual_seed(0)
    target.generate(**batches[0], max_new_tokens=max_new_tokens, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    seconds = ttft = 0.0
    new_tokens = steps = 0
    committed = verified = 0  # tokens committed by verify steps, and those steps (all sequences together)
    outputs: list[list[int]] = []
    for index, batch in enumerate(tqdm(batches, desc=f"{setting} {method}", leave=False)):
        prompt_len = batch["input_ids"].shape[1]
        ttft += timed(lambda: target.generate(**batch, max_new_tokens=1, **kwargs))[1]
        torch.manual_seed(index)
        with StepCounter() as counter:
            out, elapsed = timed(lambda: target.generate(**batch, max_new_tokens=max_new_tokens, **kwargs))
        sequences = out.sequences if hasattr(out, "sequences") else out
        seconds += elapsed
        for row in sequences[:, prompt_len:].tolist():
            row = row[: next((i + 1 for i, t in enumerate(row) if t == pad_token_id), len(row))]
            outputs.append(row)
            new_tokens += len(row)
        # decode steps after the prefill's first token
        if method == "dflash":
            steps += max(len(lengths) for lengths in out.acceptance_lengths)
            committed += sum(sum(lengths) for lengths in out.acceptance_lengths)
            verified += sum(len(lengths) for lengths in out.acceptance_lengths)
        elif method == "native":  # batch 1 only (transformers' limit)
            steps += counter.count
            committed, verified = committed + len(outputs[-1]) - 1, verified + counter.count
        else:
            steps += sequences.shape[1] - prompt_len - 1
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    tau = committed / verified if verified else 1.0  # as `hf-dflash eval` reports it
    measurement = Measurement(setting, method, len(outputs), new_tokens, seconds, ttft, steps, peak, tau)
    return measurement, outputs


@torch.no_grad()
def target_graph_step_ms(target: torch.nn.Module, batch_size: int, num_slots: int, cache_argument: str) -> float:
    """The target's own 1-token decode step as a CUDA graph replay, on a static cache of `num_slots` slots."""
    text = target.config.get_text_config()
    device = target.get_input_embeddings().weight.device
    cache = StaticTargetCache(
        text.num_hidden_layers, batch_size, text.num_key_value_heads,
        getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads, num_slots, target.dtype, device,
    )
    position = num_slots // 2
    cache.write_slots = torch.full((batch_size, 1), position, device=device)
    ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
    mask = (torch.arange(num_slots, device=device) <= position).expand(batch_size, 1, 1, -1)

    def step() -> None:
        target(input_ids=ids, position_ids=cache.write_slots, attention_mask=mask, use_cache=True, logits_to_keep=1,
               **{cache_argument: cache})

    return _graph_ms(step)


def _graph_ms(fn: Any, replays: int = 30) -> float:
    """Median ms of a CUDA graph replay of `fn`."""
    graph = record_cuda_graph(fn)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def step_parts_ms(step: DFlashStaticStep) -> dict[str, float]:
    """Our step's parts as separate CUDA graphs, after a finished call (every sequence frozen, so replays repeat the
    same work): propose (context keys/values + drafter + lm_head) and verify (target forward + acceptance)."""
    rows = step.rows(step.batch_size)  # the whole batch, as a call's first steps run it
    with step.generator.capture:
        return {"propose_graph_ms": _graph_ms(lambda: step.propose(rows)),
                "verify_graph_ms": _graph_ms(lambda: step.verify(rows, None)),
                "step_graph_ms": _graph_ms(lambda: step.step(rows))}


def random_pair(shape: str, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A target and drafter of a published shape, randomly initialised (speed only: tau means nothing here)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    spec = RANDOM_SHAPES[shape]
    config = Qwen3Config(**spec["target"])
    with torch.device(device):
        target = Qwen3ForCausalLM._from_config(config, dtype=dtype).eval()
        drafter_config = DFlashConfig.for_target(config, **spec["drafter"])
        drafter = DFlashDraftModel._from_config(drafter_config, dtype=dtype).eval()
    return target, drafter


def _padded_batches(
    prompts: list[list[int]], batch_size: int, pad_token_id: int, device: str, own_lengths: bool = False
) -> list[dict[str, torch.Tensor]]:
    """All prompts left-padded to the longest one, so every call has one shape (one compile, one graph bucket);
    with `own_lengths` (batch 1), each prompt alone at its own length."""
    if own_lengths:
        return [
            {"input_ids": torch.tensor([p], device=device), "attention_mask": torch.ones(1, len(p), dtype=torch.long, device=device)}
            for p in prompts
        ]
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (longest - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    return [
        {"input_ids": ids[i : i + batch_size], "attention_mask": mask[i : i + batch_size]}
        for i in range(0, len(prompts), batch_size)
    ]


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    settings: list[tuple[str, list[list[int]]]] = []
    if args.random_weights:
        target, drafter = random_pair(args.random_weights, dtype, device)
        pad_token_id = 0
        generator = torch.Generator().manual_seed(0)
        vocab = target.config.vocab_size - 1000  # keep clear of the mask row at the end of the vocabulary
        for length in args.context_lengths:
            prompts = torch.randint(0, vocab, (args.batch_size, length), generator=generator).tolist()
            settings.append((f"{args.random_weights} ctx {length}{_label(args)} b{args.batch_size}", prompts))
    else:
        from .generate_cli import DEFAULT_DRAFTER, encode, load_target
        from .training.data import load_prompts

        target, tokenizer = load_target(args.target, dtype, device)
        drafter = DFlashDraftModel.from_pretrained(args.drafter or DEFAULT_DRAFTER, dtype=dtype).to(device).eval()
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        texts = load_prompts(args.prompts)[: args.limit]
        prompts = [encode(tokenizer, text, "cpu")["input_ids"][0].tolist() for text in texts]
        for batch_size in args.batch_sizes:
            settings.append((f"{Path(str(args.target)).name} {Path(args.prompts).stem}{_label(args)} b{batch_size}", prompts))
    target.eval()
    cache_argument = _cache_argument(target)
    results: list[Measurement] = []
    for setting, prompts in settings:
        batch_size = args.batch_size if args.random_weights else int(setting.rsplit("b", 1)[1])
        batches = _padded_batches(prompts, batch_size, pad_token_id, device, args.own_lengths)
        reference = None
        for method in args.methods:
            measurement, outputs = run_method(
                method, target, drafter, batches, args.max_new_tokens, setting, pad_token_id, args.sampling
            )
            if method == "plain":
                reference = outputs
            if reference is not None and args.sampling == "greedy":  # sampled outputs agree in distribution only
                measurement.identical_to_plain = sum(a == b for a, b in zip(outputs, reference)) / len(outputs)
            held = getattr(drafter, "_dflash_static_step", None)
            if method == "dflash" and device.startswith("cuda") and held is not None:
                step = held[1]
                measurement.extra.update(step_parts_ms(step))
                measurement.extra["target_1_token_graph_ms"] = target_graph_step_ms(
                    target, batch_size, step.num_slots, cache_argument
                )
            results.append(measurement)
            print(_row(measurement), flush=True)
        _add_ratios([m for m in results if m.setting == setting])
    return {
        **run_environment(device),
        "command": "hf-dflash bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "arguments": {k: v for k, v in vars(args).items() if k != "func"},
        "results": [
            {**asdict(m), "tokens_per_s": m.tokens_per_s, "ms_per_step": m.ms_per_step}
            for m in results
        ],
    }


def _label(args: argparse.Namespace) -> str:
    """What a setting's name adds for non-default decoding: the sampling preset and unpadded prompts."""
    return ("" if args.sampling == "greedy" else f" {args.sampling}-sampling") + (" own-lengths" if args.own_lengths else "")


def _add_ratios(setting_results: list[Measurement]) -> None:
    """Speedups in tokens/s over each plain method of the same setting, and our step over the target's own 1-token
    graph step where both were measured."""
    for base in setting_results:
        if base.method.startswith("plain"):
            for m in setting_results:
                m.extra[f"speedup_over_{base.method}"] = m.tokens_per_s / base.tokens_per_s
    for m in setting_results:
        if "target_1_token_graph_ms" in m.extra:
            m.extra["step_over_target_1_token_graph"] = m.ms_per_step / m.extra["target_1_token_graph_ms"]
        print(f"{m.setting:32s} {m.method:13s} " + "  ".join(
            f"{k} {v:.2f}" for k, v in m.extra.items() if k.startswith(("speedup", "step_over"))
        ))


def run_environment(device: str, **more_versions: str) -> dict[str, Any]:
    """What a benchmark report records about its run: date (UTC), machine and library versions."""
    import transformers

    from . import __version__

    machine = torch.cuda.get_device_name(device) if device.startswith("cuda") else f"{platform.machine()} CPU"
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "hf_dflash": __version__,
                "python": platform.python_version(), **more_versions}
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine, "versions": versions}


def _row(m: Measurement) -> str:
    return (
        f"{m.setting:32s} {m.method:13s} tau {m.tau:5.2f}  {m.tokens_per_s:8.1f} tok/s  {m.ms_per_step:7.2f} ms/step  "
        f"ttft {1000 * m.ttft_s / m.prompts:7.1f} ms  identical {m.identical_to_plain}  "
        + "  ".join(f"{k} {v:.2f}" for k, v in m.extra.items())
    )


def plot(report: dict[str, Any], path: Path) -> None:
    """Per setting, a group of bars per method: new tokens/s (left) and ms per verify step (right; per token for
    plain methods), with the target's own 1-token CUDA-graph step marked where it was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(methods)
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 3.5 * len(settings)), 4))
    for ax, key, label in ((axes[0], "tokens_per_s", "new tokens / s"), (axes[1], "ms_per_step", "ms per step")):
        for j, method in enumerate(methods):
            values = [next((r[key] for r in rows if r["setting"] == s and r["method"] == method), 0) for s in settings]
            ax.bar([i + j * width for i in range(len(settings))], values, width, label=method)
        ax.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(settings))], settings, fontsize=7)
        ax.set_ylabel(label)
    floors = [(i, r["extra"]["target_1_token_graph_ms"]) for i, s in enumerate(settings) for r in rows
              if r["setting"] == s and "target_1_token_graph_ms" in r.get("extra", {})]
    if floors:
        at = methods.index("dflash") * width  # the mark sits on our bar
        axes[1].scatter([i + at for i, _ in floors], [ms for _, ms in floors], marker="_", s=400,
                        color="black", label="target 1-token CUDA graph")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{report['machine']}, {report['dtype']}, {report['max_new_tokens']} new tokens ({report['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    report = benchmark(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    try:
        plot(report, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'hf-dflash[bench]')")
    print(f"wrote {out}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure plain generate, transformers' DFlash loop and ours side by side",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", default="smollm2", help="smollm2, stories260k, or a from_pretrained path/id")
    parser.add_argument("--drafter", default=None, help="drafter directory (default: our SmolLM2 drafter)")
    parser.add_argument("--random-weights", choices=sorted(RANDOM_SHAPES), default=None,
                        help="build target and drafter of this published shape without weights (speed only)")
    parser.add_argument("--context-lengths", type=int, nargs="+", default=[512],
                        help="prompt lengths of --random-weights runs")
    parser.add_argument("--prompts", default="humaneval", help="humaneval, sharegpt:N or a .jsonl file")
    parser.add_argument("--limit", type=int, default=8, help="number of prompts")
    parser.add_argument("--batch-size", type=int, default=1, help="batch size of --random-weights runs")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1], help="batch sizes of prompt-set runs")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy",
                        help="decode with a family's published sampling defaults (qwen3: temperature 0.6, top_k 20, "
                        "top_p 0.95; llama3: temperature 0.6, top_p 0.9), every method alike")
    parser.add_argument("--own-lengths", action="store_true",
                        help="batch 1 only: each prompt at its own length, not left-padded to the longest")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--out", default="benchmarks/results/bench.json", help="JSON report (a .png plot is written beside it)")
    parser.set_defaults(func=run)
