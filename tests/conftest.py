"""Shared builders: tiny random targets of the two families DFlash drafters are published for, and drafters."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hf_dflash import DFlashConfig, DFlashDraftModel

VOCAB = 256
MASK_ID = VOCAB - 1  # tests never feed this id as text, so it plays the unused embedding row


def tiny_target(family: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    shape.update(overrides)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape)).eval()
    return Qwen3ForCausalLM(Qwen3Config(head_dim=shape["hidden_size"] // shape["num_attention_heads"], **shape)).eval()


def tiny_drafter(
    target: torch.nn.Module, seed: int = 1, num_layers: int = 2, block_size: int = 4, mask_token_id: int = MASK_ID,
    **overrides,
):
    torch.manual_seed(seed)
    config = DFlashConfig.for_target(
        target.config, num_hidden_layers=num_layers, block_size=block_size, mask_token_id=mask_token_id, **overrides
    )
    return DFlashDraftModel(config).eval()


def random_prompt(length: int, seed: int = 0, batch: int = 1) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB - 1, (batch, length), generator=generator)


@pytest.fixture
def llama_pair():
    target = tiny_target("llama")
    return target, tiny_drafter(target)


@pytest.fixture
def qwen3_pair():
    target = tiny_target("qwen3")
    return target, tiny_drafter(target)
