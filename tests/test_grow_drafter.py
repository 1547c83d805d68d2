"""Growing a trained drafter deeper (`grow_drafter`, `hf-dflash train --init-from D --num-layers N`): the grown
drafter computes exactly what the old one did, its new layers learn, and it saves, loads and decodes like any other.

Why exactly and not within a tolerance: each new layer's two residual branches end in a zero matrix (attention output
projection, MLP down projection), so each adds a sum of products that are all exactly 0.0, and x + 0.0 == x in IEEE
arithmetic; the final norm then reads the same residual stream bit for bit."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from hf_dflash import DFlashDraftModel
from hf_dflash.cli import main as cli_main
from hf_dflash.training import RegeneratedData, TrainingArguments, grow_drafter, train, write_jsonl_prompts
from tests.conftest import random_prompt, scratch_draft_logits, tiny_drafter, tiny_target


def drafter_outputs_during_generate(target, drafter, prompt, max_new_tokens=24):
    """Every drafter forward's output rows during one greedy `generate` (paged cache, our runtime), and its result."""
    rows = []
    hook = drafter.register_forward_hook(lambda module, args, output: rows.append(output.last_hidden_state.clone()))
    try:
        out = target.generate(prompt, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
                              return_dict_in_generate=True)
    finally:
        hook.remove()
    return rows, out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("layer_types", [None, ["full_attention", "sliding_attention"]])
def test_grown_drafter_drafts_exactly_what_it_did(family, layer_types, one_thread):
    target = tiny_target(family)
    window = dict(layer_types=layer_types, sliding_window=6) if layer_types else {}
    drafter = tiny_drafter(target, num_layers=2, **window)
    grown = grow_drafter(copy.deepcopy(drafter), 5)

    assert grown.config.num_hidden_layers == len(grown.layers) == 5
    assert grown.config.layer_types == [*drafter.config.layer_types, *[drafter.config.layer_types[-1]] * 3]
    assert [layer.self_attn.layer_idx for layer in grown.layers] == list(range(5))
    last = drafter.layers[-1].state_dict()
    for layer in grown.layers[2:]:
        for name, tensor in layer.state_dict().items():
            zeroed = name in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
            assert torch.equal(tensor, torch.zeros_like(tensor) if zeroed else last[name]), name
    assert not torch.equal(last["self_attn.o_proj.weight"], torch.zeros_like(last["self_attn.o_proj.weight"]))

    if layer_types is None:  # the plain forward (sliding drafters need the runtime's per-layer masks)
        context = torch.randn(11, drafter.config.num_context_features)
        assert torch.equal(scratch_draft_logits(target, grown, context, 7),
                           scratch_draft_logits(target, drafter, context, 7))
    prompt = random_prompt(9, seed=3)
    rows, out = drafter_outputs_during_generate(target, drafter, prompt)
    grown_rows, grown_out = drafter_outputs_during_generate(target, grown, prompt)
    assert len(rows) == len(grown_rows) > 1
    assert all(torch.equal(a, b) for a, b in zip(rows, grown_rows))
    assert torch.equal(grown_out.sequences, target.generate(prompt, max_new_tokens=24, do_sample=False))
    assert grown_out.acceptance_lengths == out.acceptance_lengths


def test_grown_drafter_refuses_to_shrink():
    drafter = tiny_drafter(tiny_target(), num_layers=3)
    with pytest.raises(ValueError, match="has 3 layers; it can grow to 3 or more, not shrink to 2"):
        grow_drafter(drafter, 2)
    assert len(grow_drafter(drafter, 3).layers) == 3  # the same depth: nothing added


def test_new_layers_learn_from_the_first_step(tmp_path, one_thread):
    """Step 1: the zeroed projections get a gradient (their inputs are not zero) and move; the rest of a new layer
    gets exactly zero gradient through them and stays the copy it was. Step 2: gradient reaches all of it."""
    target = tiny_target("qwen3")
    generator = torch.Generator().manual_seed(0)
    data = RegeneratedData.from_sequences(
        [(torch.randint(0, 200, (8,), generator=generator).tolist(), torch.randint(0, 200, (24,), generator=generator)
          .tolist()) for _ in range(4)]
    )
    before = grow_drafter(tiny_drafter(target, num_layers=1), 3)
    initial = {name: tensor.clone() for name, tensor in before.state_dict().items()}

    def trained(steps):
        drafter = copy.deepcopy(before)
        train(target, drafter, data, TrainingArguments(out_dir=str(tmp_path / str(steps)), steps=steps, batch_size=4,
                                                       max_anchors=4, lr=1e-3, progress=False))
        return {name: tensor.cpu() for name, tensor in drafter.state_dict().items()}

    def moved(state, name):
        return not torch.equal(state[name], initial[name])

    one, two = trained(1), trained(2)
    for i in (1, 2):
        assert moved(one, f"layers.{i}.self_attn.o_proj.weight") and moved(one, f"layers.{i}.mlp.down_proj.weight")
        behind_zeros = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                        "input_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                        "post_attention_layernorm.weight"]
        assert not any(moved(one, f"layers.{i}.{name}") for name in behind_zeros)
        assert all(moved(two, f"layers.{i}.{name}") for name in behind_zeros)


