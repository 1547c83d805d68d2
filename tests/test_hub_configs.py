"""The published drafter configs in hub_configs/ build, on the meta device, into drafters of the published size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_dflash import DFlashConfig, DFlashDraftModel

HUB_CONFIGS = Path(__file__).parent.parent / "hub_configs"
INDEX = json.loads((HUB_CONFIGS / "index.json").read_text())


@pytest.mark.parametrize("entry", INDEX, ids=[e["repo_id"] for e in INDEX])
def test_published_config_builds(entry):
    fields = json.loads((HUB_CONFIGS / entry["file"]).read_text())
    config = DFlashConfig(**fields)
    with torch.device("meta"):
        drafter = DFlashDraftModel(config)
    assert drafter.fc.weight.shape == (config.hidden_size, len(config.target_layer_ids) * config.target_hidden_size)
    assert len(drafter.layers) == config.num_hidden_layers


def test_qwen3_8b_drafter_has_the_published_size():
    fields = json.loads((HUB_CONFIGS / "z-lab--Qwen3-8B-DFlash-b16.json").read_text())
    with torch.device("meta"):
        drafter = DFlashDraftModel(DFlashConfig(**fields))
    params = sum(p.numel() for p in drafter.parameters())
    assert 1.04e9 < params < 1.06e9  # "about 1.05B parameters"
    assert drafter.config.target_layer_ids == [1, 9, 17, 25, 33] and drafter.config.mask_token_id == 151669
