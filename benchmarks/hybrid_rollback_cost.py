"""What the fast path's rollback of a Gated DeltaNet layer costs, against the other exact ways, at a real shape (CPU,
fp32, transformers' PyTorch kernels).

One linear-attention layer, B = 16 verified rows, each sequence keeping a + 1 of them (a = 7; with batch 4 the rows
keep 1, 5, 9 and 16: ragged). After the verify (the block as one chunk, from the committed states), the states must
become those after each sequence's own rows. Ways, each without a host sync or a data-dependent shape except the last:
- masked chunk re-run (the fast path, dflash_linear_state.py): the chunked rule again over the B rows from the states
  before the block, with g and beta zeroed past each row's count; conv state by a gather. No projection runs again.
- masked B-step loop: the same masked inputs through transformers' token-by-token recurrent rule (B steps).
- re-advance through the layer (the eager loop's way): the layer's own forward again over the a + 1 kept rows, one
  call per distinct count (projections included; the count decides the shape, so it cannot sit in a CUDA graph).

    python benchmarks/hybrid_rollback_cost.py   # writes results/hybrid_rollback_cost_cpu.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from linear_rollback_cost import BLOCK, SHAPES, layer_and_cache  # noqa: E402

from hf_dflash.bench import run_environment  # noqa: E402
from hf_dflash.modeling.dflash_linear_state import HybridStaticCache  # noqa: E402

RESULT = Path(__file__).parent / "results" / "hybrid_rollback_cost_cpu.json"
KEPT = {1: [8], 4: [1, 5, 9, 16]}  # batch -> rows kept per sequence (anchor + accepted drafts)
REPEATS = 7


def fastest_ms(fn) -> float:
    """The fastest of REPEATS calls after a warm-up (on a CPU shared with other jobs, the minimum is the stable
    figure)."""
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(min(times), 2)


@torch.no_grad()
def measure(model_type: str, overrides: dict, batch: int) -> dict:
    layer, cache, config = layer_and_cache(model_type, overrides)
    stack = torch.nn.Module()  # what HybridStaticCache looks for: `.layers`, with `linear_attn` in each
    stack.layers = torch.nn.ModuleList([torch.nn.Module()])
    stack.layers[0].linear_attn = layer
    static = HybridStaticCache(stack, batch, 1, 1, num_slots=1, dtype=torch.float32, device="cpu")
    with static.prefilling():  # a 64-token prompt: the states exist
        layer(torch.randn(batch, 64, config.hidden_size), cache=static)
    conv0, recurrent0 = static.conv[0].clone(), static.recurrent[0].clone()
    block = torch.randn(batch, BLOCK, config.hidden_size)
    taken = torch.tensor(KEPT[batch])

    def restore() -> None:
        static.conv[0].copy_(conv0)
        static.recurrent[0].copy_(recurrent0)

    def verify() -> None:
        restore()
        with static.deferring():
            layer(block, cache=static)

    verify()
    recorded = dict(static.pending)

    def masked_chunk() -> None:
        restore()
        static.pending = dict(recorded)
        static.commit(taken)

    rule_module = sys.modules[type(layer).__module__]

    def masked_loop() -> None:
        restore()
        pending = recorded[0]
        keep = (torch.arange(BLOCK) < taken[:, None])[..., None]  # (b, B, 1)
        kwargs = dict(pending.kwargs, initial_state=static.recurrent[0], output_final_state=True)
        kwargs["g"], kwargs["beta"] = pending.kwargs["g"] * keep, pending.kwargs["beta"] * keep
        static.recurrent[0].copy_(rule_module.torch_recurrent_gated_delta_rule(*pending.args, **kwargs)[1])

    state = cache.layers[0]
    layer(torch.randn(1, 64, config.hidden_size), cache=cache)  # transformers' own cache, for the layer's re-run

    def re_advance() -> None:
        for count in sorted(set(KEPT[batch])):
            rows = [row for row, c in enumerate(KEPT[batch]) if c == count]
            state.conv_states[0], state.recurrent_states[0] = conv0[rows[:1]].clone(), recurrent0[rows[:1]].clone()
            layer(block[rows][:, :count], cache=cache)

    # the three ways leave the same states (checked before timing)
    masked_chunk()
    chunk_states = static.recurrent[0].clone()
    masked_loop()
    torch.testing.assert_close(static.recurrent[0], chunk_states, atol=1e-4, rtol=1e-4)
    return {
        "kept_rows": KEPT[batch],
        "verify_chunk_ms": fastest_ms(verify),
        "masked_chunk_rerun_ms": fastest_ms(masked_chunk),
        "masked_B_step_loop_ms": fastest_ms(masked_loop),
        "re_advance_through_the_layer_ms": fastest_ms(re_advance),
    }


def main() -> None:
    torch.set_num_threads(2)
    results = {
        f"{name}, batch {batch}": measure(model_type, overrides, batch)
        for name, (model_type, overrides) in SHAPES.items()
        for batch in KEPT
    }
    report = {
        **run_environment("cpu"), "block": BLOCK, "threads": 2, "statistic": f"fastest of {REPEATS}", "shapes": results
    }
    RESULT.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
