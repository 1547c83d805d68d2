"""DFlashConfig reads every published layout and builds fresh drafters for any target."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, Qwen3Config

from hf_dflash import DFlashConfig, DFlashDraftModel, default_target_layer_ids
from hf_dflash import convert as conversion
from hf_dflash.cli import main
from hf_dflash.modeling.configuration_dflash import DFLASH_DEFAULTS

# z-lab/Qwen3-8B-DFlash-b16 as published (fields a loader must honour; see hub_configs/).
ZLAB_QWEN3_8B = {
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3",
    "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 5,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "vocab_size": 151936,
    "layer_types": ["full_attention"] * 5,
}


def test_published_default_layer_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # Llama-3.1-8B
    assert default_target_layer_ids(30, 1) == [15]
    with pytest.raises(ValueError, match="target_layer_ids"):
        default_target_layer_ids(3, 2)


def test_zlab_layout_is_read():
    config = DFlashConfig(**ZLAB_QWEN3_8B)
    assert config.block_size == 16
    assert config.mask_token_id == 151669
    assert config.target_layer_ids == [1, 9, 17, 25, 33]
    assert config.rope_parameters["rope_theta"] == 1000000
    assert config.num_context_features == 5 * 4096
    assert not hasattr(config, "dflash_config")  # folded into one place


def test_block_size_inside_dflash_config_and_rope_parameters():
    fields = {k: v for k, v in ZLAB_QWEN3_8B.items() if k not in ("block_size", "rope_theta")}
    fields["dflash_config"] = {**fields["dflash_config"], "block_size": 10}
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    config = DFlashConfig(**fields)
    assert config.block_size == 10
    assert config.rope_parameters["rope_theta"] == 500000.0


def test_native_and_speculators_field_names():
    native = DFlashConfig(num_hidden_layers=2, block_size=8, mask_token_id=7, target_layer_ids=[1, 3])
    assert (native.block_size, native.mask_token_id, native.target_layer_ids) == (8, 7, [1, 3])
    # speculators count hidden_states indices (0 = the embedding output): their layer id is ours + 1.
    speculators = DFlashConfig(num_hidden_layers=2, aux_hidden_state_layer_ids=[2, 4], mask_token_id=1)
    assert speculators.target_layer_ids == [1, 3]
    with pytest.raises(ValueError, match="hf-dflash convert"):
        DFlashConfig(speculators_model_type="dflash", transformer_layer_config={"hidden_size": 64})


def test_round_trip_through_dict():
    config = DFlashConfig(**ZLAB_QWEN3_8B)
    again = DFlashConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"block_size": 1}, "block_size"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"layer_types": ["sliding_attention"] * 5}, "sliding_window"),
        ({"num_key_value_heads": 5}, "multiple"),
        ({"target_hidden_size": 2048}, "as wide as its target"),
        ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 40]}}, "outside the target"),
    ],
)
def test_bad_configs_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        DFlashConfig(**{**ZLAB_QWEN3_8B, **fields})


SLIDING_THEN_FULL = {"layer_types": ["sliding_attention"] * 4 + ["full_attention"], "sliding_window": 2048}


@pytest.mark.parametrize(
    "fields",
    [
        {**SLIDING_THEN_FULL, "is_causal": True},  # would make the full layer causal
        {**SLIDING_THEN_FULL, "is_causal": False},  # would make the sliding layers bidirectional
        {"is_causal": True},  # every layer full: all would be causal
        {
            **SLIDING_THEN_FULL,
            "dflash_config": {**ZLAB_QWEN3_8B["dflash_config"], "causal": False},
        },
    ],
)
def test_declared_causality_we_do_not_run_is_refused(fields):
    """z-lab's reference, vLLM and SGLang let `is_causal` (vLLM also `dflash_config.causal`) set every layer's
    causality; we run sliding layers causal and full ones bidirectional, so any other pattern is refused."""
    with pytest.raises(ValueError, match="hf-dflash runs sliding layers causal and full layers bidirectional"):
        DFlashConfig(**{**ZLAB_QWEN3_8B, **fields})


@pytest.mark.parametrize(
    "fields",
    [
        {"is_causal": False},  # every layer full: bidirectional, as we run them
        {"layer_types": ["sliding_attention"] * 5, "sliding_window": 2048, "is_causal": True},
        {"dflash_config": {**ZLAB_QWEN3_8B["dflash_config"], "causal": False}},
        {**SLIDING_THEN_FULL, "is_causal": None},
        # the top-level flag wins over dflash_config's, as in vLLM
        {"is_causal": False, "dflash_config": {**ZLAB_QWEN3_8B["dflash_config"], "causal": True}},
    ],
)
def test_declared_causality_we_run_is_read_and_not_kept(fields):
    config = DFlashConfig(**{**ZLAB_QWEN3_8B, **fields})
    assert config.layer_types == fields.get("layer_types", ["full_attention"] * 5)
    assert "is_causal" not in config.to_dict() and "causal" not in config.to_dict()


def test_for_target_copies_the_target_shape():
    target = Qwen3Config(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 12345.0},
    )
    config = DFlashConfig.for_target(target, num_hidden_layers=3, block_size=8, tokenizer_size=990)
    assert config.mask_token_id == 990  # the first embedding row the tokenizer never produces
    assert config.target_layer_ids == default_target_layer_ids(12, 3)
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim) == (128, 2, 32)
    assert config.rope_parameters["rope_theta"] == 12345.0
    assert config.num_target_layers == 12 and config.vocab_size == 1000


def test_for_target_takes_the_full_attention_rope_of_a_per_layer_type_one():
    """Gemma 3 and OLMo 3 keep one RoPE per layer type (Gemma 3's sliding layers a base of 10,000, its full ones
    1,000,000); a drafter applies one RoPE to its layers, which are full attention, so it copies the full layers'."""
    target = AutoConfig.for_model(
        "gemma3_text", vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
        layer_types=["sliding_attention", "full_attention"],
    )
    assert target.rope_parameters["sliding_attention"] != target.rope_parameters["full_attention"]
    config = DFlashConfig.for_target(target, mask_token_id=3)
    assert config.rope_parameters == target.rope_parameters["full_attention"]
    DFlashDraftModel(config)  # builds its rotary tables from it


