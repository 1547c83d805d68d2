"""Shared builders: tiny random targets of the two families DFlash drafters are published for, and drafters."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hf_dflash import DFlashConfig, DFlashDraftModel

VOCAB = 256
MASK_ID = VOCAB - 1  # tests never feed this id as text, so it plays the unused embedding row
# HF_DFLASH_SOAK=1 runs the long variants of the property, differential and soak tests (minutes instead of seconds).
SOAK = os.environ.get("HF_DFLASH_SOAK") == "1"


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


def left_padded(batch: int, length: int, pads: list[int], seed: int = 0) -> tuple[torch.LongTensor, torch.Tensor]:
    """A random (batch, length) prompt whose row i starts with pads[i] padding tokens (id 0, mask 0)."""
    ids = random_prompt(length, seed=seed, batch=batch)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def hook_count(model: torch.nn.Module) -> int:
    """Forward hooks attached anywhere in `model`."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@torch.no_grad()
def scratch_draft_logits(
    target: torch.nn.Module, drafter: torch.nn.Module, context: torch.Tensor, anchor: int
) -> torch.Tensor:
    """The drafter run from scratch, without any cache: context (c, k*H_target) rows at positions 0..c-1, the block
    [anchor, mask x (B - 1)] at c..c+B-1 -> draft logits (B - 1, V) of block rows 1..B-1."""
    block = drafter.config.block_size
    block_ids = torch.tensor([[anchor] + [drafter.config.mask_token_id] * (block - 1)])
    hidden = drafter(
        noise_embeds=target.get_input_embeddings()(block_ids),
        context_hidden_states=context[None],
        position_ids=torch.arange(context.shape[0] + block)[None],
    ).last_hidden_state
    return target.get_output_embeddings()(hidden[0, 1:])


@pytest.fixture
def one_thread():
    """Run a test on one intra-op thread: tiny models are bound by per-op overhead, and on a shared 2-core machine a
    second spinning thread made them about ten times slower (measured: 20-token generate 1.08 s -> 0.09 s CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def llama_pair():
    target = tiny_target("llama")
    return target, tiny_drafter(target)


@pytest.fixture
def qwen3_pair():
    target = tiny_target("qwen3")
    return target, tiny_drafter(target)
