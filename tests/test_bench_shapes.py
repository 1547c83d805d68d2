"""`hf-dflash bench decode --random-weights`: the published shapes it builds, and its rows and 1-token baseline per
family.

The published shapes are built on the meta device (no memory, no time) and checked against the published configs:
the targets' fields, their agreement with the drafters' configs in hub_configs/, and the published parameter counts.
The bench rows and the target's 1-token step on the fast path's cache run on the CPU at the same layouts scaled down
(`published.scaled_down`: every field kept but widths, depth, vocabulary and expert count; windows made small
enough to bind).
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_dflash import DFlashDraftModel
from hf_dflash.bench import step_cost
from hf_dflash.bench.published import RANDOM_SHAPES, SCALED_VOCAB, random_pair, scaled_down, shape_record
from hf_dflash.bench.step_cost import hold, target_one_token_step
from hf_dflash.cli import main
from hf_dflash.hub import published_drafters

# Published totals, in billions of parameters (the model cards: Qwen3-8B 8.2B, gpt-oss-20b 20.9B (21B),
# Qwen3-Coder-30B-A3B 30.5B). Qwen3.5-4B's card counts its vision encoder too, which the text model here has not.
PUBLISHED_BILLIONS = {"qwen3-8b": 8.2, "gpt-oss-20b": 20.9, "qwen3-coder-30b-a3b": 30.5}


@pytest.mark.parametrize("name", list(RANDOM_SHAPES))
def test_published_shapes_build_as_published(name):
    shape = RANDOM_SHAPES[name]
    target, drafter = random_pair(name, torch.bfloat16, "meta")
    record = shape_record(name, target, drafter)
    text = target.config.get_text_config()
    # the built config holds every published field as given (transformers did not drop or rewrite one)
    for key, value in shape.config.items():
        assert getattr(text, key) == value, key
    assert record["target_config"] == shape.config and record["drafter_changed_from_published"] == {}
    # the target agrees with the drafter published for it
    published = published_drafters()[shape.drafter]
    assert published.target == shape.target
    assert text.hidden_size == drafter.config.target_hidden_size
    assert text.num_hidden_layers == drafter.config.num_target_layers
    assert text.vocab_size == drafter.config.vocab_size
    assert max(drafter.config.target_layer_ids) < text.num_hidden_layers
    drafter_parameters = sum(p.numel() for p in drafter.parameters())
    if published.published_parameters is not None:
        assert drafter_parameters == published.published_parameters
    assert drafter_parameters * 2 / 2**30 == pytest.approx(published.published_weights_gib, abs=0.01)
    if name in PUBLISHED_BILLIONS:
        assert record["target_parameters"] / 1e9 == pytest.approx(PUBLISHED_BILLIONS[name], abs=0.05)


def test_published_family_features():
    """What makes each family a case of its own is in the built shapes: windows and sinks, experts, linear layers."""
    built = {name: random_pair(name, torch.bfloat16, "meta")[0] for name in RANDOM_SHAPES}
    oss = built["gpt-oss-20b"].config
    assert oss.sliding_window == 128 and oss.layer_types.count("sliding_attention") == 12
    assert oss._attn_implementation == "eager"  # sdpa would drop the sinks
    assert all(hasattr(layer.self_attn, "sinks") for layer in built["gpt-oss-20b"].model.layers)
    assert (oss.num_local_experts, oss.num_experts_per_tok) == (32, 4)
    hybrid = built["qwen3.5-4b"].config
    assert hybrid.layer_types.count("linear_attention") == 24 and hybrid.layer_types[3::4] == ["full_attention"] * 8
    coder = built["qwen3-coder-30b-a3b"].config
    assert (coder.num_experts, coder.num_experts_per_tok, coder.num_hidden_layers) == (128, 8, 48)
    assert coder.sliding_window is None  # the fast path would window every layer of a qwen3_moe config that sets one


def test_experts_option_is_refused_for_a_dense_shape_before_building():
    with pytest.raises(ValueError, match="no MoE experts; drop --experts-implementation"):
        random_pair("qwen3-8b", torch.float32, "meta", experts="batched_mm")


@pytest.mark.parametrize("name", list(RANDOM_SHAPES))
def test_target_one_token_step_is_the_next_plain_step_on_the_fast_path_cache(name):
    """The baseline's forward on the engine's own cache, over a fast-path call's held sequences, gives the target's
    own next-token logits, for a left-padded batch (on a GPU it is recorded as a graph; here it runs as it is)."""
    torch.manual_seed(0)
    target, drafter = random_pair(scaled_down(name), torch.float32, "cpu")
    prompts = [torch.randint(0, SCALED_VOCAB - 1, (n,)).tolist() for n in (9, 5)]
    ids = torch.tensor([[0] * (9 - len(p)) + p for p in prompts])
    mask = (torch.arange(9) >= 9 - torch.tensor([9, 5])[:, None]).long()
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                          eos_token_id=None, assistant_model=drafter, dflash_fast_path=True)
    held = hold(drafter, out, torch.nn.functional.pad(mask, (0, 8), value=1))
    logits = target_one_token_step(held)()  # (b, 1, V)
    for row, sequence in enumerate(held.engine.sequences):
        sequence = sequence.key
        tokens = out[sequence, 9 - len(prompts[sequence]) :]  # the sequence without its padding
        assert int(held.rows.anchor_ids[row, 0]) == int(tokens[-1])  # the last committed token is the one stepped
        plain = target(tokens[None]).logits[0, -1]
        torch.testing.assert_close(logits[row, 0], plain, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(RANDOM_SHAPES))
def test_bench_row_per_family_on_cpu(name, tmp_path, monkeypatch):
    monkeypatch.setitem(RANDOM_SHAPES, name, scaled_down(name))
    moe = {"num_experts", "num_local_experts"} & RANDOM_SHAPES[name].config.keys()
    out = tmp_path / "report.json"
    main(["bench", "decode", "--random-weights", name, "--context-lengths", "7", "--max-new-tokens", "6", "--methods", "plain",
          "dflash", "--dtype", "fp32", "--device", "cpu", "--out", str(out)]
         + (["--experts-implementation", "batched_mm"] if moe else []))
    report = json.loads(out.read_text())
    shape = report["random_weights_shape"]
    assert shape["experts_implementation"] == ("batched_mm" if moe else None)
    assert shape["target"] == RANDOM_SHAPES[name].target and shape["drafter"] == RANDOM_SHAPES[name].drafter
    assert shape["target_config"] == RANDOM_SHAPES[name].config
    assert shape["attn_implementation"] == RANDOM_SHAPES[name].attn_implementation
    assert "fast path" in report["target_1_token_graph_baseline"]
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"plain", "dflash"}
    # float32 on a CPU: our tokens are plain greedy's (a random target may end early on the pad id, as plain does)
    assert rows["dflash"]["identical_to_plain"] == 1.0
    assert rows["dflash"]["new_tokens"] == rows["plain"]["new_tokens"] >= 1
    for row in rows.values():  # GPU-only figures are absent on a CPU, not estimated
        assert not {"target_1_token_graph_ms", "step_graph_ms", "step_over_target_1_token_graph"} & row["extra"].keys()


def test_a_published_layout_drafter_loaded_from_its_files_drafts_through_generate(tmp_path):
    """A drafter loaded from files in a publisher's layout (z-lab: `model_type` "qwen3" in its config.json) is recognised as a DFlash drafter: generate runs our loop with it, not transformers' own
    assisted decoding (which fails on it)."""
    from tests.test_loading import write_zlab_checkpoint

    shape = scaled_down("qwen3-8b")
    target, _ = random_pair(shape, torch.float32, "cpu")
    fields = {**published_drafters()[shape.drafter].config, **shape.drafter_overrides}
    write_zlab_checkpoint(tmp_path / "drafter", fields)
    assert json.loads((tmp_path / "drafter" / "config.json").read_text())["model_type"] == "qwen3"
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "drafter")  # read through z-lab's layout into our config
    prompt = torch.randint(0, SCALED_VOCAB - 1, (1, 6), generator=torch.Generator().manual_seed(0))
    plain = target.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    out = target.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0, assistant_model=drafter,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain) and len(out.acceptance_lengths[0]) >= 1


def test_the_baseline_leaves_a_hybrid_step_as_it_was(monkeypatch):
    """Each replay of the 1-token step advances a hybrid target's linear states; the measurement puts them back, so the
    held step stays the state of its last call. (CUDA graphs are GPU-only: the replays run the forward here.)"""
    calls = []

    def replays(fn):
        calls.extend(fn() for _ in range(3))
        return 0.0

    monkeypatch.setattr(step_cost, "graph_ms", replays)
    target, drafter = random_pair(scaled_down("qwen3.5-4b"), torch.float32, "cpu")
    prompt = torch.randint(0, SCALED_VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(1))
    out = target.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, assistant_model=drafter,
                          dflash_fast_path=True)
    held = hold(drafter, out, torch.ones_like(out))
    before = [state.clone() for state in held.carried_state()]
    assert before and step_cost.target_1_token_ms(held) == 0.0
    assert not torch.equal(calls[0], calls[1])  # the replays did advance the states (the same token, a new state)
    for state, value in zip(held.carried_state(), before):
        assert torch.equal(state, value)
