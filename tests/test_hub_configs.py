"""The published drafter configs in hub_configs/ build, on the meta device, into drafters of the published size."""

from __future__ import annotations

import re

import pytest
import torch

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash.hub import HUB_CONFIGS, published_drafters
from hf_dflash.modeling.modeling_dflash2 import DFlash2DraftModel

PUBLISHED = published_drafters()


def build(repo_id: str) -> DFlashDraftModel:
    config = DFlashConfig(**PUBLISHED[repo_id].config)
    with torch.device("meta"):
        return (DFlash2DraftModel if config.is_dflash2 else DFlashDraftModel)(config)


@pytest.mark.parametrize("repo_id", sorted(PUBLISHED))
def test_published_config_builds_to_the_published_size(repo_id):
    entry = PUBLISHED[repo_id]
    assert entry.target and entry.source
    drafter = build(repo_id)
    config = drafter.config
    assert drafter.fc.weight.shape == (config.hidden_size, len(config.target_layer_ids) * config.target_hidden_size)
    assert drafter.layers[0].self_attn.q_proj.weight.shape == (
        config.num_attention_heads * config.head_dim, config.hidden_size
    )
    assert len(drafter.layers) == config.num_hidden_layers
    assert 0 <= config.mask_token_id < config.vocab_size
    assert all(0 <= i < config.num_target_layers for i in config.target_layer_ids)
    parameters = sum(p.numel() for p in drafter.parameters())
    # The Hub lists each drafter's bfloat16 safetensors size to 0.01 GiB (2 bytes per parameter).
    assert round(parameters * 2 / 2**30, 2) == pytest.approx(entry.published_weights_gib, abs=0.011), parameters
    if entry.published_parameters is not None:
        assert parameters == entry.published_parameters


def test_qwen3_8b_drafter_has_the_published_size():
    drafter = build("z-lab/Qwen3-8B-DFlash-b16")
    params = sum(p.numel() for p in drafter.parameters())
    assert 1.04e9 < params < 1.06e9  # "about 1.05B parameters"
    assert drafter.config.target_layer_ids == [1, 9, 17, 25, 33] and drafter.config.mask_token_id == 151669


def test_the_published_dflash2_drafter_reads_as_one():
    drafter = build("z-lab/Qwen3.8-27B-DFlash2")
    config = drafter.config
    assert type(drafter) is DFlash2DraftModel and config.block_size == 8
    assert (config.conv_kernel_size, config.conv_group_size, config.selector_rank, config.selector_top_k) == (
        2, 16, 256, 16
    )
    assert drafter.candidate_selector.successor_codebook.shape == (248320, 256)


def test_published_configs_answer_offline_config_requests():
    """`import hf_dflash` registers them; the fallback itself runs offline in tests/test_hub.py."""
    config = DFlashConfig.published_configs["z-lab/Qwen3.5-4B-DFlash"]
    assert config["target_model"] == "Qwen/Qwen3.5-4B" and config["dflash_config"]["block_size"] == 16


def test_provenance_names_public_sources_only():
    """Sources a user can follow: no look-up ids of our own tools, no paths of the machine the files were written on."""
    texts = [(HUB_CONFIGS / "README.md").read_text()]
    for drafter in PUBLISHED.values():
        texts += [drafter.source, *drafter.unverified]
    for text in texts:
        assert not re.search(r"find_string|\bid \d{6,}|/work/|/root/|shared/design", text), text
