"""Which calls the fast path (the engine's step over its own paged pool; a CUDA graph on a GPU) serves: the reasons a
call runs the step over transformers' cache instead, and the warning that names them.

The fast path (dflash_fast_path.py) serves greedy and sampled decoding (point-mass or rejection sampling, inside the
step, with random numbers a graph replays afresh) under any logits processors generate builds (dflash_processors.py:
those that run on the device, such as temperature, top-k/p/h, min-p, typical-p, repetition penalty and min length,
inside the step's graph; those that read the whole prefix, such as no-repeat n-grams, called on the host, which keeps
that call's steps out of a graph), eos / max-length stopping, any stopping criteria, streamers and output_scores /
output_logits (host hooks around the step: dflash_host_hooks.py), batches padded on the left and between a row's
real tokens (except on hybrid targets: `_mask_blocker`; generate refuses the masks no loop serves, right padding, and
holes on sliding-window targets: `dflash_checks.padding_problem`), a dense (or GGUF-dequantized, or
bitsandbytes-quantized, whose steps run eagerly) target of the families in `FAST_PATH_FAMILIES` (sliding-window
layers included, and under eager attention gpt-oss's attention sinks and Gemma 2's attention softcapping; hybrid
Qwen3-Next / Qwen3.5 / Qwen3.6 targets, whose Gated DeltaNet layers dflash_linear_state.py rolls back inside the step;
MoE experts on a GPU only where their dispatch can be captured) and the drafter (its own sliding layers included) on
one device with sdpa or eager attention. Anything else runs the same step with the target's keys/values in
transformers' cache (dflash_target_cache.py's `TransformersTargetCache`: the target's own attention and masks, no
graph), which gives the same tokens (the same distribution when sampling).

Each reason below is a sentence a user can act on. `takes_fast_path` turns it into the call's choice: a warning once
per reason on a GPU, an error for a call that insists with `generate(..., dflash_fast_path=True)`.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.utils import logging

from .dflash_compat import attention_implementation, experts_implementation
from .dflash_devices import target_devices
from .dflash_linear_state import HYBRID_FAMILIES, hybrid_blocker
from .dflash_masks import FULL, LINEAR, SLIDING, pads_after_real_tokens

logger = logging.get_logger(__name__)

# Target families whose forward the fast path is tested with (4D masks, one per layer type, and the engine's paged
# cache go straight through their attention: tests/test_families.py, greedy identical to plain generate); others keep
# their keys/values in transformers' cache rather than risk a forward that reads the paged cache differently. Beyond
# the families of published drafters: those users train drafters for, whose attention reads only the cache's `update`
# and windows only through the mask (per-layer RoPE, NoPE layers, softcapping and scaled embeddings stay inside their
# own forward).
FAST_PATH_FAMILIES = (
    "llama", "qwen3", "qwen3_moe", "gpt_oss", "mistral", *HYBRID_FAMILIES,
    "qwen2", "gemma", "gemma2", "gemma3_text", "olmo2", "olmo3", "granite", "smollm3", "cohere", "cohere2", "stablelm",
    "starcoder2", "glm4", "glm", "helium", "olmo", "exaone4", "ernie4_5", "seed_oss", "arcee", "apertus", "ministral",
    "phi", "nemotron", "qwen2_moe", "olmoe", "granitemoe", "ernie4_5_moe", "glm4_moe", "dots1",
)
# Families whose models window every layer when the config sets `sliding_window` without `layer_types` (Mistral-style;
# StarCoder2's checkpoints set one). Llama's masks ignore a `sliding_window` set on its config (only transformers'
# cache would apply it).
MISTRAL_STYLE_FAMILIES = ("mistral", "qwen3_moe", "starcoder2")


def target_layer_types(text: Any) -> list[str]:
    """The attention kind of each target layer, as the target's masks apply them: its `layer_types`, or for a
    Mistral-style config (`sliding_window`, no `layer_types`) sliding everywhere."""
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)
    sliding = getattr(text, "sliding_window", None) is not None
    return [SLIDING if sliding else FULL] * text.num_hidden_layers


def quantization_method(target: torch.nn.Module) -> str | None:
    """The method that quantized the target ("bitsandbytes", "gguf", ...), or None for a target loaded unquantized."""
    quantizer = getattr(target, "hf_quantizer", None)
    config = getattr(quantizer, "quantization_config", None) or getattr(target.config, "quantization_config", None)
    if quantizer is None and config is None and not getattr(target, "is_quantized", False):
        return None
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    method = getattr(method, "value", method)  # transformers keeps it as a QuantizationMethod enum
    return str(method) if method else "unknown method"


def bitsandbytes_quantized(target: torch.nn.Module) -> bool:
    """Whether bitsandbytes quantized the target. Its quantized layers compute each row of a verify on its own (4-bit,
    and 8-bit without outlier columns: tests/test_quantized.py), so the engine serves it, with transformers' forward
    and the engine's paged cache; its steps run eagerly, as bitsandbytes' kernels are not tested inside a CUDA graph."""
    return quantization_method(target) == "bitsandbytes"


def _quantization_blocker(target: torch.nn.Module) -> str | None:
    """Why the target's quantization keeps it off the fast path, or None.

    A GGUF checkpoint is marked quantized by transformers even when it was dequantized into plain floating-point
    weights at load time; such a target is dense and served. So is a bitsandbytes one (`bitsandbytes_quantized`).
    Any other quantizer computes through its own layers, which the fast path is not tested with.
    """
    method = quantization_method(target)
    if method is None or method == "bitsandbytes":
        return None
    if method == "gguf" and all(p.is_floating_point() for p in target.parameters()):
        return None
    return f"the target is quantized ({method}); the paged cache is tested with bitsandbytes' quantized layers only"


def _window_blocker(text: Any) -> str | None:
    """Why the fast path's masks cannot window this target's layers as its own forward does, or None."""
    family = text.model_type
    unknown = sorted(set(target_layer_types(text)) - {FULL, SLIDING, LINEAR})
    if unknown:
        return (
            f"the {family} target has {', '.join(unknown)} layers (the fast path serves full, sliding and linear "
            "attention only)"
        )
    window = getattr(text, "sliding_window", None)
    if getattr(text, "layer_types", None) is None and window is not None and family not in MISTRAL_STYLE_FAMILIES:
        return (
            f"the {family} target's config sets sliding_window={window} without layer_types, which "
            f"{family} models do not apply in their masks (only transformers' cache would); drop it from the config"
        )
    return None


def moe_experts(target: torch.nn.Module) -> list[torch.nn.Module]:
    """The target's MoE expert modules, those transformers dispatches by `experts_implementation`."""
    return [m for m in target.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "num_experts")]


