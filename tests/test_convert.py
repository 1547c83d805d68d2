"""Conversion between our layout, z-lab's, transformers-native (Muse Glimmer) and vLLM speculators: exact round
trips (equal tensors, equivalent configs), a reduced draft vocabulary with its d2t map, and the CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

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
    if layout == "speculators" and name == "unusual":  # its window (32) cuts context: see test_sliding_window_*
        with pytest.raises(ValueError, match="from the block's anchor"):
            conversion.convert(saved / name, tmp_path / layout, layout, target=saved / "target")
        assert not (tmp_path / layout).exists()
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
    assert torch.equal(ours.draft_vocabulary, torch.arange(100) + tensors["d2t"])  # what drafting runs over

    conversion.convert(tmp_path / "ours", tmp_path / "spec2", "speculators", target=saved / "target")
    again = load_file(str(tmp_path / "spec2" / "model.safetensors"))
    assert again.keys() == tensors.keys()
    assert all(torch.equal(again[k], v) for k, v in tensors.items())
    written = json.loads((tmp_path / "spec2" / "config.json").read_text())
    for key in ("draft_vocab_size", "aux_hidden_state_layer_ids", "block_size", "mask_token_id", "speculators_config"):
        assert written[key] == config[key], key
    assert_same_drafter(conversion.load(tmp_path / "spec"), conversion.load(tmp_path / "spec2"))
    for layout in ("zlab", "native"):  # their readers draft over the full vocabulary: refused, not dropped
        with pytest.raises(ValueError, match="reduced draft vocabulary of 100 tokens"):
            conversion.convert(tmp_path / "spec", tmp_path / layout, layout)
        assert not (tmp_path / layout).exists()


def test_a_draft_vocabulary_set_here_converts_to_speculators_and_back(saved, tmp_path):
    drafter = DFlashDraftModel.from_pretrained(saved / "plain")
    drafter.set_draft_vocabulary([250, 7, 3, 64])
    drafter.save_pretrained(tmp_path / "ours")
    conversion.convert(tmp_path / "ours", tmp_path / "spec", "speculators", target=saved / "target")
    written = load_file(str(tmp_path / "spec" / "model.safetensors"))
    lm_head = AutoModelForCausalLM.from_pretrained(saved / "target").get_output_embeddings().weight
    assert torch.equal(written["lm_head.weight"], lm_head[[3, 7, 64, 250]])  # vLLM's rows, draft id order
    assert written["d2t"].tolist() == [3, 6, 62, 247]
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["draft_vocab_size"] == 4
    conversion.convert(tmp_path / "spec", tmp_path / "back", "ours")
    assert DFlashDraftModel.from_pretrained(tmp_path / "back").draft_vocabulary.tolist() == [3, 7, 64, 250]


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


def test_cli_push_dry_run_says_how_it_would_push(saved, tmp_path, capsys):
    assert main(["push", str(saved / "plain"), "org/d", "--private", "--revision", "v2", "--create-pr",
                 "--commit-message", "drafter v2", "--dry-run", str(tmp_path / "up")]) == 0
    assert capsys.readouterr().out.strip().endswith(
        "(a new private repository if it does not exist, branch v2, as a pull request, message 'drafter v2')")


def speculators_load_problems(folder) -> list[str]:
    """What vLLM speculators (0.9.0) would reject, or read differently from us, in a DFlash checkpoint folder: its
    loading rules restated (speculators pins transformers <= 5.19 and pulls datasets, openai and torchvision, too heavy
    for a test dependency).
    - The decoder config is the transformers config class of `transformer_layer_config`'s model_type (Qwen3Config
      without one), built from that dict. Every width is its hidden_size: fc [H, len(aux ids) * H], embed_tokens
      [vocab, H], lm_head [draft_vocab_size, H]; t2d/d2t when draft_vocab_size differs from vocab; decoder layers
      shaped as Qwen3 layers.
    - A "sliding_attention" layer gets a window only if that config keeps one (Qwen3Config needs use_sliding_window),
      and is causal inside a block, as ours are, unless sliding_window_non_causal is true.
    - aux_hidden_state_layer_ids count hidden_states (0 = the embedding output)."""
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    layer_dict = dict(config["transformer_layer_config"])
    layer = AutoConfig.for_model(layer_dict.pop("model_type", "qwen3"), **layer_dict)
    hidden, heads, kv, head_dim = layer.hidden_size, layer.num_attention_heads, layer.num_key_value_heads, layer.head_dim
    aux = config["aux_hidden_state_layer_ids"]
    draft_vocab = config.get("draft_vocab_size", 32000)
    expected = {"fc.weight": (hidden, len(aux) * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,),
                "embed_tokens.weight": (layer.vocab_size, hidden), "lm_head.weight": (draft_vocab, hidden)}
    if draft_vocab != layer.vocab_size:
        expected.update(d2t=(draft_vocab,), t2d=(layer.vocab_size,))
    for i in range(layer.num_hidden_layers):
        shapes = {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv * head_dim, hidden),
                  "self_attn.v_proj": (kv * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
                  "mlp.gate_proj": (layer.intermediate_size, hidden), "mlp.up_proj": (layer.intermediate_size, hidden),
                  "mlp.down_proj": (hidden, layer.intermediate_size)}
        for name, shape in shapes.items():
            expected[f"layers.{i}.{name}.weight"] = shape
            if layer.attention_bias and name.startswith("self_attn"):
                expected[f"layers.{i}.{name}.bias"] = (shape[0],)
        expected.update({f"layers.{i}.self_attn.q_norm.weight": (head_dim,), f"layers.{i}.self_attn.k_norm.weight": (head_dim,),
                         f"layers.{i}.input_layernorm.weight": (hidden,),
                         f"layers.{i}.post_attention_layernorm.weight": (hidden,)})
    problems = [f"{k} is {tuple(tensors[k].shape) if k in tensors else 'missing'}, expected {v}"
                for k, v in expected.items() if k not in tensors or tuple(tensors[k].shape) != v]
    problems += [f"unexpected {k}" for k in sorted(set(tensors) - set(expected))]
    if 0 in aux:
        problems.append("aux id 0 is the embedding output")
    if "sliding_attention" in (layer.layer_types or []):
        if layer.sliding_window is None:
            problems.append("sliding layers without a window (dropped by the decoder config)")
        if config.get("sliding_window_non_causal", False):
            problems.append("sliding layers bidirectional inside a block")
    return problems


def test_tied_embedding_target_converts_to_speculators(tmp_path):
    target = tiny_target("qwen3", tie_word_embeddings=True)
    target.save_pretrained(tmp_path / "target")
    assert "lm_head.weight" not in load_file(str(tmp_path / "target" / "model.safetensors"))  # stored once
    tiny_drafter(target).save_pretrained(tmp_path / "ours")
    conversion.convert(tmp_path / "ours", tmp_path / "spec", "speculators", target=tmp_path / "target")
    assert speculators_load_problems(tmp_path / "spec") == []
    written = load_file(str(tmp_path / "spec" / "model.safetensors"))
    assert torch.equal(written["lm_head.weight"], target.get_input_embeddings().weight)
    assert torch.equal(written["embed_tokens.weight"], target.get_input_embeddings().weight)
    conversion.convert(tmp_path / "spec", tmp_path / "back", "ours")
    assert_same_drafter(conversion.load(tmp_path / "ours"), conversion.load(tmp_path / "back"))


def test_speculators_verifier_is_the_target_the_drafter_records(saved, tmp_path):
    """--target is where the embedding and lm_head are read, often a local folder: the verifier written is the
    target the drafter's config names (a Hub id) when it names one, and a conversion back keeps it."""
    drafter = DFlashDraftModel.from_pretrained(saved / "plain")
    drafter.config.target_model = "org/target-model"
    drafter.save_pretrained(tmp_path / "ours")
    conversion.convert(tmp_path / "ours", tmp_path / "spec", "speculators", target=saved / "target")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/target-model"
    assert conversion.load(tmp_path / "spec").config.target_model == "org/target-model"
    conversion.convert(saved / "plain", tmp_path / "spec2", "speculators", target=saved / "target")  # none recorded
    verifier = json.loads((tmp_path / "spec2" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == str(saved / "target")


def test_drafter_narrower_than_its_target_is_refused(saved, tmp_path):
    """Block tokens enter the drafter through the target's embedding and drafts leave through its lm_head, so a drafter
    32 wide for a target 64 wide runs nowhere (ours, z-lab's, speculators' all size them by one hidden size): it is
    refused when built, and a speculators file that declares such a pair is refused when read."""
    target = tiny_target("qwen3")
    with pytest.raises(ValueError, match="as wide as its target; set hidden_size=64"):
        tiny_drafter(target, hidden_size=32, intermediate_size=64, head_dim=8)
    drafter = DFlashDraftModel.from_pretrained(saved / "plain")
    config, _ = write_speculators_checkpoint(tmp_path / "spec", saved / "target", drafter, draft_vocab_size=100)
    config["target_hidden_size"] = 128
    (tmp_path / "spec" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sizes fc and the embedding by the drafter's hidden_size"):
        conversion.convert(tmp_path / "spec", tmp_path / "ours", "ours")
    assert not (tmp_path / "ours").exists()


def sliding_drafter(target, window: int):
    return tiny_drafter(target, layer_types=["sliding_attention", "full_attention"], sliding_window=window)


def test_sliding_window_that_never_cuts_converts_to_speculators(saved, tmp_path):
    target = tiny_target("qwen3")
    drafter = sliding_drafter(target, window=target.config.max_position_embeddings)
    drafter.save_pretrained(tmp_path / "ours")
    conversion.convert(tmp_path / "ours", tmp_path / "spec", "speculators", target=saved / "target")
    assert speculators_load_problems(tmp_path / "spec") == []  # window kept, sliding layers causal as ours
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["transformer_layer_config"]["use_sliding_window"] is True
    assert config["sliding_window_non_causal"] is False
    conversion.convert(tmp_path / "spec", tmp_path / "back", "ours")
    assert_same_drafter(conversion.load(tmp_path / "ours"), conversion.load(tmp_path / "back"))
    # A speculators file that leaves the flag to its default (false: causal sliding layers) reads the same.
    del config["sliding_window_non_causal"]
    assert conversion.core_fields(conversion.config_from_layout(config)) == conversion.core_fields(drafter.config)


def test_speculators_bidirectional_sliding_layers_are_refused(saved, tmp_path):
    """speculators' sliding_window_non_causal: true lets every block row of a sliding layer see the whole block; we run
    sliding layers causally, so such a drafter would draft differently here: refused before anything is written."""
    target = tiny_target("qwen3")
    drafter = sliding_drafter(target, window=target.config.max_position_embeddings)
    config, _ = write_speculators_checkpoint(tmp_path / "theirs", saved / "target", drafter, draft_vocab_size=100)
    config["transformer_layer_config"]["use_sliding_window"] = True
    (tmp_path / "theirs" / "config.json").write_text(json.dumps({**config, "sliding_window_non_causal": True}))
    with pytest.raises(ValueError, match="sliding_window_non_causal: true"):
        conversion.convert(tmp_path / "theirs", tmp_path / "ours", "ours")
    assert not (tmp_path / "ours").exists()
    # The flag only concerns sliding layers: a drafter of full layers alone converts whatever it says.
    full = tiny_drafter(target)
    config, _ = write_speculators_checkpoint(tmp_path / "full", saved / "target", full, draft_vocab_size=100)
    read = conversion.config_from_layout({**config, "sliding_window_non_causal": True})
    assert conversion.core_fields(read) == conversion.core_fields(conversion.config_from_layout(config))


def test_sliding_window_that_cuts_context_is_refused_both_ways(saved, tmp_path):
    target = tiny_target("qwen3")
    sliding_drafter(target, window=8).save_pretrained(tmp_path / "ours")
    with pytest.raises(ValueError, match="from the block's anchor"):
        conversion.convert(tmp_path / "ours", tmp_path / "spec", "speculators", target=saved / "target")
    assert not (tmp_path / "spec").exists()

    # The same drafter as a speculators checkpoint (written by hand, causal sliding layers as ours) is refused on the
    # way in, for the same reason.
    drafter = sliding_drafter(target, window=8)
    config, _ = write_speculators_checkpoint(tmp_path / "theirs", saved / "target", drafter, draft_vocab_size=100)
    config["transformer_layer_config"]["use_sliding_window"] = True
    assert config["sliding_window_non_causal"] is False
    with pytest.raises(ValueError, match="from the block's anchor"):
        conversion.config_from_layout(config)
    # Without use_sliding_window, speculators' Qwen3Config drops the window: those layers attend to everything.
    del config["transformer_layer_config"]["use_sliding_window"]
    assert conversion.config_from_layout(config).layer_types == ["full_attention"] * 2


def test_zlab_config_that_declares_other_causality_is_refused(saved, tmp_path):
    """z-lab's reference and vLLM read a top-level `is_causal` as every layer's causality; with a sliding and a full
    layer, `true` makes the full layer causal, which we do not run: refused when read, nothing written."""
    target = tiny_target("qwen3")
    sliding_drafter(target, window=8).save_pretrained(tmp_path / "ours")
    conversion.convert(tmp_path / "ours", tmp_path / "zlab", "zlab")
    config = json.loads((tmp_path / "zlab" / "config.json").read_text())
    (tmp_path / "zlab" / "config.json").write_text(json.dumps({**config, "is_causal": True}))
    with pytest.raises(ValueError, match=r"layers \[1\] \(full_attention\) would compute differently"):
        conversion.convert(tmp_path / "zlab", tmp_path / "back", "ours")
    assert not (tmp_path / "back").exists()


def test_speculators_embedding_output_layer_is_refused(saved, tmp_path):
    drafter = DFlashDraftModel.from_pretrained(saved / "plain")
    config, _ = write_speculators_checkpoint(tmp_path / "spec", saved / "target", drafter, draft_vocab_size=100)
    config["aux_hidden_state_layer_ids"] = [0, 3]  # as speculators' own test fixtures: 0 is the embedding output
    (tmp_path / "spec" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="embedding output .* decoder-layer outputs only"):
        conversion.convert(tmp_path / "spec", tmp_path / "ours", "ours")
    assert not (tmp_path / "ours").exists()


def test_speculators_defaults_are_speculators_own(saved, tmp_path):
    drafter = DFlashDraftModel.from_pretrained(saved / "plain")
    config, _ = write_speculators_checkpoint(tmp_path / "spec", saved / "target", drafter, draft_vocab_size=100)
    layer = config["transformer_layer_config"]
    for name in ("block_size", "draft_vocab_size"):
        del config[name]
    for name in ("rope_parameters", "head_dim", "max_position_embeddings", "rms_norm_eps"):
        del layer[name]
    ours = conversion.config_from_layout(config)
    qwen3 = Qwen3Config()
    assert ours.block_size == 8  # DFlashSpeculatorConfig's default
    assert ours.draft_vocab_size == 32000  # its default; with 256 target ids that is a reduced draft vocabulary
    assert ours.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0} == qwen3.rope_parameters
    assert (ours.head_dim, ours.max_position_embeddings, ours.rms_norm_eps) == (
        qwen3.head_dim, qwen3.max_position_embeddings, qwen3.rms_norm_eps)


def test_a_failed_write_leaves_no_folder(saved, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(conversion, "save_file", fail)  # config.json is written first, then the weights fail
    with pytest.raises(OSError, match="disk full"):
        conversion.convert(saved / "plain", tmp_path / "out", "zlab")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "empty").mkdir()  # an empty folder given as out stays as it was
    with pytest.raises(OSError, match="disk full"):
        conversion.convert(saved / "plain", tmp_path / "empty", "zlab")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())
    monkeypatch.undo()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        conversion.convert(saved / "plain", tmp_path / "full", "zlab")


def test_a_converted_folder_has_the_usual_permissions(saved, tmp_path):
    """The folder is staged under another name and renamed into place: it must be made as any new folder is (the
    umask's permissions), not private to its owner as a tempfile folder is."""
    umask = os.umask(0o022)
    try:
        for layout in ("zlab", "ours"):
            out = conversion.convert(saved / "plain", tmp_path / layout, layout)
            assert stat.S_IMODE(out.stat().st_mode) == 0o755, oct(out.stat().st_mode)
            assert stat.S_IMODE((out / "config.json").stat().st_mode) == 0o644
    finally:
        os.umask(umask)


@pytest.mark.parametrize("damage", ["half", "header"])
def test_a_truncated_weights_file_is_refused_with_the_fix(saved, tmp_path, capsys, damage):
    """An interrupted download leaves a truncated safetensors file: convert says to download it again (or save it
    again), for the drafter's weights and for the target's that speculators copies, and writes nothing."""
    shutil.copytree(saved / "plain", tmp_path / "drafter")
    weights = tmp_path / "drafter" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "half" else data[:20])
    fix = "is truncated or corrupted .*; download it again, or save the checkpoint again"
    with pytest.raises(ValueError, match=f"{re.escape(str(weights))} {fix}"):
        conversion.convert(tmp_path / "drafter", tmp_path / "out", "zlab")
    assert main(["convert", str(tmp_path / "drafter"), str(tmp_path / "out"), "--to", "zlab"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hf-dflash convert: error: ") and re.search(fix, err) and err.count("\n") == 1, err

    shutil.copytree(saved / "target", tmp_path / "target")
    target_weights = tmp_path / "target" / "model.safetensors"
    target_weights.write_bytes(target_weights.read_bytes()[:20])
    with pytest.raises(ValueError, match=f"{re.escape(str(target_weights))} {fix}"):
        conversion.convert(saved / "plain", tmp_path / "out", "speculators", target=tmp_path / "target")
    assert not (tmp_path / "out").exists()
