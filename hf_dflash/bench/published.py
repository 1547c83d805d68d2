"""The published models `hf-dflash bench` builds with random weights, and the sampling defaults families publish.

A `--random-weights` shape is a published target's config (its config.json; the text model of a multimodal
checkpoint) with the published DFlash drafter for it (its config in hub_configs/), built on the device itself and
set up as the fast path serves the family (attention; MoE experts on what the fast path tells a user to load them
with on that device). Random weights commit about one token per step, so these shapes measure the cost of a step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..modeling import DFlashConfig, DFlashDraftModel, dflash_compat


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


def experts_implementation(target: torch.nn.Module, dtype: torch.dtype, device: str) -> str | None:
    """The MoE experts implementation the fast path tells a user to load this target with on `device` (None: no MoE
    experts, or a CPU, where the fast path runs any): `grouped_mm` in bfloat16 on a compute capability 9.x/10.x GPU,
    whose kernel keeps its group offsets on the device, else `batched_mm`."""
    from ..modeling.dflash_fast_path_blockers import grouped_mm_stays_on_device, moe_experts

    if not str(device).startswith("cuda") or not moe_experts(target):
        return None
    if grouped_mm_stays_on_device(dtype, device):
        return "grouped_mm"
    return "batched_mm"


def shape_drafter_config(shape: str | PublishedShape) -> DFlashConfig:
    """The config of a published shape's drafter, as `random_pair` builds it (`cli_checks.check_bench` reads it too)."""
    from ..hub import published_drafters

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
        drafter = dflash_compat.model_from_config(DFlashDraftModel, shape_drafter_config(spec), dtype=dtype).eval()
    experts = experts or experts_implementation(target, dtype, device)
    if experts is not None:
        target.set_experts_implementation(experts)
    return target, drafter


def shape_record(shape: str | PublishedShape, target: torch.nn.Module, drafter: torch.nn.Module) -> dict[str, Any]:
    """What a report says about a `--random-weights` shape: the published ids, the target's fields as built, what was
    changed from the published configs (nothing for RANDOM_SHAPES), and how the target runs."""
    from ..modeling.dflash_fast_path_blockers import moe_experts

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
        "attn_implementation": dflash_compat.attention_implementation(built),
        "experts_implementation": dflash_compat.experts_implementation(built) if moe_experts(target) else None,
    }




# A shape scaled down for a CPU: every published field kept but widths, depth, vocabulary and expert count, with
# windows small enough to bind; the drafter follows the target (two layers: the published first and last types).
SCALED_VOCAB = 512
SCALED_WIDTHS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
SCALED_TARGETS = {
    "qwen3-8b": dict(num_hidden_layers=4),
    "gpt-oss-20b": dict(
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4,
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
    ),
    "qwen3.5-4b": dict(
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    ),
    "qwen3-coder-30b-a3b": dict(num_hidden_layers=4, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
}


def scaled_down(name: str) -> PublishedShape:
    """`name`'s published shape scaled down (see SCALED_TARGETS): the target narrower and shallower, its drafter
    following it, every other field as published."""
    from ..hub import published_drafters

    shape = RANDOM_SHAPES[name]
    target = {**shape.config, **SCALED_WIDTHS, "vocab_size": SCALED_VOCAB, **SCALED_TARGETS[name]}
    drafter = published_drafters()[shape.drafter].config
    published_types = drafter.get("layer_types") or ["full_attention"]
    overrides = dict(
        SCALED_WIDTHS, target_hidden_size=SCALED_WIDTHS["hidden_size"], num_hidden_layers=2,
        layer_types=[published_types[0], published_types[-1]], num_target_layers=4, target_layer_ids=[1, 2],
        vocab_size=SCALED_VOCAB, mask_token_id=SCALED_VOCAB - 1,
    )
    if drafter.get("sliding_window") is not None:
        overrides["sliding_window"] = 5
    if "dflash_config" in drafter:  # the published file keeps ids in dflash_config: override them there too
        overrides["dflash_config"] = {**drafter["dflash_config"], "mask_token_id": SCALED_VOCAB - 1,
                                      "target_layer_ids": [1, 2]}
    return dataclasses.replace(shape, config=target, drafter_overrides=overrides)
