"""Loading every published drafter layout, strictly, and the remote-code round trip without hf_dflash."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_dflash import DFlashConfig, DFlashDraftModel

# Published drafter configs (z-lab layout) with their shapes scaled down; everything else as published.
ZLAB_SCALED = {
    "qwen3-8b-b16": {
        "model_type": "qwen3", "block_size": 16, "hidden_size": 64, "intermediate_size": 192,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "num_hidden_layers": 5,
        "num_target_layers": 36, "rope_theta": 1000000, "rms_norm_eps": 1e-6, "vocab_size": 512,
        "dflash_config": {"mask_token_id": 500, "target_layer_ids": [1, 9, 17, 25, 33]},
        "layer_types": ["full_attention"] * 5,
    },
    "qwen3-4b-b16": {  # q_proj widens: heads * head_dim (128) > hidden (40)
        "model_type": "qwen3", "block_size": 16, "hidden_size": 40, "intermediate_size": 152,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 5,
        "num_target_layers": 36, "rope_theta": 1000000, "vocab_size": 512,
        "dflash_config": {"mask_token_id": 500, "target_layer_ids": [1, 9, 17, 25, 33]},
    },
    "llama3.1-8b-b10": {  # block_size inside dflash_config, llama3 rope scaling
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 224, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 16, "num_hidden_layers": 5, "num_target_layers": 32,
        "rms_norm_eps": 1e-5, "vocab_size": 512, "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "dflash_config": {"block_size": 10, "mask_token_id": 500, "target_layer_ids": [1, 8, 15, 22, 29]},
    },
    "gpt-oss-20b-b8": {  # attention biases, yarn rope, head_dim 64 -> 16
        "model_type": "gpt_oss", "block_size": 8, "hidden_size": 48, "intermediate_size": 96,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 8,
        "num_target_layers": 24, "attention_bias": True, "vocab_size": 512, "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                            "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
        "dflash_config": {"mask_token_id": 500, "target_layer_ids": [1, 4, 8, 11, 14, 17, 19, 21]},
    },
}


def write_zlab_checkpoint(folder, fields: dict) -> dict[str, torch.Tensor]:
    """A checkpoint laid out exactly as z-lab publishes: their config.json and unprefixed safetensors names."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, **fields}
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    tensors = {k: torch.randn_like(v) for k, v in DFlashDraftModel(DFlashConfig(**fields)).state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


@pytest.mark.parametrize("name", sorted(ZLAB_SCALED))
def test_zlab_checkpoints_load_every_tensor(tmp_path, name):
    fields = ZLAB_SCALED[name]
    tensors = write_zlab_checkpoint(tmp_path / name, fields)
    drafter = DFlashDraftModel.from_pretrained(tmp_path / name)
    loaded = drafter.state_dict()
    assert set(loaded) == set(tensors)
    for key, value in tensors.items():
        assert torch.equal(loaded[key], value), key
    assert drafter.config.target_layer_ids == fields["dflash_config"]["target_layer_ids"]
    expected_block = fields.get("block_size", fields["dflash_config"].get("block_size"))
    assert drafter.config.block_size == expected_block
    # and it runs: a block over a short context
    ctx = torch.randn(1, 3, drafter.config.num_context_features)
    out = drafter(
        noise_embeds=torch.randn(1, expected_block, fields["hidden_size"]),
        context_hidden_states=ctx,
        position_ids=torch.arange(3 + expected_block)[None],
    ).last_hidden_state
    assert out.shape == (1, expected_block, fields["hidden_size"]) and torch.isfinite(out).all()


def test_missing_or_unexpected_tensors_are_errors(tmp_path):
    fields = ZLAB_SCALED["qwen3-8b-b16"]
    tensors = write_zlab_checkpoint(tmp_path / "ok", fields)
    missing = dict(tensors)
    missing.pop("layers.2.self_attn.k_norm.weight")
    write_zlab_checkpoint(tmp_path / "missing", fields)
    save_file(missing, str(tmp_path / "missing" / "model.safetensors"))
    with pytest.raises(ValueError, match="k_norm"):
        DFlashDraftModel.from_pretrained(tmp_path / "missing")
    extra = {**tensors, "lm_head.weight": torch.zeros(512, 64)}
    save_file(extra, str(tmp_path / "ok" / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head"):
        DFlashDraftModel.from_pretrained(tmp_path / "ok")


def test_native_muse_glimmer_names_load(tmp_path):
    fields = {k: v for k, v in ZLAB_SCALED["qwen3-8b-b16"].items() if k != "dflash_config"}
    fields.update(model_type="muse_glimmer_assistant", mask_token_id=500, target_layer_ids=[1, 9, 17, 25, 33])
    folder = tmp_path / "native"
    tensors = write_zlab_checkpoint(folder, fields)
    renamed = {
        k.replace("fc.", "encoder.fc.", 1).replace("hidden_norm.", "encoder.output_norm_enc.", 1)
        if k.startswith(("fc.", "hidden_norm.")) else k: v
        for k, v in tensors.items()
    }
    assert "encoder.fc.weight" in renamed and "encoder.output_norm_enc.weight" in renamed
    save_file(renamed, str(folder / "model.safetensors"))
    drafter = DFlashDraftModel.from_pretrained(folder)
    assert torch.equal(drafter.fc.weight, tensors["fc.weight"])
    assert torch.equal(drafter.hidden_norm.weight, tensors["hidden_norm.weight"])


def test_save_writes_auto_map_and_the_bundle(tmp_path):
    drafter = DFlashDraftModel(DFlashConfig(**ZLAB_SCALED["qwen3-8b-b16"]))
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dflash.DFlashConfig",
        "AutoModel": "modeling_dflash.DFlashDraftModel",
    }
    assert config["model_type"] == "dflash"
    bundle = {p.name for p in tmp_path.glob("*.py")}
    assert {"configuration_dflash.py", "modeling_dflash.py", "dflash_decoding.py", "dflash_paged_cache.py",
            "dflash_capture.py", "dflash_proposer.py", "dflash_dispatch.py"} <= bundle
    for path in tmp_path.glob("*.py"):  # the bundle stands alone: it imports nothing of the library
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module)
        assert not {name for name in imported if name.split(".")[0] == "hf_dflash"}, path.name
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) == set(drafter.state_dict())


