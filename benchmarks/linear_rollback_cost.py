"""What rolling back a Gated DeltaNet layer after a verify costs, two ways, at a real published shape (CPU, fp32).

A verify feeds B rows through every linear-attention layer; the sequence keeps only the first a + 1. Ways to leave
the layer's conv and recurrent states where plain decoding would:
- per-position states (ours, and what vLLM and SGLang keep for these layers): run the B rows through the layer's
  single-token decode step one at a time and keep the states after each; pick row a's afterwards.
- re-advance: keep the states before the block, run the B rows as one chunk; after acceptance restore the states and
  run the layer again over the a + 1 accepted rows.
One layer at Qwen3-Next-80B-A3B's shape (transformers' default Qwen3NextConfig: the target of Qwen3-Coder-Next-DFlash)
and at Qwen3.5-4B's (hidden 2560), batch 1, B = 16, with the accepted count a = 7. Also the state bytes per sequence and layer.

    python benchmarks/linear_rollback_cost.py   # writes results/linear_rollback_cost_cpu.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import AutoConfig
from transformers.cache_utils import DynamicCache

from hf_dflash.bench import run_environment

RESULT = Path(__file__).parent / "results" / "linear_rollback_cost_cpu.json"

SHAPES = {
    # transformers' default Qwen3NextConfig is Qwen3-Next-80B-A3B's shape
    "qwen3_next (Qwen3-Next-80B-A3B)": ("qwen3_next", {}),
    # Qwen3.5-4B: hidden 2560 and 32 layers (its drafter's config); linear heads as transformers' default
    # Qwen3_5TextConfig (16 key and 32 value heads of 128), not read from the Hub
    "qwen3_5_text (Qwen3.5-4B)": ("qwen3_5_text", dict(hidden_size=2560)),
}
BLOCK, ACCEPTED, REPEATS = 16, 7, 5


def layer_and_cache(model_type: str, overrides: dict) -> tuple[torch.nn.Module, DynamicCache, AutoConfig]:
    """One Gated DeltaNet layer (layer 0, a linear-attention layer) and a cache for it."""
    config = AutoConfig.for_model(model_type, num_hidden_layers=4, **overrides)
    if model_type == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet as GatedDeltaNet
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet as GatedDeltaNet
    return GatedDeltaNet(config, layer_idx=0).eval(), DynamicCache(config=config), config


def full_depth_layer_types(model_type: str, overrides: dict) -> list[str]:
    return AutoConfig.for_model(model_type, **overrides).layer_types


def timed(fn) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    return (time.perf_counter() - start) / REPEATS * 1e3


@torch.no_grad()
def measure(model_type: str, overrides: dict) -> dict:
    layer, cache, config = layer_and_cache(model_type, overrides)
    hidden = torch.randn(1, 64, config.hidden_size)
    layer(hidden, cache=cache)  # a 64-token prompt: the states exist
    state = cache.layers[0]
    conv0, rec0 = state.conv_states[0].clone(), state.recurrent_states[0].clone()
    block = torch.randn(1, BLOCK, config.hidden_size)

    def restore() -> None:
        state.conv_states[0].copy_(conv0)
        state.recurrent_states[0].copy_(rec0)

    def per_position() -> None:
        restore()
        kept = []
        for row in range(BLOCK):
            layer(block[:, row : row + 1], cache=cache)
            kept.append((state.conv_states[0].clone(), state.recurrent_states[0].clone()))
        state.conv_states[0].copy_(kept[ACCEPTED][0])
        state.recurrent_states[0].copy_(kept[ACCEPTED][1])

    def chunk_only() -> None:
        restore()
        layer(block, cache=cache)

    def re_advance() -> None:
        restore()
        before = (state.conv_states[0].clone(), state.recurrent_states[0].clone())
        layer(block, cache=cache)
        state.conv_states[0].copy_(before[0])
        state.recurrent_states[0].copy_(before[1])
        layer(block[:, : ACCEPTED + 1], cache=cache)

    def one_token() -> None:
        restore()
        layer(block[:, :1], cache=cache)

    conv_bytes = state.conv_states[0].numel() * 2  # bf16 in a bf16 model
    recurrent_bytes = state.recurrent_states[0].numel() * state.recurrent_states[0].element_size()
    weights = sum(p.numel() for p in layer.parameters())
    return {
        "one_token_decode_ms": round(timed(one_token), 2),
        "chunk_of_B_no_rollback_ms": round(timed(chunk_only), 2),
        "per_position_states_ms": round(timed(per_position), 2),
        "re_advance_ms": round(timed(re_advance), 2),
        "state_bytes_per_sequence": conv_bytes + recurrent_bytes,
        "per_position_extra_bytes_per_sequence": BLOCK * (conv_bytes + recurrent_bytes),
        "layer_weight_bytes_bf16": weights * 2,
        "linear_layers_in_the_full_model": sum(t == "linear_attention" for t in full_depth_layer_types(model_type, overrides)),
    }


def main() -> None:
    torch.set_num_threads(2)
    results = {name: measure(model_type, overrides) for name, (model_type, overrides) in SHAPES.items()}
    report = {**run_environment("cpu"), "block": BLOCK, "accepted": ACCEPTED, "threads": 2, "shapes": results}
    RESULT.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