def test_for_target_asks_for_a_mask_token_when_none_is_free():
    target = LlamaConfig(vocab_size=500, hidden_size=64, num_hidden_layers=4, num_attention_heads=4)
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.for_target(target, tokenizer_size=500)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        DFlashConfig.for_target(target, mask_token_id=500)
    assert DFlashConfig.for_target(target, mask_token_id=3).mask_token_id == 3


# The least a published config can hold; every other field takes its layout's default.
MINIMAL = {"block_size": 4, "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 2]}, "num_target_layers": 4}


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "gpt_oss", "muse_glimmer_assistant"])
def test_missing_fields_take_the_layout_readers_defaults(model_type):
    """z-lab's DFlashDraftModel (and speculators' decoder config) build the transformers config of the file's
    model_type, transformers' assistant MuseGlimmerAssistantConfig: a field the file leaves out has that class's
    default, not ours."""
    reference = AutoConfig.for_model(model_type)
    config = DFlashConfig(model_type=model_type, **MINIMAL)
    compared = [name for name in DFLASH_DEFAULTS if hasattr(reference, name)]
    assert {"rope_parameters", "head_dim", "num_key_value_heads", "max_position_embeddings"} <= set(compared)
    for name in compared:
        assert getattr(config, name) == getattr(reference, name), name


def test_our_layout_keeps_our_defaults():
    config = DFlashConfig(**MINIMAL)
    for name, value in DFLASH_DEFAULTS.items():
        if value is not None:
            assert getattr(config, name) == value, name
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": DFlashConfig.default_theta}
    assert config.head_dim == config.hidden_size // config.num_attention_heads
    again = DFlashConfig.from_dict(DFlashConfig(model_type="qwen3", **MINIMAL).to_dict())  # saved as ours: explicit
    assert again.rope_parameters["rope_theta"] == 10000.0 and again.head_dim == 128