def test_train_grows_an_initial_drafter_and_records_it(tmp_path, monkeypatch, capsys):
    """`train --init-from D --num-layers N`: the saved drafter has N layers, decodes exactly like D before any
    learning (lr 0) and like plain greedy, and its recipe says it was grown, keeping D's runs."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["hf-dflash"])
    prompts = [f"Once upon a time, {name} had a {thing}." for name in ("Lily", "Tom") for thing in ("dog", "ball")]
    write_jsonl_prompts(prompts, tmp_path / "p.jsonl.gz")
    common = ["train", "--target", "stories260k", "--prompts", "p.jsonl.gz", "--regenerated", "data.safetensors",
              "--max-new-tokens", "16", "--batch-size", "4", "--max-anchors", "8"]
    assert cli_main([*common, "--out", "first", "--mask-token-id", "0", "--block-size", "4", "--num-layers", "2",
                     "--steps", "60", "--lr", "3e-3"]) == 0
    assert cli_main([*common, "--out", "grown", "--init-from", "first", "--num-layers", "4", "--steps", "1",
                     "--lr", "0"]) == 0
    start = [line for line in capsys.readouterr().out.splitlines() if line.startswith("drafter (first")]
    grown = DFlashDraftModel.from_pretrained(tmp_path / "grown")
    parameters = sum(p.numel() for p in grown.parameters())
    assert start == [f"drafter (first, grown from 2 layers): 4 layers, {parameters:,} parameters, "
                     f"{2 * parameters / 1e6:.2f} MB of bf16 weights"]
    assert json.loads((tmp_path / "grown" / "config.json").read_text())["num_hidden_layers"] == 4
    assert len(grown.layers) == 4 and grown.config.layer_types == ["full_attention"] * 4

    from hf_dflash.bundled_models import load_stories260k

    target, tokenizer = load_stories260k()
    first = DFlashDraftModel.from_pretrained(tmp_path / "first")
    prompt = tokenizer(prompts[0], return_tensors="pt").input_ids  # answered in training: drafts hit
    rows, out = drafter_outputs_during_generate(target, first, prompt, max_new_tokens=32)
    grown_rows, grown_out = drafter_outputs_during_generate(target, grown, prompt, max_new_tokens=32)
    assert all(torch.equal(a, b) for a, b in zip(rows, grown_rows)) and len(rows) == len(grown_rows)
    assert torch.equal(grown_out.sequences, target.generate(prompt, max_new_tokens=32, do_sample=False))
    assert grown_out.acceptance_lengths == out.acceptance_lengths
    assert max(out.acceptance_lengths[0]) > 1, "the first drafter never drafted a token right: nothing compared"

    record = json.loads((tmp_path / "grown" / "training_args.json").read_text())
    assert record["grown"] == record["history"][-1]["grown"] == {"from_layers": 2, "to_layers": 4}
    assert [run["steps"] for run in record["history"]] == [60, 1] and "grown" not in record["history"][0]


def test_grow_refusals_come_before_any_work(tmp_path, monkeypatch, capsys):
    drafter = tiny_drafter(tiny_target(), num_layers=3)
    drafter.save_pretrained(tmp_path / "three")

    def no_work(*args, **kwargs):
        raise AssertionError("the target was loaded before the arguments were checked")

    monkeypatch.setattr("hf_dflash.training.cli.load_target", no_work)
    common = ["train", "--target", "stories260k", "--out", str(tmp_path / "out"),
              "--init-from", str(tmp_path / "three")]
    # bad arguments: one line on stderr naming the fix, exit status 2
    for extra, line in (
        (["--num-layers", "2"], r"--num-layers 2: .*three has 3 layers, and a drafter can grow but not shrink; pass "
                                r"--num-layers 3 or more, or leave it out"),
        (["--num-layers", "4", "--init-from-target"], "--init-from takes the drafter's weights: leave out "
                                                      "--init-from-target"),
    ):
        with pytest.raises(SystemExit) as refused:
            cli_main([*common, *extra])
        assert refused.value.code == 2 and re.search(line, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
