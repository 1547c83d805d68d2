"""`hf-dflash bench`: the ways to decode with a target, measured side by side in one process on the same prompts.

Methods:
- `plain`: `target.generate` as it comes (eager, DynamicCache);
- `plain-static`: transformers' fastest plain settings (`cache_implementation="static"`, which compiles the decode
  step on a GPU);
- `native`: transformers' own DFlash loop with the same drafter (`speculation_type="dflash"`; batch 1 only, so a
  setting of a larger batch skips it and the report says so);
- `dflash`: ours (`assistant_model=drafter`: the CUDA-graph fast path on a GPU, the eager loop elsewhere).

Reported per method: tau, tokens/s, ms per verify step (per token for plain methods), time to first token, peak GPU
memory, whether the tokens equal `plain`'s, and speedups. With `--random-weights SHAPE` the target and drafter are
built with random weights at a published shape (for speed at real scale), prompts are random ids of each
`--context-lengths`, and two GPU figures are added: the target's own 1-token step as a CUDA graph on the cache the
fast path keeps for that family (the floor a verify step is compared against) and our step split into its propose
and verify graphs. The shapes: each target's published config (its config.json; the text model of a multimodal
checkpoint) and the published DFlash drafter for it (its config in hub_configs/):
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
import json
import platform
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .batching import eos_token_ids, left_pad_token_id, up_to_first_eos
from .modeling import DFlashConfig, DFlashDraftModel
from .generate_cli import timed
from .modeling.dflash_fast_path import DFlashStaticStep, record_cuda_graph
from .modeling.dflash_fast_path_blockers import grouped_mm_stays_on_device, moe_experts
from .run_record import device_name, portable_path  # reports are committed: no machine's own paths in them

METHODS = ("plain", "plain-static", "native", "dflash")
# A prompt-set run's target, prompts and their number when left out (`cli_checks.check_bench` reads them too).
DEFAULT_TARGET, DEFAULT_PROMPTS, DEFAULT_LIMIT = "smollm2", "humaneval", 8
DEFAULT_OUT = "benchmarks/results/bench.json"  # its folder is made when missing; a folder given with --out must exist


@dataclass(frozen=True)
class PublishedShape:
    """A `--random-weights` shape: a published target's config and the published DFlash drafter trained for it."""

    target: str  # the target's Hub id
    drafter: str  # the drafter's Hub id; its config comes from hub_configs/
    model_type: str  # the (text) model type AutoModelForCausalLM builds
    config: dict[str, Any]  # the target config.json's fields (of its text config for a multimodal checkpoint)
    attn_implementation: str = "sdpa"  # the attention the fast path serves this family with
    # fields changed from the published drafter's config, where the target is built smaller than published (none
    # for the shapes below; every report records them)
    drafter_overrides: dict[str, Any] = field(default_factory=dict)


# The targets' fields as their config.json on the Hub states them (weights aside; transformers' defaults fill only
# what a file leaves out); each agrees with its drafter's config in hub_configs/ on hidden size, depth and vocabulary
# (tests/test_bench_shapes.py checks both).
RANDOM_SHAPES = {
    "qwen3-8b": PublishedShape(
        target="Qwen/Qwen3-8B", drafter="z-lab/Qwen3-8B-DFlash-b16", model_type="qwen3",
        config=dict(
            vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
            max_position_embeddings=40960, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
    ),
    "gpt-oss-20b": PublishedShape(
        target="openai/gpt-oss-20b", drafter="z-lab/gpt-oss-20b-DFlash", model_type="gpt_oss",
        config=dict(
            vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
            num_attention_heads=64, num_key_value_heads=8, head_dim=64, attention_bias=True,
            layer_types=["sliding_attention", "full_attention"] * 12, sliding_window=128,
            num_local_experts=32, num_experts_per_tok=4, swiglu_limit=7.0, router_aux_loss_coef=0.9,
            rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": 4096, "truncate": False,
            },
        ),
        attn_implementation="eager",  # sdpa drops the attention sinks; the fast path refuses it for this target
    ),
    "qwen3.5-4b": PublishedShape(  # the Hub checkpoint is Qwen3_5ForConditionalGeneration: its text model here
        target="Qwen/Qwen3.5-4B", drafter="z-lab/Qwen3.5-4B-DFlash", model_type="qwen3_5_text",
        config=dict(
            vocab_size=248320, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
            num_attention_heads=16, num_key_value_heads=4, head_dim=256,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10], "mrope_interleaved": True,
            },
        ),
    ),
    "qwen3-coder-30b-a3b": PublishedShape(
        target="Qwen/Qwen3-Coder-30B-A3B-Instruct", drafter="z-lab/Qwen3-Coder-30B-A3B-DFlash",
        model_type="qwen3_moe",
        config=dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            use_sliding_window=False, sliding_window=None, rms_norm_eps=1e-6, max_position_embeddings=262144,
            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0},
        ),
    ),
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
    }[method]