def grouped_mm_stays_on_device(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether torch's grouped matmul reads its group offsets on the device (so a CUDA graph can hold it): bfloat16 on
    compute capability 9.x/10.x (its CUTLASS kernel); elsewhere torch and transformers copy them to the host."""
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)


def _experts_blocker(target: torch.nn.Module, device: torch.device) -> str | None:
    """Why the target's MoE experts cannot run inside a CUDA graph, or None (always None off CUDA: the fast path runs
    there without a graph).

    transformers dispatches experts by `config._experts_implementation`. "eager" loops over the experts that
    `nonzero` finds hit (a host synchronization and a data-dependent number of kernels per layer); "batched_mm"
    gathers each routed pair's weights and runs fixed-shape batched matmuls (nothing on the host); "grouped_mm" sorts
    and counts on the device and runs torch's grouped matmul, whose CUTLASS kernel reads the group offsets on the
    device for bfloat16 on compute capability 9.x/10.x; for other dtypes and GPUs torch (and transformers' own
    fallback) copy the offsets to the host.
    """
    experts = moe_experts(target)
    if device.type != "cuda" or not experts:
        return None
    implementation = experts_implementation(target.config.get_text_config()) or "eager"
    if implementation == "batched_mm":
        return None
    if implementation == "grouped_mm":
        dtype, capability = experts[0].gate_up_proj.dtype, torch.cuda.get_device_capability(device)
        if grouped_mm_stays_on_device(dtype, device):
            return None
        return (
            f"the target's MoE experts run grouped_mm, which for {dtype} weights on compute capability "
            f"{capability[0]}.{capability[1]} copies its group sizes to the host (only bfloat16 on 9.x/10.x stays on "
            "the device), so a CUDA graph cannot hold it; load the target with experts_implementation='batched_mm'"
        )
    if implementation == "eager":
        return (
            "the target's MoE experts run 'eager', which finds the routed experts on the host every layer, so a CUDA "
            "graph cannot hold it; load the target with experts_implementation='batched_mm' (or 'grouped_mm' in "
            "bfloat16 on a compute capability 9.x/10.x GPU)"
        )
    return (
        f"the target's MoE experts run {implementation!r}, which the fast path is not tested with inside a CUDA graph; "
        "load the target with experts_implementation='batched_mm'"
    )


def fast_path_blocker(
    target: torch.nn.Module,
    drafter: torch.nn.Module,
    attention_mask: torch.Tensor,
) -> str | None:
    """Why the fast path cannot serve this call, with the fix when there is one; None when it can."""
    text = target.config.get_text_config()
    # where each part computes: an offloaded part's weights sit on the meta device, and accelerate brings them in
    devices = {*target_devices(target), *(p.device for p in drafter.parameters())}
    if len(devices) != 1:
        return (
            f"the target and drafter compute on {', '.join(sorted(map(str, devices)))}; the fast path needs one device "
            "(load both on one GPU)"
        )
    if text.model_type not in FAST_PATH_FAMILIES:
        return f"the fast path is tested with {', '.join(FAST_PATH_FAMILIES)} targets, not {text.model_type!r}"
    if text.model_type in HYBRID_FAMILIES and (hybrid := hybrid_blocker(target)) is not None:
        return hybrid
    windows = _window_blocker(text)
    if windows is not None:
        return windows
    quantized = _quantization_blocker(target)
    if quantized is not None:
        return quantized
    if attention_implementation(text) not in ("sdpa", "eager"):
        return (
            f"the target uses {attention_implementation(text)!r} attention (the fast path needs sdpa or eager: load it "
            "with attn_implementation='sdpa')"
        )
    if attention_implementation(text) != "eager" and any(hasattr(m, "sinks") for m in target.modules()):
        # gpt-oss passes its sinks to the attention function as `s_aux`; transformers' sdpa function ignores it
        return (
            f"the target has attention sinks, which {attention_implementation(text)!r} attention drops (load it with "
            "attn_implementation='eager')"
        )
    if attention_implementation(text) != "eager" and getattr(text, "attn_logit_softcapping", None) is not None:
        # Gemma 2 passes it to the attention function as `softcap`; transformers' sdpa function ignores it (from
        # transformers 5.25 Gemma 2 refuses to load with sdpa; 5.17 loads it and drops the softcapping)
        return (
            f"the target softcaps its attention logits, which {attention_implementation(text)!r} attention drops "
            "(load it with attn_implementation='eager')"
        )
    experts = _experts_blocker(target, next(iter(devices)))
    if experts is not None:
        return experts
    return _mask_blocker(text, attention_mask)


def _mask_blocker(text: Any, attention_mask: torch.Tensor) -> str | None:
    """Why the engine, which drops each row's padding and prefills its real tokens at positions 0..n-1, would not give
    plain generate's tokens for this mask, or None. (Masks neither loop can serve, a row that ends in padding or
    padding between real tokens on a sliding-window target, are refused before: `dflash_checks.padding_problem`.)

    Plain generate numbers a row's real tokens cumsum(mask) - 1 and hides its padding from every query, so under left
    padding, and under padding between the real tokens of a row that ends in a real token, each token sees the real
    tokens before it at the positions the compacted row gives them. Gated DeltaNet layers break that: they run every
    column, and decay their state across padding that follows real tokens.
    """
    if pads_after_real_tokens(attention_mask) and LINEAR in target_layer_types(text):
        return (
            "the attention mask has padding after real tokens: the fast path drops a row's padding, while the "
            "target's linear-attention layers decay their state across padding that follows real tokens (pad "
            "prompts on the left)"
        )
    return None


def takes_fast_path(insist: bool | None, blocker: str | None, device: torch.device) -> bool:
    """Whether a call takes the fast path: `insist` is generate's `dflash_fast_path` (None: whenever it can).

    A GPU call that the fast path cannot serve says why once per reason (a logged warning: there a step over
    transformers' cache, without a graph, costs several times more); one that insists on it is an error instead. On
    a CPU both run eagerly at about the same cost per step, so such a call goes without a warning.
    """
    if insist and blocker is not None:
        raise ValueError(f"dflash_fast_path=True, but the fast path cannot serve this call: {blocker}")
    if insist is None and blocker is not None and device.type == "cuda":
        logger.warning_once(
            f"DFlash: this call keeps the target's keys/values in transformers' cache and runs each step without a "
            f"CUDA graph, because {blocker}. The tokens are the same; each verify step costs several times more. Pass "
            "dflash_fast_path=False to choose this without the warning."
        )
    return bool(insist) or (insist is None and blocker is None)


__all__ = [
    "FAST_PATH_FAMILIES", "MISTRAL_STYLE_FAMILIES", "bitsandbytes_quantized", "fast_path_blocker",
    "grouped_mm_stays_on_device", "moe_experts", "quantization_method", "takes_fast_path", "target_layer_types",
]