def test_zlab_config_without_rope_theta_computes_as_zlab_does():
    """z-lab's class reads a config without rope_theta with Qwen3Config's 10000 (our own default is 1e6): the drafter
    must compute the same as one given rope_theta 10000 explicitly."""
    fields = {k: v for k, v in ZLAB_QWEN3_8B.items() if k != "rope_theta"}
    fields.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_hidden_layers=2, layer_types=["full_attention"] * 2)
    fields["dflash_config"] = {"mask_token_id": 3, "target_layer_ids": [1, 9]}
    outputs = {}
    for theta in (None, 10000.0, 1e6):
        torch.manual_seed(0)
        drafter = DFlashDraftModel(DFlashConfig(**fields, **({} if theta is None else {"rope_theta": theta}))).eval()
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            outputs[theta] = drafter(
                noise_embeds=torch.randn(1, 16, 64, generator=generator),
                context_hidden_states=torch.randn(1, 40, drafter.config.num_context_features, generator=generator),
                position_ids=torch.arange(56)[None],
            ).last_hidden_state
    assert torch.equal(outputs[None], outputs[10000.0])
    assert not torch.allclose(outputs[None], outputs[1e6], atol=1e-3)


def test_zlab_config_without_block_size_is_refused():
    fields = {k: v for k, v in ZLAB_QWEN3_8B.items() if k != "block_size"}
    with pytest.raises(ValueError, match="no block_size"):
        DFlashConfig(**fields)


