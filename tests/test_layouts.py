"""Each drafter layout round-trips through dflash_layouts, and each written file, read by the reader its layout is for,
runs its sliding layers with exactly the window we run."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash import convert as conversion
from hf_dflash.hub import published_drafters
from hf_dflash.modeling.dflash_layouts import (
    LAYOUTS,
    Drafter,
    NativeLayout,
    OursLayout,
    SpeculatorsLayout,
    TargetVocabulary,
    ZLabLayout,
    detect_layout,
    layout_named,
    read_config_file,
)
from tests.conftest import tiny_drafter, tiny_target

SLIDING, FULL = "sliding_attention", "full_attention"
CONTEXT_ROWS = 9  # longer than the window below, so that the window cuts context


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def drafter_of(target, window: int | None = None) -> Drafter:
    """A drafter of ours in our terms: a sliding layer then a full one when `window` is given, full layers otherwise."""
    layout = {} if window is None else dict(layer_types=[SLIDING, FULL], sliding_window=window)
    model = tiny_drafter(target, block_size=4, **layout)
    return Drafter(model.config, dict(model.state_dict()))


def runnable(drafter: Drafter) -> DFlashDraftModel:
    model = DFlashDraftModel(drafter.config)
    model.load_state_dict(drafter.tensors)
    return model.eval()


def target_vocabulary(target) -> TargetVocabulary:
    return TargetVocabulary(
        source="org/tiny-target", config=target.config.to_dict(),
        embedding=target.get_input_embeddings().weight.detach().clone(),
        lm_head=target.get_output_embeddings().weight.detach().clone(),
    )


def assert_same(a: Drafter, b: Drafter) -> None:
    assert conversion.core_fields(a.config) == conversion.core_fields(b.config)
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


@pytest.mark.parametrize("layout", [ZLabLayout, NativeLayout, SpeculatorsLayout], ids=lambda layout: layout.name)
def test_a_published_layout_round_trips_through_its_class(target, layout):
    drafter = drafter_of(target)
    vocabulary = target_vocabulary(target) if layout.needs_target else None
    config = json.loads(json.dumps(layout.write_config(drafter, vocabulary)))  # as its config.json holds it
    tensors = layout.write_tensors(drafter, vocabulary)
    assert detect_layout(config) is layout and layout_named(layout.name) is layout
    assert (set(tensors) == set(drafter.tensors)) == (not layout.renamed_tensors and not layout.needs_target)
    assert_same(layout.read(config, tensors), drafter)


def test_our_layout_round_trips_through_its_class(target, tmp_path):
    drafter = drafter_of(target, window=3)
    OursLayout.write(tmp_path, drafter)
    config = read_config_file(tmp_path)
    assert detect_layout(config) is OursLayout and config["auto_map"]
    assert_same(OursLayout.read(config, load_file(str(tmp_path / "model.safetensors"))), drafter)


def test_every_layout_is_detected_as_itself_and_no_other():
    dflash2 = {"architectures": ["DFlash2DraftModel"]}
    written = {
        ("ours", "dflash"): {"model_type": "dflash"},
        ("ours", "dflash2"): {"model_type": "dflash", **dflash2},
        ("zlab", "dflash"): {"model_type": "qwen3", "dflash_config": {}},
        ("zlab", "dflash2"): {"model_type": "qwen3", "dflash_config": {}, **dflash2},
        ("native", "dflash"): {"model_type": "muse_glimmer_assistant"},
        ("speculators", "dflash"): {"speculators_model_type": "dflash", "transformer_layer_config": {}},
        ("speculators", "dflash2"): {"speculators_model_type": "dflash2", "transformer_layer_config": {}, **dflash2},
    }
    assert len(written) == len(LAYOUTS)
    for layout in LAYOUTS:
        assert [other for other in LAYOUTS if other.detects(written[layout.name, layout.architecture])] == [layout]
    # a DFlash2 field alone (z-lab's files keep them in dflash_config) makes a file DFlash2's
    assert detect_layout({"model_type": "qwen3", "dflash_config": {"selector_top_k": 8}}).architecture == "dflash2"


def test_configs_of_no_dflash_drafter_are_refused_naming_what_they_are():
    """A target's config, and another algorithm's speculators checkpoint, are not read as a DFlash drafter."""
    with pytest.raises(ValueError, match="model_type 'llama'.*not a DFlash drafter"):
        detect_layout({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        detect_layout({"speculators_model_type": "eagle3", "transformer_layer_config": {}})


# ---------------------------------------------------------------------------------------------------------------
# Windows: what each written file's own reader runs
# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def block_rows(drafter: DFlashDraftModel, layer_types: list[str], window: int | None) -> torch.Tensor:
    """The drafter's block rows (B, H) over CONTEXT_ROWS context rows, with the attention a reader that sees
    `layer_types` and `window` runs (z-lab's reference, vLLM): a sliding layer's row at position p sees positions
    p - window + 1 .. p, or every position up to p when the reader has no window (z-lab's class then still runs the
    layer causal); a full layer's row sees everything."""
    model = copy.deepcopy(drafter)
    model.config.layer_types = list(layer_types)  # the forward picks each layer's mask by this list
    block = model.config.block_size
    rows = CONTEXT_ROWS + block
    behind = torch.arange(CONTEXT_ROWS, rows)[:, None] - torch.arange(rows)[None, :]  # (B, c + B)
    sliding = (behind >= 0) & (behind < (window if window is not None else rows))
    generator = torch.Generator().manual_seed(0)
    context = torch.randn(1, CONTEXT_ROWS, model.config.num_context_features, generator=generator)
    noise = torch.randn(1, block, model.config.hidden_size, generator=generator)
    return model(
        noise_embeds=noise, context_hidden_states=context, position_ids=torch.arange(rows)[None],
        attention_mask={FULL: None, SLIDING: sliding[None, None]},
    ).last_hidden_state[0]


def reader_view(config) -> tuple[list[str], int | None]:
    """(layer types, the window its sliding layers get) as a reader's config object holds them."""
    return list(config.layer_types), config.sliding_window


def test_each_written_layout_windows_exactly_as_we_run_it(target, tmp_path):
    """A drafter whose window (3) is shorter than its context (9 rows): the file each layout writes, read by that
    layout's own reader (our loader; transformers' Qwen3Config, which z-lab's class builds), runs the same window, so
    its block rows equal ours. The same layers unwindowed compute differently, so the window binds here."""
    drafter = drafter_of(target, window=3)
    ours = runnable(drafter)
    intended = block_rows(ours, ours.config.layer_types, 3)
    assert not torch.allclose(block_rows(ours, ours.config.layer_types, None), intended, atol=1e-4)

    conversion.save(drafter, tmp_path / "ours", "ours")
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "ours").eval()
    assert torch.equal(block_rows(loaded, *reader_view(loaded.config)), intended)

    conversion.save(drafter, tmp_path / "zlab", "zlab")
    zlab_reader = AutoConfig.from_pretrained(tmp_path / "zlab")  # the Qwen3Config z-lab's DFlashDraftModel reads
    assert type(zlab_reader).__name__ == "Qwen3Config"
    assert torch.equal(block_rows(ours, *reader_view(zlab_reader)), intended)
    # Without use_sliding_window (what convert wrote before), that reader drops the window: the layer runs unwindowed.
    written = read_config_file(tmp_path / "zlab")
    del written["use_sliding_window"]
    dropped = AutoConfig.for_model(written.pop("model_type"), **written)
    assert dropped.sliding_window is None
    assert not torch.allclose(block_rows(ours, *reader_view(dropped)), intended, atol=1e-4)


