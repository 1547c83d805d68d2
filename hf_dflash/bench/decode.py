"""The ways to decode with a target, measured side by side in one process on the same prompts.

Methods:
- `plain`: `target.generate` as it comes (eager, DynamicCache);
- `plain-static`: transformers' fastest plain settings (`cache_implementation="static"`, which compiles the decode
  step on a GPU);
- `native`: transformers' own DFlash loop with the same drafter (`speculation_type="dflash"`; batch 1 only, so a
  setting of a larger batch skips it and the report says so);
- `dflash`: ours (`assistant_model=drafter`: the engine's step, a CUDA graph on a GPU and eager on a CPU; the target's
  keys/values in transformers' cache for a call the engine's pool cannot serve);
- `dflash-engine`, `dflash-transformers-cache`: ours with the target's keys/values forced into the engine's pool or
  into transformers' cache (`dflash_fast_path=True` / `False`; not run unless named);
- `dflash-no-onednn`, `dflash-transformers-cache-no-onednn`: ours with the target's keys/values in the engine's pool
  or in transformers' cache, without prepacked oneDNN weights (`dflash_onednn_linears=False`): on a CPU, what those
  products give the drafted steps (not run unless named);
- `dflash-one-width` (with `--adaptive`): ours under a verify policy that verifies one width for the batch, the
  widest its sequences chose (`VerifyPolicy(per_sequence=False)`), where `dflash`'s each verify their own (not run
  unless named).

Reported per method: tau, tokens/s, ms per verify step (per token for plain methods), time to first token, peak GPU
memory, whether the tokens equal `plain`'s, and speedups. With `--random-weights SHAPE` the target and drafter are
built with random weights at a published shape (for speed at real scale), prompts are random ids of each
`--context-lengths`, and two GPU figures are added (from `step_cost.py`): the target's own 1-token step as a CUDA
graph on the cache the fast path keeps for that family (the floor a verify step is compared against) and our step
split into its propose and verify graphs. The shapes: each target's published config (its config.json; the text
model of a multimodal checkpoint) and the published DFlash drafter for it (its config in hub_configs/):
  qwen3-8b             Qwen/Qwen3-8B + z-lab/Qwen3-8B-DFlash-b16 (dense)
  gpt-oss-20b          openai/gpt-oss-20b + z-lab/gpt-oss-20b-DFlash (sliding windows, attention sinks, MoE; eager
                       attention, which applies the sinks)
  qwen3.5-4b           Qwen/Qwen3.5-4B's text model + z-lab/Qwen3.5-4B-DFlash (Gated DeltaNet + full attention)
  qwen3-coder-30b-a3b  Qwen/Qwen3-Coder-30B-A3B-Instruct + z-lab/Qwen3-Coder-30B-A3B-DFlash (MoE)
MoE experts run what the fast path tells a user to load them with on that device: `grouped_mm` in bfloat16 on a
compute capability 9.x/10.x GPU, else `batched_mm` (on a CPU, transformers' default); `--experts-implementation`
picks one.

`--sampling qwen3` (or `llama3`) decodes every method with that model family's published sampling defaults, as a
chat model's `generation_config.json` makes `generate` do; tau and speed are then compared, not tokens (each call
is seeded). `--own-lengths` runs batch-1 prompts at their own lengths instead of left-padding them to the longest:
what a user's loop over prompts does, where compiled plain `generate` meets a new shape per prompt.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..batching import eos_token_ids, left_pad_token_id, up_to_first_eos
from ..generate_cli import timed
from ..modeling import DFlashDraftModel
from ..modeling.dflash_policy import VerifyPolicy
from . import harness, step_cost
from .published import RANDOM_SHAPES, SAMPLING, random_pair, shape_record

METHODS = ("plain", "plain-static", "native", "dflash", "dflash-engine", "dflash-transformers-cache",
           "dflash-no-onednn", "dflash-transformers-cache-no-onednn", "dflash-one-width")
DEFAULT_METHODS = METHODS[:4]
# A prompt-set run's target, prompts and their number when left out (`cli_checks.check_bench` reads them too).
DEFAULT_TARGET, DEFAULT_PROMPTS, DEFAULT_LIMIT = "smollm2", "humaneval", 8


@dataclass
class Measurement:
    setting: str
    method: str
    prompts: int
    batches: int  # generate calls timed, one per batch
    new_tokens: int
    seconds: float
    ttft_s: float  # summed over the batches' first-token calls, each timed after its batch's full call
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
        "dflash-engine": {"assistant_model": drafter, "return_dict_in_generate": True, "dflash_fast_path": True},
        "dflash-transformers-cache": {
            "assistant_model": drafter, "return_dict_in_generate": True, "dflash_fast_path": False,
        },
        "dflash-no-onednn": {
            "assistant_model": drafter, "return_dict_in_generate": True, "dflash_fast_path": True,
            "dflash_onednn_linears": False,
        },
        "dflash-transformers-cache-no-onednn": {
            "assistant_model": drafter, "return_dict_in_generate": True, "dflash_fast_path": False,
            "dflash_onednn_linears": False,
        },
        "dflash-one-width": {"assistant_model": drafter, "return_dict_in_generate": True},
    }[method]


def run_method(
    method: str, target: torch.nn.Module, drafter: torch.nn.Module, batches: list[dict[str, torch.Tensor]],
    max_new_tokens: int, setting: str, pad_token_id: int, sampling: str = "greedy", adaptive: bool = False,
) -> tuple[Measurement, list[list[int]]]:
    """Warm up once on the first batch (compiles and graph captures happen there), then time every batch. Sampled
    calls are seeded, so a rerun draws the same tokens. `adaptive`: our methods' calls share one `VerifyPolicy`
    (as `hf-dflash generate` passes one to all its calls), made for this method."""
    kwargs = dict(pad_token_id=pad_token_id, **SAMPLING[sampling], **_method_kwargs(method, drafter))
    if adaptive and method.startswith("dflash"):
        kwargs["dflash_adaptive"] = VerifyPolicy(per_sequence=method != "dflash-one-width")
    eos_ids = eos_token_ids(target)
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
        torch.manual_seed(index)
        with StepCounter() as counter:
            out, elapsed = timed(lambda: target.generate(**batch, max_new_tokens=max_new_tokens, **kwargs))
        # After the full call, so that a shape's one-time setup (a compile, buffers for a new prompt length under
        # --own-lengths) lands in the call's time for every method, not in the first-token time of only some.
        ttft += timed(lambda: target.generate(**batch, max_new_tokens=1, **kwargs))[1]
        sequences = out.sequences if hasattr(out, "sequences") else out
        seconds += elapsed
        for row in sequences[:, prompt_len:].tolist():
            row = up_to_first_eos(row, eos_ids)  # a finished row's padding is no new token
            outputs.append(row)
            new_tokens += len(row)
        # decode steps after the prefill's first token
        if method.startswith("dflash"):
            steps += max(len(lengths) for lengths in out.acceptance_lengths)
            committed += sum(sum(lengths) for lengths in out.acceptance_lengths)
            verified += sum(len(lengths) for lengths in out.acceptance_lengths)
        elif method == "native":  # batch 1 only (transformers' limit)
            # Its first step verifies the first draft with the prefill, so every new token is committed by a verify
            # step (tau counts them all), and the steps after the one the first-token call times are one fewer.
            steps += counter.count - 1
            committed, verified = committed + len(outputs[-1]), verified + counter.count
        else:
            steps += sequences.shape[1] - prompt_len - 1
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    tau = committed / verified if verified else 1.0  # as `hf-dflash eval` reports it
    measurement = Measurement(setting, method, len(outputs), len(batches), new_tokens, seconds, ttft, steps, peak, tau)
    return measurement, outputs


def padded_batches(
    prompts: list[list[int]], batch_size: int, pad_token_id: int, device: str, own_lengths: bool = False
) -> list[dict[str, torch.Tensor]]:
    """All prompts left-padded to the longest one, so every call has one shape (one compile, one graph bucket);
    with `own_lengths` (batch 1), each prompt alone at its own length."""
    if own_lengths:
        return [
            {"input_ids": torch.tensor([p], device=device),
             "attention_mask": torch.ones(1, len(p), dtype=torch.long, device=device)}
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
    device = args.device or harness.default_device()
    report = harness.header(args, device)  # before the defaults below are filled in: the command as given
    if args.dtype == "auto":  # bf16 on a GPU; on a CPU float32, where our tokens equal plain greedy's
        args.dtype = "bf16" if device.startswith("cuda") else "fp32"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    settings: list[tuple[str, list[list[int]], int]] = []  # (name, prompt ids, batch size)
    shape = None
    if args.random_weights:
        target, drafter = random_pair(args.random_weights, dtype, device, args.experts_implementation)
        shape = shape_record(args.random_weights, target, drafter)
        pad_token_id = 0
        generator = torch.Generator().manual_seed(0)
        vocab = drafter.config.mask_token_id  # random ids below the mask token (near the end of the vocabulary)
        batch_size = args.batch_size or 1
        for length in args.context_lengths or [512]:
            prompts = torch.randint(0, vocab, (batch_size, length), generator=generator).tolist()
            settings.append((f"{args.random_weights} ctx {length}{_label(args)} b{batch_size}", prompts, batch_size))
    else:
        from ..generate_cli import DEFAULT_DRAFTER, encode, load_target
        from ..training.data import load_prompts

        args.target, args.prompts = args.target or DEFAULT_TARGET, args.prompts or DEFAULT_PROMPTS
        args.limit = args.limit or DEFAULT_LIMIT
        texts = load_prompts(args.prompts)[: args.limit]  # before the models: a bad file fails at once
        target, tokenizer = load_target(args.target, dtype, device)
        drafter = DFlashDraftModel.from_pretrained(args.drafter or DEFAULT_DRAFTER, dtype=dtype).to(device).eval()
        pad_token_id = left_pad_token_id(tokenizer, target)
        prompts = [encode(tokenizer, text, "cpu")["input_ids"][0].tolist() for text in texts]
        for batch_size in args.batch_sizes or [1]:
            name = f"{Path(str(args.target)).name} {Path(args.prompts).stem}{_label(args)} b{batch_size}"
            settings.append((name, prompts, batch_size))
    target.eval()
    # plain first, so that every other method's tokens are compared with its tokens
    methods = [method for method in METHODS if method in args.methods]
    results: list[Measurement] = []
    skipped: list[str] = []
    for setting, prompts, batch_size in settings:
        batches = padded_batches(prompts, batch_size, pad_token_id, device, args.own_lengths)
        reference = None
        for method in methods:
            if method == "native" and batch_size > 1:
                skipped.append(f"{setting} native: transformers' DFlash loop runs batch 1 only")
                print(f"{setting:32s} {method:13s} skipped: transformers' DFlash loop runs batch 1 only", flush=True)
                continue
            measurement, outputs = run_method(
                method, target, drafter, batches, args.max_new_tokens, setting, pad_token_id, args.sampling,
                args.adaptive,
            )
            if method == "plain":
                reference = outputs
            if reference is not None and args.sampling == "greedy":  # sampled outputs agree in distribution only
                measurement.identical_to_plain = sum(a == b for a, b in zip(outputs, reference)) / len(outputs)
            if method == "dflash" and device.startswith("cuda"):
                measurement.extra.update(step_cost.gpu_step_figures(target, drafter, batches[0], args.max_new_tokens))
            results.append(measurement)
            print(format_row(measurement), flush=True)
        _add_ratios([m for m in results if m.setting == setting])
    return {
        **report,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        **({"random_weights_shape": shape} if shape is not None else {}),
        **({"skipped": skipped} if skipped else {}),
        "target_1_token_graph_baseline": step_cost.TARGET_1_TOKEN_BASELINE,
        "results": [
            {**asdict(m), "tokens_per_s": m.tokens_per_s, "ms_per_step": m.ms_per_step}
            for m in results
        ],
    }


def _label(args: argparse.Namespace) -> str:
    """What a setting's name adds for non-default decoding: the sampling preset, unpadded prompts, the verify policy."""
    sampling = "" if args.sampling == "greedy" else f" {args.sampling}-sampling"
    return sampling + (" own-lengths" if args.own_lengths else "") + (" adaptive" if args.adaptive else "")


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


