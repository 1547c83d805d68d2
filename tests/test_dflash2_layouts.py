"""DFlash2 drafters in every layout that has a DFlash2 form: z-lab's published config and tensor names read strictly,
exact round trips through ours, z-lab's and speculators', and refusals that name what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash import convert as conversion
from hf_dflash.cli import main
from hf_dflash.modeling.dflash_layouts import DFLASH2_DEFAULTS, detect_layout
from hf_dflash.modeling.modeling_dflash2 import DFlash2DraftModel
from tests.conftest import MASK_ID, tiny_target
from tests.test_convert import assert_same_drafter
from tests.test_dflash2 import randomized

# z-lab/dflash tests/fixtures/dflash2-config.json: the published DFlash2 layout, as z-lab writes it.
ZLAB_CONFIG = {
    "architectures": ["DFlash2DraftModel"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 200000,
    "is_causal": False,
    "dflash_config": {
        "block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2, "final_logit_softcapping": 20.0,
        "mask_token_id": 201818, "output_multiplier": 0.19611613513818404, "selector_rank": 256, "selector_top_k": 16,
        "target_layer_ids": [1, 13, 25, 37, 49],
    },
    "dtype": "bfloat16", "eos_token_id": 200001, "head_dim": 128, "hidden_act": "silu", "hidden_size": 6656,
    "initializer_range": 0.02, "intermediate_size": 19968, "layer_types": ["sliding_attention"] * 5,
    "max_position_embeddings": 131072, "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 32,
    "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 52, "pad_token_id": 200018,
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "sliding_window": 2048, "tie_word_embeddings": False, "transformers_version": "5.15.0", "use_cache": False,
    "use_sliding_window": True, "vocab_size": 202048,
}
# z-lab/dflash tests/fixtures/dflash2-safetensors-header.json, every tensor's shape: these outside the layers, and
# LAYER_TENSORS in each of layers.0 .. layers.4.
ZLAB_TENSORS = {
    "candidate_selector.hidden_projection.weight": (256, 6656),
    "candidate_selector.predecessor_codebook": (202048, 256),
    "candidate_selector.successor_codebook": (202048, 256),
    "fc.weight": (6656, 33280),
    "hidden_norm.weight": (6656,),
    "norm.weight": (6656,),
}
LAYER_TENSORS = {
    "attention_conv.base_kernel": (2, 2, 6656),
    "attention_conv.kernel_projection.weight": (1664, 6656),
    "input_layernorm.weight": (6656,),
    "mlp.down_proj.weight": (6656, 19968),
    "mlp.gate_proj.weight": (19968, 6656),
    "mlp.up_proj.weight": (19968, 6656),
    "mlp_conv.base_kernel": (2, 2, 6656),
    "mlp_conv.kernel_projection.weight": (1664, 6656),
    "post_attention_layernorm.weight": (6656,),
    "self_attn.k_norm.weight": (128,),
    "self_attn.k_proj.weight": (1024, 6656),
    "self_attn.o_proj.weight": (6656, 4096),
    "self_attn.q_norm.weight": (128,),
    "self_attn.q_proj.weight": (4096, 6656),
    "self_attn.v_proj.weight": (1024, 6656),
}


def test_zlabs_published_dflash2_layout_reads_into_exactly_its_tensors():
    config = detect_layout(ZLAB_CONFIG).read_config(ZLAB_CONFIG)
    assert detect_layout(ZLAB_CONFIG).name == "zlab" and config.architecture == "dflash2"
    assert (config.block_size, config.conv_kernel_size, config.conv_group_size) == (16, 2, 16)
    assert (config.selector_rank, config.selector_top_k, config.final_logit_softcapping) == (256, 16, 20.0)
    assert config.output_multiplier == pytest.approx(0.19611613513818404) and config.input_embedding_scale == 1.0
    assert config.layer_types == ["sliding_attention"] * 5 and config.sliding_window == 2048
    with torch.device("meta"):
        model = DFlash2DraftModel(config)
    expected = dict(ZLAB_TENSORS)
    for i in range(5):
        expected.update({f"layers.{i}.{name}": shape for name, shape in LAYER_TENSORS.items()})
    assert {name: tuple(t.shape) for name, t in model.state_dict().items()} == expected


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A target and a DFlash2 drafter of ours for it, with random weights (every scale and the cap set)."""
    root = tmp_path_factory.mktemp("dflash2")
    target = tiny_target("qwen3")
    target.save_pretrained(root / "target")
    config = DFlashConfig.for_target(
        target.config, num_hidden_layers=2, block_size=8, mask_token_id=MASK_ID, conv_kernel_size=3,
        conv_group_size=8, selector_rank=12, selector_top_k=6, output_multiplier=0.5, final_logit_softcapping=15.0,
        input_embedding_scale=1.5, layer_types=["sliding_attention", "full_attention"],
        sliding_window=target.config.max_position_embeddings,
    )
    randomized(DFlash2DraftModel(config), seed=4).save_pretrained(root / "ours")
    return root