# A published layout's config (z-lab's), scaled down: every bad value below is refused wherever a config is built.
SMALL_ZLAB = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8, "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_hidden_layers": 2, "num_target_layers": 8, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "max_position_embeddings": 4096, "vocab_size": 512, "layer_types": ["full_attention"] * 2,
    "dflash_config": {"mask_token_id": 500, "target_layer_ids": [1, 5]},
}
SLIDING_PAIR = ["sliding_attention", "full_attention"]
BAD_FIELDS = [
    ({"block_size": 8.5}, "block_size must be an integer from 2 to 1024"),
    ({"block_size": 100000}, "block_size must be an integer from 2 to 1024"),
    ({"block_size": "sixteen"}, "block_size must be an integer from 2 to 1024 .*got 'sixteen'"),
    ({"block_size": True}, "block_size must be an integer"),
    ({"block_size": 64, "max_position_embeddings": 32}, "block_size 64 is more than max_position_embeddings 32"),
    ({"dflash_config": {"mask_token_id": 500, "target_layer_ids": "2"}}, "target_layer_ids must be a non-empty list"),
    ({"dflash_config": {"mask_token_id": 500, "target_layer_ids": []}}, "target_layer_ids must be a non-empty list"),
    ({"dflash_config": {"mask_token_id": 500, "target_layer_ids": [1, 2.0]}}, "target_layer_ids must be a non-empty"),
    ({"dflash_config": {"mask_token_id": 512, "target_layer_ids": [1, 5]}},
     r"mask_token_id 512 is outside the target vocabulary \(0..511\)"),
    ({"dflash_config": {"mask_token_id": -1, "target_layer_ids": [1, 5]}}, "mask_token_id must be an integer >= 0"),
    ({"dflash_config": "mask 500"}, "dflash_config must be an object"),
    ({"target_hidden_size": "64"}, "target_hidden_size must be an integer >= 1"),
    ({"hidden_size": -64}, "hidden_size must be an integer >= 1"),
    ({"intermediate_size": 0}, "intermediate_size must be an integer >= 1"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer >= 1"),
    ({"num_target_layers": -8}, "num_target_layers must be an integer >= 1"),
    ({"num_attention_heads": 3}, r"num_attention_heads \(3\) must be a multiple of num_key_value_heads \(2\)"),
    ({"head_dim": 15}, "head_dim must be an even integer >= 2"),
    ({"model_type": "dflash", "head_dim": None, "hidden_size": 66}, "hidden_size 66 is not a multiple of num_attent"),
    ({"model_type": "dflash", "head_dim": None, "hidden_size": 24, "num_attention_heads": 8},
     "head_dim must be an even integer >= 2 .*got 3"),
    ({"rope_theta": None, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
     "not a valid qwen3 config.*factor"),
    ({"vocab_size": 0}, "vocab_size must be an integer >= 1"),
    ({"layer_types": "full_attention"}, "layer_types must be a non-empty list of strings"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries but the drafter has 2 layers"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "unsupported layer_types"),
    ({"layer_types": SLIDING_PAIR}, "sliding_window is not set"),
    ({"layer_types": SLIDING_PAIR, "sliding_window": 0}, "sliding_window must be an integer >= 1"),
    ({"layer_types": SLIDING_PAIR, "sliding_window": "4096"}, "sliding_window must be an integer >= 1"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a number > 0"),
    ({"rope_theta": "large"}, "rope_theta must be a number > 0"),
    ({"rope_theta": None, "rope_parameters": {"rope_type": "spiral", "rope_theta": 1e4}}, "rope_type 'spiral'"),
    ({"hidden_act": "no_such_activation"}, "hidden_act 'no_such_activation'"),
    ({"attention_bias": "yes"}, "attention_bias must be true or false"),
    ({"is_causal": "no"}, "is_causal .* must be true or false"),
]


def write_drafter_config(folder, fields: dict) -> str:
    """A drafter folder holding only config.json: `fields` over SMALL_ZLAB, None meaning the field is left out."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in {**SMALL_ZLAB, **fields}.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_the_small_published_config_is_fine():
    config = DFlashConfig(**SMALL_ZLAB)
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (8, 500, [1, 5])


@pytest.mark.parametrize("fields, message", BAD_FIELDS)
def test_every_field_is_checked_where_the_config_is_built(fields, message):
    with pytest.raises(ValueError, match=message):
        DFlashConfig(**{**SMALL_ZLAB, **fields})


@pytest.mark.parametrize("fields, message", [
    *BAD_FIELDS,
    ({"vocab_size": None}, "no vocab_size"),  # a file must say it: the fit checks against the target read it
])
def test_from_pretrained_info_and_convert_refuse_the_same_configs(tmp_path, capsys, fields, message):
    """The library loads (config and model), `hf-dflash info` and `hf-dflash convert` refuse each, with the same
    message: the commands as a bad argument (exit status 2, one line), before any weights are read."""
    folder = write_drafter_config(tmp_path / "drafter", fields)
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_pretrained(folder)
    with pytest.raises(ValueError, match=message):
        DFlashDraftModel.from_pretrained(folder)
    for command in (["info", folder], ["convert", folder, str(tmp_path / "out"), "--to", "ours"]):
        with pytest.raises(SystemExit) as refused:
            main(command)
        err = capsys.readouterr().err
        assert refused.value.code == 2 and re.search(message, err), err
        assert err.startswith(f"hf-dflash {command[0]}: error: drafter " if command[0] == "info" else
                              f"hf-dflash {command[0]}: error: source ") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, message", [
    ("{\"model_type\": \"qwen3\",", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
])
def test_a_config_that_is_not_json_is_named(tmp_path, capsys, text, message):
    (tmp_path / "drafter").mkdir()
    path = tmp_path / "drafter" / "config.json"
    path.write_text(text)
    folder = str(tmp_path / "drafter")
    named = re.escape(str(path))
    with pytest.raises(ValueError, match=f"{named} {message}"):
        conversion.convert(folder, tmp_path / "out", "ours")
    for command in (["info", folder], ["convert", folder, str(tmp_path / "out"), "--to", "ours"]):
        with pytest.raises(SystemExit) as refused:
            main(command)
        err = capsys.readouterr().err
        assert refused.value.code == 2 and re.search(f"{named} {message}", err) and err.count("\n") == 1, err
    if message == "is not valid JSON":  # transformers reads it for from_pretrained, and names the file too
        for load in (DFlashConfig.from_pretrained, DFlashDraftModel.from_pretrained):
            with pytest.raises(OSError, match=f"{named}.* is not a valid JSON file"):
                load(folder)


def test_the_installed_info_command_refuses_a_bad_config_in_one_line(tmp_path):
    """As a user runs it: the venv's `hf-dflash info FOLDER`, exit status 2, one line on stderr naming the fix (the
    other refusals above go through the same `main`)."""
    command = pathlib.Path(sys.executable).parent / "hf-dflash"
    folder = write_drafter_config(tmp_path / "bad", {"block_size": 8.5})
    result = subprocess.run([str(command), "info", folder], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr == (
        f"hf-dflash info: error: drafter {folder}: block_size must be an integer from 2 to 1024 (tokens per drafted "
        "block, the anchor included, verified in one target forward), got 8.5; correct it in the drafter's "
        "config.json, or where the config is built\n"
    )
