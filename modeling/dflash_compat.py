"""Every use of transformers' (and torch's) private or version-dependent API in hf-dflash, each behind one name.

The rest of the project calls these functions and classes and touches no underscore name of transformers, torch or
accelerate itself (tests/test_compat.py scans the source and fails otherwise), so a new transformers release shows
in this one file what it breaks. Each entry says what it touches, why DFlash needs it, and which transformers
versions need it; the supported range is 5.17 to 5.25, and "all" below means every version of that range.

Threads. Nothing here swaps a process-wide name for the duration of a call:
- `recording_chunk_rule`: the Gated DeltaNet modeling files call their chunked rule through a module-level name
  (not an attribute of the layer), so the name is pointed once, for good, at a pass-through that records the rule's
  arguments only for the thread inside `recording_chunk_rule`; every other call runs the rule unchanged.
- `set_attention_implementation`: rewrites one model's config; dflash_attention.py's function behaves as plain sdpa
  in any thread but the one that switched it, and is registered with sdpa's mask builder for those threads' masks.
- `dynamo_cache_size_limit`: torch's `config.patch`, whose patched values are thread-local in recent torch (2.13
  documents it); where they are not, another thread's compile meanwhile may only keep more compiled versions.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

# ---- configs -------------------------------------------------------------------------------------------------------


def attention_implementation(config: Any) -> str | None:
    """The attention implementation a config's modules dispatch on (`config._attn_implementation`, all versions;
    transformers has no public getter). None for a config that has none (a vision tower's, a plain object)."""
    return getattr(config, "_attn_implementation", None)


def has_attention_implementation(config: Any) -> bool:
    """Whether `config` is one that modules read an attention implementation from (all versions)."""
    return config is not None and hasattr(config, "_attn_implementation")


def set_attention_implementation(config: Any, name: str) -> None:
    """Make `config`'s modules dispatch attention to `name`, for this config only: writes
    `config._attn_implementation_internal` (all versions), because the public setter (`_attn_implementation = ...`)
    also rewrites sub-configs that use another implementation. Used by dflash_attention.py's `grouped_attention`."""
    config._attn_implementation_internal = name


def experts_implementation(config: Any) -> str | None:
    """How a MoE config's experts run ("eager", "batched_mm", "grouped_mm"), read from `config._experts_implementation`
    (all versions; set by `from_pretrained(experts_implementation=...)` / `set_experts_implementation`, with no public
    getter). None for a config without experts."""
    return getattr(config, "_experts_implementation", None)


def register_attention(name: str, function: Callable[..., Any]) -> None:
    """Register `function` in transformers' AttentionInterface under `name`, with sdpa's mask builder in its mask
    interface: a model whose config names `name` then gets the same masks as under sdpa. Without the mask entry,
    transformers (all versions) builds no mask at all for an implementation it does not know, so a forward of another
    thread that read the switched config (dflash_attention.py) would attend without its causal mask."""
    AttentionInterface.register(name, function)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


def default_generation_params(generation_config: Any) -> dict[str, Any]:
    """The values generate fills unset generation fields with (`GenerationConfig._get_default_generation_params`, all
    versions; no public equivalent): DFlash refuses an assistant setting only when it differs from them."""
    return generation_config._get_default_generation_params()


def pad_token_tensor(generation_config: Any) -> torch.Tensor | None:
    """The pad token id as generate prepared it for this call (`generation_config._pad_token_tensor`, all versions):
    eos when no pad token is set, exactly the id plain generate pads finished sequences with."""
    return generation_config._pad_token_tensor


# ---- models and the Hub --------------------------------------------------------------------------------------------


def model_from_config(model_class: type, config: Any, **kwargs: Any) -> torch.nn.Module:
    """A randomly initialised `model_class` built from `config` through `PreTrainedModel._from_config` (all versions),
    which takes `dtype` and the attention implementation as `from_pretrained` does; the Auto classes' public
    `from_config` needs the class registered for the config's model type."""
    return model_class._from_config(config, **kwargs)


def upload_folder(model: Any, folder: str, repo_id: str, **kwargs: Any) -> Any:
    """Upload every file of `folder` to `repo_id` in one commit, through `PushToHubMixin._upload_modified_files` (all
    versions, same signature), the step of transformers' own `push_to_hub` after it saved the folder; DFlash saves its
    own folder (model card, remote-code bundle) and uploads it the same way. `kwargs`: commit_message, token,
    create_pr, revision, commit_description. Returns the commit info."""
    return model._upload_modified_files(folder, repo_id, files_timestamps={}, **kwargs)


def accelerate_hook(module: torch.nn.Module) -> Any:
    """accelerate's hook on a dispatched or offloaded module (`module._hf_hook`; transformers 5.x with any accelerate
    that dispatches), or None: it names the device the module computes on when its weights sit on the meta device."""
    return getattr(module, "_hf_hook", None)


# ---- the forward's cache argument ----------------------------------------------------------------------------------

# The names a causal LM's forward and generate's model kwargs give the cache: `cache` from transformers 5.24,
# `past_key_values` before.
CACHE_ARGUMENTS = ("cache", "past_key_values")


def cache_argument(model: torch.nn.Module) -> str:
    """The name `model.forward` takes its cache under: "cache" from transformers 5.24, "past_key_values" before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_from_kwargs(model_kwargs: dict[str, Any]) -> Any:
    """The cache among generate's model kwargs, under either name (see `CACHE_ARGUMENTS`), or None."""
    return model_kwargs.get("cache", model_kwargs.get("past_key_values"))


# ---- transformers' cache layers (DynamicCache.layers) --------------------------------------------------------------


def is_linear_cache_layer(layer: Any) -> bool:
    """Whether a cache layer keeps linear-attention states (transformers' `LinearAttentionLayer`, which holds
    `conv_states` / `recurrent_states`; all versions) rather than keys and values."""
    return hasattr(layer, "recurrent_states") or hasattr(layer, "conv_states")


def is_dynamic_layer(layer: Any) -> bool:
    """Whether a cache layer is a `DynamicLayer` (or its sliding-window subclass): keys/values that grow and crop."""
    return isinstance(layer, DynamicLayer)


def full_history_layer() -> Any:
    """A fresh `DynamicLayer`: DFlash puts one in place of a `DynamicSlidingWindowLayer` (which keeps only the last
    W - 1 slots and cannot crop past them) and applies the window through its masks (dflash_target_cache.py)."""
    return DynamicLayer()


def drop_front_slots(layer: Any, count: int) -> None:
    """Drop the first `count` slots of a `DynamicLayer`'s keys and values (b, g, L, d) (its `keys` / `values`
    attributes, all versions; transformers crops only from the end)."""
    layer.keys = layer.keys[:, :, count:]
    layer.values = layer.values[:, :, count:]


def forward_hook_count(module: torch.nn.Module) -> int:
    """The forward hooks and pre-hooks registered on `module` itself (torch keeps them in private dicts)."""
    return len(module._forward_hooks) + len(module._forward_pre_hooks)


def linear_states(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear-attention cache layer's conv state (b, conv_dim, K) and recurrent state (b, heads, dk, dv): entry 0 of
    its `conv_states` / `recurrent_states` (all versions; the Gated DeltaNet layers keep one state of each)."""
    return layer.conv_states[0], layer.recurrent_states[0]


def set_linear_states(layer: Any, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
    """Replace a linear-attention cache layer's states (see `linear_states`): the layer then reads and updates these
    tensors in place."""
    layer.conv_states[0], layer.recurrent_states[0] = conv, recurrent


def linear_token_count(layer: Any) -> torch.Tensor | None:
    """The tokens a linear-attention cache layer has read (`cumulative_length_linear`, a 0-dim tensor, from
    transformers 5.25; None before). From 5.25 it is what `cache.get_seq_length()` reports when layer 0 is linear
    (Qwen3.5, Qwen3-Next), so DFlash counts the rows each verify kept (dflash_target_cache.py)."""
    return getattr(layer, "cumulative_length_linear", None)


def set_linear_token_count(layer: Any, count: torch.Tensor) -> None:
    """Set the count of `linear_token_count` (5.25 on; only called where it returned a tensor)."""
    layer.cumulative_length_linear.copy_(count)


# ---- transformers' linear-attention cache methods, for a cache of DFlash's own -------------------------------------


@dataclass
class LinearLayerView:
    """transformers 5.17's view of a linear layer's cache entry (`cache.layers[i]`: its modeling code reads
    `conv_states[0]`, `recurrent_states[0]` and `record_past` there), over a cache's own buffers."""

    conv_states: list[torch.Tensor]
    recurrent_states: list[torch.Tensor]
    record_past: bool = False


class LinearAttentionCacheMethods:
    """The methods through which transformers' Gated DeltaNet layers talk to their cache, for a cache of our own
    (dflash_linear_state.py's `LinearStates`, in each of DFlash's loops). They were renamed between versions: 5.17 calls
    `has_previous_state`, `update_conv_state`, `update_recurrent_state` and reads `layers[i]` (`LinearLayerView`);
    5.24 calls `get_conv_state`, `get_recurrent_state`, `is_recording_past`; 5.25 adds
    `get_recurrent_states_to_keep` and `increase_count`. All are spoken here over what the subclass provides:

    - `conv`, `recurrent`: layer index -> that layer's state tensor;
    - `fresh`: True while the layers must see no previous state (the prompt's forward);
    - `conv_window(inputs, layer_idx)`: [conv state | inputs] for the layer's causal conv;
    - `keep_recurrent_state(state, layer_idx)`: take the state after the forward's rows; returns the kept tensor.
    """

    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]
    fresh: bool

    def conv_window(self, inputs: torch.Tensor, layer_idx: int) -> torch.Tensor:
        raise NotImplementedError

    def keep_recurrent_state(self, state: torch.Tensor, layer_idx: int) -> torch.Tensor:
        raise NotImplementedError

    def linear_layer_views(self, num_layers: int) -> list[LinearLayerView | None]:
        """What 5.17 reads as `cache.layers`: a view per linear layer over this cache's buffers, None elsewhere."""
        return [
            LinearLayerView([self.conv[i]], [self.recurrent[i]]) if i in self.conv else None for i in range(num_layers)
        ]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self.conv[layer_idx]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self.recurrent[layer_idx]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """0: no per-row recurrent states. From 5.25 a multi-row forward runs its last k rows one at a time through the
        recurrent rule to hand the cache k states for a later crop; DFlash instead reruns the chunked rule up to each
        sequence's accepted rows, which needs the whole block in one chunked call (`recording_chunk_rule`)."""
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """Nothing to count: 5.25's one-row conv path tells the cache it consumed a token; DFlash keeps each
        sequence's length itself and passes the positions."""

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return not self.fresh

    def update_conv_state(
        self, inputs: torch.Tensor, layer_idx: int, conv_kernel_size: int | None = None, **kwargs: Any
    ) -> torch.Tensor:
        return self.conv_window(inputs, layer_idx)

    def update_recurrent_state(self, state: torch.Tensor, layer_idx: int, **kwargs: Any) -> torch.Tensor:
        return self.keep_recurrent_state(state, layer_idx)


# ---- the Gated DeltaNet chunked rule -------------------------------------------------------------------------------

# The module-level name under which transformers' hybrid modeling files (qwen3_next, qwen3_5, qwen3_5_moe; all
# versions) call the chunked gated delta rule: transformers' kernel dispatcher (flash-linear-attention's kernel when
# installed, else its PyTorch code). Their layers hold no reference of their own to it.
CHUNK_RULE = "torch_chunk_gated_delta_rule"
# Per thread: the function that records the chunked rule's calls of this thread (`recording_chunk_rule`), if any.
_CHUNK_RULE_CALLS = threading.local()
_CHUNK_RULE_INSTALL = threading.Lock()


def _modeling_module(layer: torch.nn.Module) -> Any:
    return sys.modules[type(layer).__module__]


def chunk_rule_reachable(layer: torch.nn.Module) -> bool:
    """Whether the modeling file of a Gated DeltaNet `layer` calls its chunked rule under `CHUNK_RULE` (all supported
    versions do; a later one that does not leaves DFlash unable to record it, and its rollback with it)."""
    return callable(getattr(_modeling_module(layer), CHUNK_RULE, None))


def _record_calls(rule: Callable[..., Any]) -> Callable[..., Any]:
    """`rule`, reporting each call to the recorder of the calling thread first (when it has one)."""

    @functools.wraps(rule)
    def run(*args: Any, **kwargs: Any) -> Any:
        record = getattr(_CHUNK_RULE_CALLS, "record", None)
        if record is not None:
            record(rule, args, kwargs)
        return rule(*args, **kwargs)

    run.dflash_records_calls = True
    return run


@contextmanager
def recording_chunk_rule(
    layers: list[torch.nn.Module], record: Callable[[Callable[..., Any], tuple, dict], None]
) -> Iterator[None]:
    """Within, every call of the chunked gated delta rule made by this thread (the Gated DeltaNet `layers` of a
    verify) is reported as `record(rule, args, kwargs)` before it runs unchanged; DFlash's rollback needs the
    arguments (queries, keys, values, g, beta) to advance each sequence's state over its accepted rows only
    (dflash_linear_state.py), and transformers hands them to no cache method (all versions).

    The modeling files call the rule through a module-level name, so that name is pointed, once per modeling module
    and for good, at a pass-through (`_record_calls`) that reports only to the recorder of the calling thread: other
    threads' forwards, of this target or another of the same family, run the rule as before and are never recorded."""
    for module in {_modeling_module(layer) for layer in layers}:
        with _CHUNK_RULE_INSTALL:
            rule = getattr(module, CHUNK_RULE)
            if not getattr(rule, "dflash_records_calls", False):
                setattr(module, CHUNK_RULE, _record_calls(rule))
    previous = getattr(_CHUNK_RULE_CALLS, "record", None)
    _CHUNK_RULE_CALLS.record = record
    try:
        yield
    finally:
        _CHUNK_RULE_CALLS.record = previous


# ---- torch -----------------------------------------------------------------------------------------------------------


@contextmanager
def dynamo_cache_size_limit(limit: int) -> Iterator[None]:
    """torch.compile keeps up to `limit` compiled versions per function within (`torch._dynamo.config.patch`, any
    torch this project supports; its patched values are thread-local in recent torch, 2.13 documents it). The fast
    path compiles its drafter pass once per batch size and cache length a process runs, more than dynamo's default
    of 8."""
    with torch._dynamo.config.patch(cache_size_limit=limit):
        yield


def sdpa_backends_enabled() -> tuple[bool, bool, bool, bool]:
    """Whether torch's flash, memory-efficient, cuDNN and math sdpa backends are enabled, read as torch.compile can
    trace them (`torch._C._get_*_sdp_enabled`; `torch.backends.cuda.*_sdp_enabled()` are not traceable)."""
    return (
        torch._C._get_flash_sdp_enabled(), torch._C._get_mem_efficient_sdp_enabled(),
        torch._C._get_cudnn_sdp_enabled(), torch._C._get_math_sdp_enabled(),
    )


def sdpa_backend_choice(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, dropout: float, scale: float | None
) -> int:
    """The SDPBackend number torch's sdpa dispatcher picks for this call with grouped heads (`torch._fused_sdp_choice`,
    the function `scaled_dot_product_attention` itself consults; torch has no public way to ask)."""
    return torch._fused_sdp_choice(query, key, value, mask, dropout, False, scale=scale, enable_gqa=True)


def distribution_checks_default() -> bool:
    """Whether torch.distributions validates arguments by default (`Distribution._validate_args`; the public setter
    `set_default_validate_args` has no getter), so a temporary change can be put back."""
    return torch.distributions.Distribution._validate_args


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place modification counter (`Tensor._version`): a cached copy of a weight is stale once it
    moved."""
    return tensor._version


def onednn_pack_linear_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` (out, in) reordered into oneDNN's blocked layout for products of about `rows` rows
    (`torch.ops.mkldnn._reorder_linear_weight`, the op inductor's CPU freezing packs float32 linears with; all the
    torch versions this project supports have it, and dflash_cpu_linears.py tries it before relying on it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def onednn_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) times a weight packed by `onednn_pack_linear_weight`, plus `bias`: (..., out)
    (`torch.ops.mkldnn._linear_pointwise` with no fused activation)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


__all__ = [
    "CACHE_ARGUMENTS", "CHUNK_RULE", "LinearAttentionCacheMethods", "LinearLayerView", "accelerate_hook",
    "attention_implementation", "cache_argument", "cache_from_kwargs", "chunk_rule_reachable",
    "default_generation_params", "distribution_checks_default", "drop_front_slots", "dynamo_cache_size_limit",
    "experts_implementation", "forward_hook_count", "full_history_layer",
    "has_attention_implementation", "is_dynamic_layer", "is_linear_cache_layer", "linear_states",
    "linear_token_count", "model_from_config", "onednn_linear", "onednn_pack_linear_weight", "pad_token_tensor",
    "recording_chunk_rule", "register_attention", "sdpa_backend_choice", "sdpa_backends_enabled",
    "set_attention_implementation", "set_linear_states", "set_linear_token_count", "tensor_version", "upload_folder",
]
