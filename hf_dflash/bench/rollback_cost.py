"""What rolling a Gated DeltaNet layer back after a verify costs, each exact way, at real published shapes (CPU).

A verify feeds B = 16 rows through every linear-attention layer; each sequence keeps only its first a + 1 (the
anchor and its accepted drafts). The layer's conv and recurrent states must then be those after the kept rows.
One layer (transformers' own class, its PyTorch kernels), at Qwen3-Next-80B-A3B's shape (transformers' default
Qwen3NextConfig: the target of Qwen3-Coder-Next-DFlash) and Qwen3.5-4B's (hidden 2560), float32, median ms:
- the ways first weighed for the eager loop, batch 1, a = 7: the one-token decode step; the block as one chunk (no
  rollback); per-position states (the B rows through the one-token step one at a time, the states after each kept,
  row a's picked: what vLLM and SGLang keep for these layers); re-advance (the states before the block kept, the chunk
  run, then the states restored and the layer run again over the a + 1 kept rows). Also the state bytes per sequence.
- the ways weighed for the fast path, batch 1 (8 rows kept) and batch 4 (1, 5, 9 and 16 kept: ragged), each without a
  host sync or a data-dependent shape except the last: the masked chunk re-run (`LinearStates.commit`, the rule every
  loop now uses: the chunked rule again over the B rows from the states before the block, g and beta zeroed past each
  row's count); the masked B-step loop (the same inputs through transformers' token-by-token recurrent rule);
  re-advance through the layer (its forward again over the kept rows, one call per distinct count; projections
  included). The masked ways are checked to leave the same states before anything is timed.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Any

import torch

from ..modeling.dflash_compat import linear_states, set_linear_states
from . import harness

SHAPES = {
    # transformers' default Qwen3NextConfig is Qwen3-Next-80B-A3B's shape
    "qwen3_next (Qwen3-Next-80B-A3B)": ("qwen3_next", {}),
    # Qwen3.5-4B: hidden 2560 (its drafter's config); linear heads as transformers' default Qwen3_5TextConfig
    # (16 key and 32 value heads of 128)
    "qwen3_5_text (Qwen3.5-4B)": ("qwen3_5_text", dict(hidden_size=2560)),
}
BLOCK, ACCEPTED = 16, 7
KEPT = {1: [8], 4: [1, 5, 9, 16]}  # batch -> rows kept per sequence (anchor + accepted drafts) on the fast path
PROMPT = 64  # tokens before the block: the states exist


def cache_keyword(layer: torch.nn.Module) -> str:
    """The name under which the layer's forward takes its cache: `cache` from transformers 5.24, `cache_params`
    before."""
    return "cache" if "cache" in inspect.signature(type(layer).forward).parameters else "cache_params"


def layer_and_cache(model_type: str, overrides: dict) -> tuple[torch.nn.Module, Any, Any]:
    """One Gated DeltaNet layer (layer 0, a linear-attention layer), transformers' cache for it, and the config."""
    from transformers import AutoConfig
    from transformers.cache_utils import DynamicCache

    config = AutoConfig.for_model(model_type, num_hidden_layers=4, **overrides)
    if model_type == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet as GatedDeltaNet
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet as GatedDeltaNet
    return GatedDeltaNet(config, layer_idx=0).eval(), DynamicCache(config=config), config


@torch.no_grad()
def eager_loop_ways(model_type: str, overrides: dict, time: Any) -> dict[str, Any]:
    from transformers import AutoConfig

    layer, cache, config = layer_and_cache(model_type, overrides)
    keyword = cache_keyword(layer)
    layer(torch.randn(1, PROMPT, config.hidden_size), **{keyword: cache})
    state = cache.layers[0]
    conv0, rec0 = (t.clone() for t in linear_states(state))
    block = torch.randn(1, BLOCK, config.hidden_size)

    def restore() -> None:
        for held, saved in zip(linear_states(state), (conv0, rec0)):
            held.copy_(saved)

    def one_token() -> None:
        restore()
        layer(block[:, :1], **{keyword: cache})

    def chunk_only() -> None:
        restore()
        layer(block, **{keyword: cache})

    def per_position() -> None:
        restore()
        kept = []
        for row in range(BLOCK):
            layer(block[:, row : row + 1], **{keyword: cache})
            kept.append(tuple(t.clone() for t in linear_states(state)))
        for held, saved in zip(linear_states(state), kept[ACCEPTED]):
            held.copy_(saved)

    def re_advance() -> None:
        restore()
        before = tuple(t.clone() for t in linear_states(state))
        layer(block, **{keyword: cache})
        for held, saved in zip(linear_states(state), before):
            held.copy_(saved)
        layer(block[:, : ACCEPTED + 1], **{keyword: cache})

    conv_state, recurrent_state = linear_states(state)
    conv_bytes = conv_state.numel() * 2  # bf16 in a bf16 model
    recurrent_bytes = recurrent_state.numel() * recurrent_state.element_size()
    full_depth = AutoConfig.for_model(model_type, **overrides).layer_types
    return {
        "accepted": ACCEPTED,
        "one_token_decode_ms": time(one_token),
        "chunk_of_B_no_rollback_ms": time(chunk_only),
        "per_position_states_ms": time(per_position),
        "re_advance_ms": time(re_advance),
        "state_bytes_per_sequence": conv_bytes + recurrent_bytes,
        "per_position_extra_bytes_per_sequence": BLOCK * (conv_bytes + recurrent_bytes),
        "layer_weight_bytes_bf16": 2 * sum(p.numel() for p in layer.parameters()),
        "linear_layers_in_the_full_model": sum(t == "linear_attention" for t in full_depth),
    }