def run_method(
    method: str, target: torch.nn.Module, drafter: torch.nn.Module, batches: list[dict[str, torch.Tensor]],
    max_new_tokens: int, setting: str, pad_token_id: int, sampling: str = "greedy",
) -> tuple[Measurement, list[list[int]]]:
    """Warm up once on the first batch (compiles and graph captures happen there), then time every batch. Sampled
    calls are seeded, so a rerun draws the same tokens."""
    kwargs = dict(pad_token_id=pad_token_id, **SAMPLING[sampling], **_method_kwargs(method, drafter))
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
        if method == "dflash":
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


# What `target_1_token_graph_ms` times, as the report names it.
TARGET_1_TOKEN_BASELINE = (
    "the target's own forward of one token per sequence (its last committed token, at its position), with the "
    "target's own attention implementation, on the target cache the fast path keeps for its family (StaticTargetCache;"
    " HybridStaticCache with the Gated DeltaNet states for hybrid targets) under the fast path's masks (sliding "
    "windows applied as the fast path applies them; attention sinks inside eager attention), recorded once as a CUDA "
    "graph after our last call of the setting; median of 30 replays. GPU only: absent from rows measured elsewhere."
)


def target_one_token_step(step: DFlashStaticStep) -> Any:
    """The target's own 1-token decode forward on `step`'s target cache, as plain decoding's next step would run it:
    each sequence's last committed token at its own position, seeing every real slot before it (the fast path's
    masks: a sliding layer only its window), through the target's own attention. Returns a function that runs it
    and returns the logits (b, 1, V). A hybrid target's linear states advance at each call (restore them with
    `carried_state`)."""
    rows = step.rows(step.batch_size)
    slots = (rows.offsets + rows.anchor_pos)[:, None]  # (b, 1) the token's own slot
    visible = (step.key_slots >= rows.offsets[:, None, None]) & (step.key_slots <= slots[:, :, None])  # (b, 1, L)
    mask = step.target_masks(visible, slots)
    positions = rows.anchor_pos[:, None]  # (b, 1)
    cache = rows.target_cache

    @torch.no_grad()
    def forward() -> torch.Tensor:
        cache.write_slots = slots
        return step.target(
            input_ids=rows.anchor_ids, position_ids=positions, attention_mask=mask, use_cache=True, logits_to_keep=1,
            **{step.cache_argument: cache},
        ).logits

    return forward


@torch.no_grad()
def target_1_token_graph_ms(step: DFlashStaticStep) -> float:
    """`target_one_token_step` of a held fast-path step, as a CUDA graph replay (ms, median); see
    TARGET_1_TOKEN_BASELINE. The step's carried states (a hybrid target's linear layers) are put back afterwards."""
    saved = [state.clone() for state in step.target_cache.carried_state()]
    try:
        return _graph_ms(target_one_token_step(step))
    finally:
        for state, value in zip(step.target_cache.carried_state(), saved):
            state.copy_(value)


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


def experts_implementation(target: torch.nn.Module, dtype: torch.dtype, device: str) -> str | None:
    """The MoE experts implementation the fast path tells a user to load this target with on `device` (None: no MoE
    experts, or a CPU, where the fast path runs any): `grouped_mm` in bfloat16 on a compute capability 9.x/10.x GPU,
    whose kernel keeps its group offsets on the device, else `batched_mm`."""
    if not str(device).startswith("cuda") or not moe_experts(target):
        return None
    if grouped_mm_stays_on_device(dtype, device):
        return "grouped_mm"
    return "batched_mm"


def shape_drafter_config(shape: str | PublishedShape) -> DFlashConfig:
    """The config of a published shape's drafter, as `random_pair` builds it (`cli_checks.check_bench` reads it too)."""
    from .hub import published_drafters

    spec = RANDOM_SHAPES[shape] if isinstance(shape, str) else shape
    return DFlashConfig(**{**published_drafters()[spec.drafter].config, **spec.drafter_overrides})


