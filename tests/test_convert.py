"""Conversion between our layout, z-lab's, transformers-native (Muse Glimmer) and vLLM speculators: exact round
trips (equal tensors, equivalent configs), a reduced draft vocabulary with its d2t map, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash import convert as conversion
from hf_dflash.cli import main
from tests.conftest import MASK_ID, tiny_drafter, tiny_target


def assert_same_drafter(a: conversion.Drafter, b: conversion.Drafter) -> None:
    assert conversion.core_fields(a.config) == conversion.core_fields(b.config)
    assert a.tensors.keys() == b.tensors.keys()
    for key, value in a.tensors.items():
        assert value.dtype == b.tensors[key].dtype and torch.equal(value, b.tensors[key]), key


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A target, and two drafters of ours for it: a plain one and one with yarn RoPE, biases and sliding layers."""
    root = tmp_path_factory.mktemp("convert")
    target = tiny_target("qwen3")
    target.save_pretrained(root / "target")
    tiny_drafter(target).save_pretrained(root / "plain")
    torch.manual_seed(3)
    unusual = DFlashConfig.for_target(
        target.config, num_hidden_layers=3, block_size=8, mask_token_id=MASK_ID, attention_bias=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=32,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256},
    )
    DFlashDraftModel(unusual).to(torch.bfloat16).save_pretrained(root / "unusual")
    return root


@pytest.mark.parametrize("layout", ["zlab", "native", "speculators"])
@pytest.mark.parametrize("name", ["plain", "unusual"])
def test_round_trip_through_each_layout(saved, tmp_path, layout, name):
    if layout == "native" and name == "unusual":
        with pytest.raises(ValueError, match="no attention biases"):
            conversion.convert(saved / name, tmp_path / layout, layout)
        return
    conversion.convert(saved / name, tmp_path / layout, layout, target=saved / "target")
    assert conversion.detect_format(json.loads((tmp_path / layout / "config.json").read_text())) == layout
    conversion.convert(tmp_path / layout, tmp_path / "back", "ours")
    assert_same_drafter(conversion.load(saved / name), conversion.load(tmp_path / "back"))
    DFlashDraftModel.from_pretrained(tmp_path / "back")  # strict: every tensor used, every parameter filled


def test_zlab_layout_round_trips_through_ours(saved, tmp_path):
    conversion.convert(saved / "unusual", tmp_path / "zlab", "zlab")
    config = json.loads((tmp_path / "zlab" / "config.json").read_text())
    # As z-lab's remote code (transformers 4.57) reads it: rope_theta + rope_scaling, DFlash fields nested.
    assert config["rope_theta"] == 150000.0 and config["rope_scaling"]["rope_type"] == "yarn"
    ids = DFlashConfig.from_pretrained(saved / "unusual").target_layer_ids
    assert config["dflash_config"]["target_layer_ids"] == ids
    conversion.convert(tmp_path / "zlab", tmp_path / "ours", "ours")
    conversion.convert(tmp_path / "ours", tmp_path / "zlab2", "zlab")
    assert json.loads((tmp_path / "zlab2" / "config.json").read_text()) == config
    assert_same_drafter(conversion.load(tmp_path / "zlab"), conversion.load(tmp_path / "zlab2"))


def test_native_export_loads_in_transformers_muse_glimmer_assistant(saved, tmp_path):
    from transformers import MuseGlimmerAssistantModel

    conversion.convert(saved / "plain", tmp_path / "native", "native")
    model, info = MuseGlimmerAssistantModel.from_pretrained(tmp_path / "native", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = DFlashDraftModel.from_pretrained(saved / "plain")
    assert torch.equal(model.encoder.fc.weight, ours.fc.weight)
    assert torch.equal(model.encoder.output_norm_enc.weight, ours.hidden_norm.weight)


def write_speculators_checkpoint(folder, target_dir, drafter, draft_vocab_size):
    """A vLLM speculators DFlash checkpoint as its converter writes one, with a reduced draft vocabulary."""
    target = load_file(str(target_dir / "model.safetensors"))
    embedding = target["model.embed_tokens.weight"]
    lm_head = target.get("lm_head.weight", embedding)
    generator = torch.Generator().manual_seed(0)
    keep = torch.randperm(embedding.shape[0], generator=generator)[:draft_vocab_size].sort().values
    t2d = torch.zeros(embedding.shape[0], dtype=torch.bool)
    t2d[keep] = True
    tensors = {**drafter.state_dict(), "embed_tokens.weight": embedding, "lm_head.weight": lm_head[t2d],
               "d2t": keep - torch.arange(draft_vocab_size), "t2d": t2d}
    c = drafter.config
    layer = {k: getattr(c, k) for k in conversion.DECODER_FIELDS}
    config = {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
        "transformer_layer_config": {"model_type": "qwen3", **layer, "rope_parameters": c.rope_parameters},
        "draft_vocab_size": draft_vocab_size, "block_size": c.block_size, "target_hidden_size": c.target_hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids], "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": False, "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size - 1}],
            "verifier": {"name_or_path": str(target_dir), "architectures": ["Qwen3ForCausalLM"]},
        },
    }
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return config, tensors