def test_layouts_that_cannot_hold_our_window_refuse_it_and_keep_one_that_never_cuts(target, tmp_path):
    """speculators measure the window from the block's anchor, transformers' assistant runs sliding layers
    bidirectional: a cutting window is refused by the first, any sliding layer by the second. A window that never cuts
    (max_position_embeddings) reaches speculators' decoder config intact."""
    cutting = drafter_of(target, window=3)
    with pytest.raises(ValueError, match="from the block's anchor"):
        conversion.save(cutting, tmp_path / "spec", "speculators", target="unused: refused before it is read")
    with pytest.raises(ValueError, match="sliding layers \\[0\\].*native equivalent"):
        conversion.save(cutting, tmp_path / "native", "native")
    assert not (tmp_path / "spec").exists() and not (tmp_path / "native").exists()

    whole = drafter_of(target, window=target.config.max_position_embeddings)
    config = SpeculatorsLayout.write_config(whole, target_vocabulary(target))
    layer = dict(config["transformer_layer_config"])
    speculators_reader = AutoConfig.for_model(layer.pop("model_type"), **layer)
    assert reader_view(speculators_reader) == ([SLIDING, FULL], target.config.max_position_embeddings)


@torch.no_grad()
def test_transformers_assistant_runs_sliding_layers_bidirectional():
    """Why the native layout refuses sliding layers: in transformers' Muse Glimmer assistant an earlier block row of a
    sliding layer sees a later one (ours would not)."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    torch.manual_seed(0)
    config = MuseGlimmerAssistantConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=64, layer_types=[SLIDING], sliding_window=64, target_layer_ids=[0], mask_token_id=1,
    )
    model = MuseGlimmerAssistantModel(config).eval()
    context = torch.randn(1, 3, 32)
    noise = torch.randn(1, 4, 32)
    changed = noise.clone()
    changed[:, -1] += 1.0  # only the last block row
    before, after = (model(noise_embeds=rows, context_hidden_states=context).last_hidden_state[0, 0]
                     for rows in (noise, changed))
    assert not torch.allclose(before, after, atol=1e-5)  # the first block row saw the last one


def test_a_native_config_with_sliding_layers_is_refused_when_read(tmp_path):
    native = {"model_type": "muse_glimmer_assistant", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256,
              "target_layer_ids": [1], "mask_token_id": 3}
    with pytest.raises(ValueError, match="every layer sliding .*bidirectional"):
        conversion.config_from_layout(native)  # the class default: every layer sliding
    (tmp_path / "config.json").write_text(json.dumps(native))
    with pytest.raises(ValueError, match="every layer sliding .*bidirectional"):
        DFlashConfig.from_pretrained(tmp_path)  # from_pretrained reads a file as convert does
    with pytest.raises(ValueError, match=r"sliding layers \[1\].*no hf-dflash equivalent"):
        conversion.config_from_layout({**native, "layer_types": [FULL, SLIDING], "sliding_window": 8})
    assert conversion.config_from_layout({**native, "layer_types": [FULL, FULL]}).layer_types == [FULL, FULL]


# ---------------------------------------------------------------------------------------------------------------
# Reading published configs: sliding_window and sliding layer_types without use_sliding_window
# ---------------------------------------------------------------------------------------------------------------


def test_published_sliding_configs_are_read_windowed():
    """The published Qwen3.5/3.6 drafters set sliding_window and sliding layer_types without use_sliding_window.
    transformers' Qwen3Config (z-lab's class) reads no window there; we read the window, as vLLM and SGLang run them."""
    sliding = {repo: entry.config for repo, entry in published_drafters().items() if SLIDING in entry.config.get(
        "layer_types", []) and "DFlash2DraftModel" not in entry.config["architectures"]}  # DFlash2's set it
    assert sliding, "hub_configs/ lists no sliding-window drafter"
    for repo, fields in sliding.items():
        assert not fields.get("use_sliding_window"), repo
        ours = DFlashConfig.from_dict(fields)
        assert ours.sliding_window == fields["sliding_window"] and ours.layer_types == fields["layer_types"], repo
        theirs = {k: v for k, v in fields.items() if k != "model_type"}
        assert AutoConfig.for_model(fields["model_type"], **theirs).sliding_window is None, repo


def test_a_zlab_file_without_use_sliding_window_loads_windowed(target, tmp_path):
    """Such a file, scaled down (window 3 over 9 context rows): our loader runs the window it names."""
    drafter = drafter_of(target, window=3)
    conversion.save(drafter, tmp_path / "zlab", "zlab")
    written = read_config_file(tmp_path / "zlab")
    del written["use_sliding_window"]
    (tmp_path / "zlab" / "config.json").write_text(json.dumps(written))
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "zlab").eval()
    assert reader_view(loaded.config) == ([SLIDING, FULL], 3)
    ours = runnable(drafter)
    assert torch.equal(block_rows(loaded, *reader_view(loaded.config)), block_rows(ours, ours.config.layer_types, 3))