REMOTE_CODE_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["hf_dflash"] = None  # this interpreter cannot import the library
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    try:
        import hf_dflash
        raise SystemExit("hf_dflash was importable")
    except ImportError:
        pass
    target = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
    drafter = AutoModel.from_pretrained(sys.argv[2], trust_remote_code=True).eval()
    assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
    prompt = torch.tensor([[5, 17, 99, 3, 42]])
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    out = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                          return_dict_in_generate=True)
    assert torch.equal(plain, out.sequences)
    assert len(out.acceptance_lengths[0]) >= 1
    vocabulary = None if drafter.draft_vocabulary is None else drafter.draft_vocabulary.tolist()
    print("remote-code drafter ok", out.acceptance_lengths, "vocabulary", vocabulary)
    """
)


@pytest.mark.parametrize("vocabulary", [None, [250, 3, 17, 64, 128]])
def test_remote_code_round_trip_without_hf_dflash(tmp_path, vocabulary):
    from tests.conftest import tiny_drafter, tiny_target

    target = tiny_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    drafter = tiny_drafter(target)
    drafter.set_draft_vocabulary(vocabulary)
    drafter.save_pretrained(tmp_path / "drafter")
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_CODE_SCRIPT, str(tmp_path / "target"), str(tmp_path / "drafter")],
        capture_output=True, text=True, timeout=300,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "remote-code drafter ok" in result.stdout
    assert f"vocabulary {None if vocabulary is None else sorted(vocabulary)}" in result.stdout


def test_a_draft_vocabulary_survives_save_and_load_and_a_drafter_without_one_is_unchanged(tmp_path):
    from tests.conftest import tiny_drafter, tiny_target

    from hf_dflash.modeling.dflash_draft_vocabulary import DRAFT_VOCAB_FILE

    drafter = tiny_drafter(tiny_target("llama"))
    drafter.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / DRAFT_VOCAB_FILE).exists()
    assert json.loads((tmp_path / "plain" / "config.json").read_text()).get("draft_vocab_size") is None
    plain = DFlashDraftModel.from_pretrained(tmp_path / "plain")
    assert plain.draft_vocabulary is None and plain.config.draft_vocab_size is None

    drafter.set_draft_vocabulary(torch.tensor([200, 5, 17, 3]))
    assert drafter.draft_vocabulary.tolist() == [3, 5, 17, 200] and drafter.config.draft_vocab_size == 4
    drafter.save_pretrained(tmp_path / "reduced")
    maps = load_file(str(tmp_path / "reduced" / DRAFT_VOCAB_FILE))
    assert maps["d2t"].tolist() == [3, 4, 15, 197] and maps["t2d"].nonzero()[:, 0].tolist() == [3, 5, 17, 200]
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "reduced")
    assert loaded.draft_vocabulary.tolist() == [3, 5, 17, 200] and loaded.config.draft_vocab_size == 4
    # dropping it and saving over the folder leaves no file behind that a later load or conversion would read
    loaded.set_draft_vocabulary(None)
    loaded.save_pretrained(tmp_path / "reduced")
    assert not (tmp_path / "reduced" / DRAFT_VOCAB_FILE).exists()
    assert DFlashDraftModel.from_pretrained(tmp_path / "reduced").draft_vocabulary is None


@pytest.mark.parametrize(
    "token_ids, message",
    [
        ([3, 5, 3], "repeats token id 3; pass each id once"),
        ([3, 256], r"token id 256 is outside the target vocabulary \(0..255\)"),
        ([-1, 4], "token id -1 is outside the target vocabulary"),
        ([], "non-empty 1-D list of integer target token ids"),
        ([[1, 2]], "non-empty 1-D list"),
        ([1.0, 2.0], "non-empty 1-D list"),
    ],
)
def test_bad_draft_vocabulary_ids_are_refused_with_the_fix(token_ids, message):
    from tests.conftest import tiny_drafter, tiny_target

    drafter = tiny_drafter(tiny_target("llama"))
    with pytest.raises(ValueError, match=message):
        drafter.set_draft_vocabulary(token_ids)
    assert drafter.draft_vocabulary is None and drafter.config.draft_vocab_size is None


def test_a_missing_or_inconsistent_draft_vocabulary_file_is_refused(tmp_path):
    from tests.conftest import tiny_drafter, tiny_target

    from hf_dflash.modeling.dflash_draft_vocabulary import DRAFT_VOCAB_FILE

    drafter = tiny_drafter(tiny_target("llama"))
    drafter.set_draft_vocabulary([1, 2, 3])
    drafter.save_pretrained(tmp_path)
    maps = load_file(str(tmp_path / DRAFT_VOCAB_FILE))
    save_file({"d2t": maps["d2t"], "t2d": maps["t2d"].roll(1)}, str(tmp_path / DRAFT_VOCAB_FILE))
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        DFlashDraftModel.from_pretrained(tmp_path)
    (tmp_path / DRAFT_VOCAB_FILE).unlink()
    with pytest.raises(ValueError, match="records draft_vocab_size 3 but draft_vocab.safetensors is not beside"):
        DFlashDraftModel.from_pretrained(tmp_path)
    drafter.draft_vocabulary = None  # a config that records one without the ids would save an unloadable folder
    with pytest.raises(ValueError, match="set_draft_vocabulary"):
        drafter.save_pretrained(tmp_path / "again")
