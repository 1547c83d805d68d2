"""Bad input is refused before any work, with a message that names the fix."""

from __future__ import annotations

import pytest
import torch

from hf_dflash import DFlashConfig, DFlashDraftModel
from tests.conftest import MASK_ID, random_prompt, tiny_drafter, tiny_target


def forward_calls(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls, handle


def refuse(target, drafter, match, **kwargs):
    calls, handle = forward_calls(target)
    try:
        with pytest.raises(ValueError, match=match):
            target.generate(random_prompt(5), max_new_tokens=8, assistant_model=drafter, **kwargs)
    finally:
        handle.remove()
    assert calls == [], "the target ran before the input was refused"


def test_drafter_for_another_hidden_size():
    target = tiny_target("llama")
    other = tiny_target("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    refuse(target, tiny_drafter(other), "width 32.*64.*DFlashConfig.for_target")


def test_layer_ids_the_target_does_not_have():
    target = tiny_target("llama", num_hidden_layers=6)
    deep = tiny_target("llama", num_hidden_layers=12)
    refuse(target, tiny_drafter(deep, target_layer_ids=[2, 10]), r"target_layer_ids \[10\] do not exist")


def test_mask_token_outside_the_vocabulary():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    drafter.config.mask_token_id = 10_000
    refuse(target, drafter, "mask_token_id 10000 is not a row")


def test_vocabulary_mismatch():
    target = tiny_target("llama")
    drafter = tiny_drafter(tiny_target("llama", vocab_size=300))
    refuse(target, drafter, "vocabulary of 300")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_beams": 2}, "beam search"),
        ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive"),
        ({"return_dict_in_generate": True, "output_hidden_states": True}, "output_hidden_states"),
    ],
)
def test_generation_modes_dflash_cannot_serve(kwargs, match):
    target = tiny_target("llama")
    refuse(target, tiny_drafter(target), match, **kwargs)


def test_context_longer_than_the_drafter_allocation():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    drafter.config.max_position_embeddings = 10
    refuse(target, drafter, "max_position_embeddings=10.*lower max_new_tokens")


def test_drafter_without_weights():
    target = tiny_target("llama")
    config = DFlashConfig.for_target(target.config, mask_token_id=MASK_ID, block_size=4)
    with torch.device("meta"):
        drafter = DFlashDraftModel(config)
    refuse(target, drafter, "meta device")


def test_custom_generate_cannot_be_combined():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="drop custom_generate"):
        target.generate(random_prompt(4), max_new_tokens=4, assistant_model=tiny_drafter(target), custom_generate=print)


def test_target_without_decoder_layers_is_named():
    from hf_dflash.modeling.dflash_capture import TargetHiddenCapture

    with pytest.raises(ValueError, match="cannot find the decoder layers"):
        TargetHiddenCapture(torch.nn.Linear(2, 2), [0], 2)