@pytest.mark.parametrize("layout", ["zlab", "speculators"])
def test_round_trip_through_each_dflash2_layout(saved, tmp_path, layout):
    conversion.convert(saved / "ours", tmp_path / layout, layout, target=saved / "target")
    written = json.loads((tmp_path / layout / "config.json").read_text())
    assert written["architectures"] == ["DFlash2DraftModel"]
    assert conversion.detect_format(written) == layout and detect_layout(written).architecture == "dflash2"
    # loads as it is, strictly (every tensor used, every parameter filled), as a DFlash2 drafter
    if layout == "zlab":
        loaded = DFlashDraftModel.from_pretrained(tmp_path / layout)
        assert type(loaded) is DFlash2DraftModel
        original = DFlashDraftModel.from_pretrained(saved / "ours")
        for name, tensor in original.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name
    conversion.convert(tmp_path / layout, tmp_path / "back", "ours")
    ours, back = conversion.load(saved / "ours"), conversion.load(tmp_path / "back")
    assert_same_drafter(ours, back)
    assert {k: getattr(back.config, k) for k in DFLASH2_DEFAULTS} == dict(
        conv_kernel_size=3, conv_group_size=8, selector_rank=12, selector_top_k=6, output_multiplier=0.5,
        final_logit_softcapping=15.0, input_embedding_scale=1.5,
    )
    # and the same file again from ours: the layout's writing is a function of the drafter
    conversion.convert(tmp_path / "back", tmp_path / "again", layout, target=saved / "target")
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == written


def test_zlab_dflash2_config_is_written_as_zlab_publishes_it(saved, tmp_path):
    conversion.convert(saved / "ours", tmp_path / "zlab", "zlab")
    written = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert written["is_causal"] is False and "block_size" not in written
    nested = written["dflash_config"]
    assert set(nested) == {"block_size", "mask_token_id", "target_layer_ids", *DFLASH2_DEFAULTS}
    assert set(ZLAB_CONFIG["dflash_config"]) <= set(nested)


def test_speculators_dflash2_config_is_speculators_own(saved, tmp_path):
    conversion.convert(saved / "ours", tmp_path / "spec", "speculators", target=saved / "target")
    written = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert written["speculators_model_type"] == "dflash2"
    assert written["speculators_config"]["algorithm"] == "dflash2"
    assert written["sliding_window_non_causal"] is True
    assert (written["conv_kernel_size"], written["selector_top_k"]) == (3, 6)
    # speculators' defaults for the fields a file leaves out are the published ones
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        del written[name]
    written["selector_top_k"] = 6  # the tiny vocabulary's top-k; the rest at speculators' defaults would not fit
    config = detect_layout(written).read_config({**written, "conv_group_size": 8})
    assert (config.conv_kernel_size, config.selector_rank) == (2, 256)


def refused(config_change, message, saved, tmp_path, tensors_change=None):
    folder = tmp_path / "bad"
    conversion.convert(saved / "ours", folder, "zlab")
    config = json.loads((folder / "config.json").read_text())
    config_change(config)
    (folder / "config.json").write_text(json.dumps(config))
    if tensors_change is not None:
        tensors = load_file(folder / "model.safetensors")
        tensors_change(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        DFlashDraftModel.from_pretrained(folder)


def test_an_unknown_dflash_config_field_is_refused_with_its_name(saved, tmp_path):
    refused(lambda c: c["dflash_config"].update(selector_layers=3), r"holds \['selector_layers'\], which hf-dflash",
            saved, tmp_path)


def test_dflash2_fields_under_another_class_name_are_refused(saved, tmp_path):
    refused(lambda c: c.update(architectures=["DFlashDraftModel"]),
            r"sets the DFlash2 fields \[.*'conv_kernel_size'.*\] but its architectures \['DFlashDraftModel'\]",
            saved, tmp_path)


def test_a_missing_or_extra_dflash2_tensor_is_refused_with_its_name(saved, tmp_path):
    refused(lambda c: None, "layers.1.mlp_conv.base_kernel", saved, tmp_path,
            lambda t: t.pop("layers.1.mlp_conv.base_kernel"))
    refused(lambda c: None, "candidate_selector.extra", saved, tmp_path / "2",
            lambda t: t.update({"candidate_selector.extra": torch.zeros(2)}))


def test_a_dflash2_config_declared_causal_is_refused(saved, tmp_path):
    refused(lambda c: c.update(is_causal=True), "would compute differently here", saved, tmp_path)


def test_layouts_without_a_dflash2_form_refuse_it(saved, tmp_path):
    with pytest.raises(ValueError, match="the native layout cannot hold a dflash2 drafter"):
        conversion.convert(saved / "ours", tmp_path / "native", "native")
    assert not (tmp_path / "native").exists()


def test_speculators_dflash2_with_causal_sliding_layers_or_a_draft_vocabulary_is_refused(saved, tmp_path):
    conversion.convert(saved / "ours", tmp_path / "spec", "speculators", target=saved / "target")
    written = json.loads((tmp_path / "spec" / "config.json").read_text())
    with pytest.raises(ValueError, match="sliding_window_non_causal: false"):
        detect_layout(written).read_config({**written, "sliding_window_non_causal": False})
    with pytest.raises(ValueError, match="DFlash2's selector scores the full vocabulary"):
        detect_layout(written).read_config({**written, "draft_vocab_size": 40})
    drafter = DFlashDraftModel.from_pretrained(saved / "ours")
    drafter.set_draft_vocabulary(list(range(64)))
    drafter.save_pretrained(tmp_path / "reduced")
    with pytest.raises(ValueError, match="draft over the full vocabulary"):
        conversion.convert(tmp_path / "reduced", tmp_path / "spec2", "speculators", target=saved / "target")


def test_cli_convert_and_info_describe_a_dflash2_drafter(saved, tmp_path, capsys):
    assert main(["convert", str(saved / "ours"), str(tmp_path / "zlab"), "--to", "zlab"]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "zlab")]) == 0
    out = capsys.readouterr().out
    assert "DFlash2" in out and "selector" in out