def format_row(m: Measurement) -> str:
    """One measurement as the line printed while the run goes."""
    return (
        f"{m.setting:32s} {m.method:13s} tau {m.tau:5.2f}  {m.tokens_per_s:8.1f} tok/s  {m.ms_per_step:7.2f} ms/step  "
        f"ttft {1000 * m.ttft_s / m.batches:7.1f} ms  identical {m.identical_to_plain}  "
        + "  ".join(f"{k} {v:.2f}" for k, v in m.extra.items())
    )


def plot(report: dict[str, Any], path: Path) -> None:
    """Per setting, a group of bars per method: new tokens/s (left) and ms per verify step (right; per token for
    plain methods), with the target's own 1-token CUDA-graph step marked where it was measured."""
    plt = harness.pyplot()
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
    fig.suptitle(f"{report['machine']}, {report['dtype']}, {report['max_new_tokens']} new tokens "
                 f"({report['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    harness.write_report(args.out, benchmark(args), plot)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None,
                        help="smollm2 (default), stories260k, or a from_pretrained path/id")
    parser.add_argument("--drafter", default=None, help="drafter directory (default: our SmolLM2 drafter)")
    parser.add_argument("--random-weights", choices=list(RANDOM_SHAPES), default=None,
                        help="build target and drafter of this published shape with random weights (speed only; the "
                        "shapes are listed above)")
    parser.add_argument("--experts-implementation", choices=["batched_mm", "grouped_mm"], default=None,
                        help="MoE experts of a --random-weights target (default: grouped_mm in bf16 on a compute "
                        "capability 9.x/10.x GPU, else batched_mm, as the fast path advises)")
    parser.add_argument("--context-lengths", type=int, nargs="+", default=None,
                        help="prompt lengths of --random-weights runs (default: 512)")
    parser.add_argument("--prompts", default=None, help="humaneval (default), sharegpt:N or a .jsonl file")
    parser.add_argument("--limit", type=int, default=None, help="number of prompts (default: 8)")
    parser.add_argument("--batch-size", type=int, default=None, help="batch size of --random-weights runs (default: 1)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="batch sizes of prompt-set runs (default: 1)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS))
    parser.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy",
                        help="decode with a family's published sampling defaults (qwen3: temperature 0.6, top_k 20, "
                        "top_p 0.95; llama3: temperature 0.6, top_p 0.9), every method alike")
    parser.add_argument("--own-lengths", action="store_true",
                        help="batch 1 only: each prompt at its own length, not left-padded to the longest")
    parser.add_argument("--adaptive", action="store_true",
                        help="our methods run with a verify policy (dflash_adaptive), one per method for all its "
                        "calls, as hf-dflash generate runs on a CPU")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                        help="auto (default): bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