@torch.no_grad()
def fast_path_ways(model_type: str, overrides: dict, batch: int, time: Any) -> dict[str, Any]:
    from ..modeling.dflash_linear_state import LinearStates, linear_state_buffers

    layer, cache, config = layer_and_cache(model_type, overrides)
    keyword = cache_keyword(layer)
    states = LinearStates()  # the engine's rule over per-sequence states, for this one layer
    states.bind_linear_states(*linear_state_buffers({0: layer}, batch, torch.float32, "cpu"), [layer], num_layers=1)
    with states.prefilling():
        layer(torch.randn(batch, PROMPT, config.hidden_size), **{keyword: states})
    conv0, recurrent0 = states.conv[0].clone(), states.recurrent[0].clone()
    block = torch.randn(batch, BLOCK, config.hidden_size)
    taken = torch.tensor(KEPT[batch])

    def restore() -> None:
        states.conv[0].copy_(conv0)
        states.recurrent[0].copy_(recurrent0)

    def verify() -> None:
        restore()
        with states.deferring():
            layer(block, **{keyword: states})

    verify()
    recorded = dict(states.pending)

    def masked_chunk() -> None:
        restore()
        states.pending = dict(recorded)
        states.commit(taken)

    rule_module = sys.modules[type(layer).__module__]

    def masked_loop() -> None:
        restore()
        pending = recorded[0]
        keep = (torch.arange(BLOCK) < taken[:, None])[..., None]  # (b, B, 1)
        kwargs = dict(pending.kwargs, initial_state=states.recurrent[0], output_final_state=True)
        kwargs["g"], kwargs["beta"] = pending.kwargs["g"] * keep, pending.kwargs["beta"] * keep
        states.recurrent[0].copy_(rule_module.torch_recurrent_gated_delta_rule(*pending.args, **kwargs)[1])

    state = cache.layers[0]
    # transformers' own cache, for the layer's re-run
    layer(torch.randn(1, PROMPT, config.hidden_size), **{keyword: cache})

    def re_advance() -> None:
        for count in sorted(set(KEPT[batch])):
            rows = [row for row, c in enumerate(KEPT[batch]) if c == count]
            set_linear_states(state, conv0[rows[:1]].clone(), recurrent0[rows[:1]].clone())
            layer(block[rows][:, :count], **{keyword: cache})

    masked_chunk()
    chunk_states = states.recurrent[0].clone()
    masked_loop()
    torch.testing.assert_close(states.recurrent[0], chunk_states, atol=1e-4, rtol=1e-4)
    return {
        "kept_rows": KEPT[batch],
        "verify_chunk_ms": time(verify),
        "masked_chunk_rerun_ms": time(masked_chunk),
        "masked_B_step_loop_ms": time(masked_loop),
        "re_advance_through_the_layer_ms": time(re_advance),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="published shapes")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per way (median)")
    parser.add_argument("--hidden-size", type=int, default=None,
                        help="override every shape's width (a smaller layer for a quick run; not a published shape)")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import at_least

    at_least("--repeats", args.repeats, 1)
    at_least("--hidden-size", args.hidden_size, 1)


def run(args: argparse.Namespace) -> int:
    report = harness.header(args, "cpu")

    def time(fn: Any) -> float:
        return harness.time_call(fn, repeats=args.repeats, warmup=1).median_ms

    results = {}
    for name in args.shapes:
        model_type, overrides = SHAPES[name]
        if args.hidden_size is not None:
            overrides = {**overrides, "hidden_size": args.hidden_size}
        results[name] = {"eager loop, batch 1": eager_loop_ways(model_type, overrides, time)}
        for batch in KEPT:
            results[name][f"fast path, batch {batch}"] = fast_path_ways(model_type, overrides, batch, time)
        print(f"{name}: {results[name]}", flush=True)
    report.update(block=BLOCK, statistic=f"median of {args.repeats}", shapes=results)
    harness.write_report(args.out, report, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    """Per shape and setting, each way's ms."""
    plt = harness.pyplot()
    cells = [(f"{shape.split(' ')[0]}\n{setting}", values) for shape, settings in report["shapes"].items()
             for setting, values in settings.items()]
    fig, axes = plt.subplots(1, len(cells), figsize=(3.6 * len(cells), 4), squeeze=False)
    for axis, (title, values) in zip(axes[0], cells):
        ways = {k[: -len("_ms")]: v for k, v in values.items() if k.endswith("_ms")}
        axis.bar(range(len(ways)), list(ways.values()))
        axis.set_xticks(range(len(ways)), [w.replace("_", " ") for w in ways], fontsize=6, rotation=30, ha="right")
        axis.set_title(title, fontsize=8)
        axis.set_ylabel("ms (median)")
    fig.suptitle(f"Gated DeltaNet rollback, one layer, {report['machine']} ({report['date'][:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