def test_speculators_reduced_vocabulary_round_trip(saved, tmp_path):
    drafter = DFlashDraftModel.from_pretrained(saved / "plain")
    config, tensors = write_speculators_checkpoint(tmp_path / "spec", saved / "target", drafter, draft_vocab_size=100)
    with pytest.raises(ValueError, match="hf-dflash convert"):  # not loadable as is: the error names the fix
        DFlashDraftModel.from_pretrained(tmp_path / "spec")

    conversion.convert(tmp_path / "spec", tmp_path / "ours", "ours")
    ours = DFlashDraftModel.from_pretrained(tmp_path / "ours")  # the maps sit beside the weights, not in them
    assert ours.config.target_layer_ids == drafter.config.target_layer_ids  # aux ids - 1
    assert ours.config.draft_vocab_size == 100 and ours.config.target_model == str(saved / "target")
    assert torch.equal(load_file(str(tmp_path / "ours" / conversion.DRAFT_VOCAB_FILE))["d2t"], tensors["d2t"])

    conversion.convert(tmp_path / "ours", tmp_path / "spec2", "speculators", target=saved / "target")
    again = load_file(str(tmp_path / "spec2" / "model.safetensors"))
    assert again.keys() == tensors.keys()
    assert all(torch.equal(again[k], v) for k, v in tensors.items())
    written = json.loads((tmp_path / "spec2" / "config.json").read_text())
    for key in ("draft_vocab_size", "aux_hidden_state_layer_ids", "block_size", "mask_token_id", "speculators_config"):
        assert written[key] == config[key], key
    assert_same_drafter(conversion.load(tmp_path / "spec"), conversion.load(tmp_path / "spec2"))


def test_bad_conversions_are_refused_before_writing(saved, tmp_path):
    with pytest.raises(ValueError, match="pass the target"):
        conversion.convert(saved / "plain", tmp_path / "a", "speculators")
    with pytest.raises(ValueError, match="unknown layout"):
        conversion.convert(saved / "plain", tmp_path / "b", "gguf")
    last = tiny_drafter(tiny_target("qwen3"), target_layer_ids=[2, 5])
    last.save_pretrained(tmp_path / "last")
    with pytest.raises(ValueError, match="last layer"):
        conversion.convert(tmp_path / "last", tmp_path / "c", "speculators", target=saved / "target")
    tensors = load_file(str(saved / "plain" / "model.safetensors"))
    tensors.pop("norm.weight")
    bad = conversion.to_drafter(json.loads((saved / "plain" / "config.json").read_text()), tensors)
    with pytest.raises(ValueError, match="norm.weight"):
        conversion.save(bad, tmp_path / "d", "zlab")
    assert not any((tmp_path / name).exists() for name in "abcd")
    native = {"model_type": "muse_glimmer_assistant", "hidden_size": 64, "target_layer_ids": [1], "mask_token_id": 3}
    with pytest.raises(ValueError, match="add the target's vocab_size"):
        conversion.config_from_layout(native)


def test_cli_convert_and_info(saved, tmp_path, capsys):
    assert main(["convert", str(saved / "plain"), str(tmp_path / "z"), "--to", "zlab"]) == 0
    assert "(ours) ->" in capsys.readouterr().out
    for out, to, message in (("z", "native", "not empty"), ("s", "speculators", "pass --target")):
        with pytest.raises(SystemExit) as refused:  # a bad argument: one line on stderr, exit status 2
            main(["convert", str(saved / "plain"), str(tmp_path / out), "--to", to])
        assert refused.value.code == 2 and message in capsys.readouterr().err

    assert main(["info", str(tmp_path / "z"), "--target", str(saved / "target")]) == 0
    out = capsys.readouterr().out
    assert "(zlab; weights present)" in out and f"fits        {saved / 'target'}" in out
    wider = tiny_target("qwen3", hidden_size=96, num_hidden_layers=2)
    wider.config.save_pretrained(tmp_path / "other")
    assert main(["info", str(tmp_path / "z"), "--target", str(tmp_path / "other")]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "width 64, the target's are 96" in out and "do not exist in the target" in out


def test_cli_push_dry_run_writes_the_upload_folder(saved, tmp_path):
    assert main(["push", str(saved / "plain"), "org/d", "--tau", "2.5", "--dry-run", str(tmp_path / "up")]) == 0
    card = (tmp_path / "up" / "README.md").read_text()
    assert "| measured tau (tokens per verify step) | 2.50 |" in card and 'from_pretrained("org/d"' in card
    assert json.loads((tmp_path / "up" / "config.json").read_text())["auto_map"]