def random_pair(
    shape: str | PublishedShape, dtype: torch.dtype, device: str, experts: str | None = None
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A target and drafter of a published shape (a name of RANDOM_SHAPES, or a PublishedShape), randomly initialised
    on `device` itself (no initialisation on the CPU first), set up as the fast path serves the family (attention;
    MoE experts on `experts`, by default `experts_implementation`'s choice). Speed only: tau means nothing here."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = RANDOM_SHAPES[shape] if isinstance(shape, str) else shape
    if experts is not None and not {"num_experts", "num_local_experts"} & spec.config.keys():
        raise ValueError(f"the {spec.target} shape has no MoE experts; drop --experts-implementation")
    config = AutoConfig.for_model(spec.model_type, **spec.config)
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=spec.attn_implementation
        ).eval()
        drafter = DFlashDraftModel._from_config(shape_drafter_config(spec), dtype=dtype).eval()
    experts = experts or experts_implementation(target, dtype, device)
    if experts is not None:
        target.set_experts_implementation(experts)
    return target, drafter


def shape_record(shape: str | PublishedShape, target: torch.nn.Module, drafter: torch.nn.Module) -> dict[str, Any]:
    """What a report says about a `--random-weights` shape: the published ids, the target's fields as built, what was
    changed from the published configs (nothing for RANDOM_SHAPES), and how the target runs."""
    spec = RANDOM_SHAPES[shape] if isinstance(shape, str) else shape
    built = target.config.get_text_config()
    return {
        "target": spec.target,
        "drafter": spec.drafter,
        "target_class": type(target).__name__,
        "target_config": {key: getattr(built, key) for key in spec.config},
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "drafter_config": {key: getattr(drafter.config, key) for key in (
            "num_hidden_layers", "block_size", "target_layer_ids", "layer_types", "sliding_window", "mask_token_id",
        )},
        "drafter_changed_from_published": dict(spec.drafter_overrides),
        "attn_implementation": built._attn_implementation,
        "experts_implementation": built._experts_implementation if moe_experts(target) else None,
    }


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
        from .generate_cli import DEFAULT_DRAFTER, encode, load_target
        from .training.data import load_prompts

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
        batches = _padded_batches(prompts, batch_size, pad_token_id, device, args.own_lengths)
        reference = None
        for method in methods:
            if method == "native" and batch_size > 1:
                skipped.append(f"{setting} native: transformers' DFlash loop runs batch 1 only")
                print(f"{setting:32s} {method:13s} skipped: transformers' DFlash loop runs batch 1 only", flush=True)
                continue
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
                measurement.extra["target_1_token_graph_ms"] = target_1_token_graph_ms(step)
            results.append(measurement)
            print(_row(measurement), flush=True)
        _add_ratios([m for m in results if m.setting == setting])
    words = sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]
    return {
        **run_environment(device),
        "command": "hf-dflash bench " + " ".join(map(portable_path, words)),
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "arguments": {k: portable_path(v) if isinstance(v, str) else v for k, v in vars(args).items() if k != "func"},
        **({"random_weights_shape": shape} if shape is not None else {}),
        **({"skipped": skipped} if skipped else {}),
        "target_1_token_graph_baseline": TARGET_1_TOKEN_BASELINE,
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

    machine = device_name(device)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "hf_dflash": __version__,
                "python": platform.python_version(), **more_versions}
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine, "versions": versions}


def _row(m: Measurement) -> str:
    return (
        f"{m.setting:32s} {m.method:13s} tau {m.tau:5.2f}  {m.tokens_per_s:8.1f} tok/s  {m.ms_per_step:7.2f} ms/step  "
        f"ttft {1000 * m.ttft_s / m.batches:7.1f} ms  identical {m.identical_to_plain}  "
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
    if args.out == DEFAULT_OUT:
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
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy",
                        help="decode with a family's published sampling defaults (qwen3: temperature 0.6, top_k 20, "
                        "top_p 0.95; llama3: temperature 0.6, top_p 0.9), every method alike")
    parser.add_argument("--own-lengths", action="store_true",
                        help="batch 1 only: each prompt at its own length, not left-padded to the longest")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                        help="auto (default): bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="JSON report, in a folder that exists (a .png plot is written beside it)")
    parser.set_defaults(func=run)
