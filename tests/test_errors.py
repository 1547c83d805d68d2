"""Bad input is refused before any work, with a message that names the fix."""

from __future__ import annotations

import pytest
import torch

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash.modeling.dflash_decoding import _cache_argument
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
        ({"force_words_ids": [[3]]}, "constrained beam search"),
        ({"dola_layers": "high"}, "drop dola_layers"),
        # other assistants generate would silently drop for ours
        ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens.*choose another assistant.*drop them"),
        ({"assistant_early_exit": 2}, "assistant_early_exit.*choose another assistant"),
        ({"use_mtp": True}, "use_mtp.*choose another assistant"),
        ({"num_assistant_tokens": 5}, r"\['num_assistant_tokens'\] do not apply.*dflash_verify_rows"),
        ({"assistant_confidence_threshold": 0.1}, "assistant_confidence_threshold.*do not apply"),
        ({"num_assistant_tokens_schedule": "heuristic"}, "num_assistant_tokens_schedule.*do not apply"),
        # options generate acts on before the loop: continuous batching would run without the drafter
        ({"cache_implementation": "paged"}, "continuous batching.*leave cache_implementation unset"),
        ({"stop_strings": ["end"]}, r"StopStringCriteria\(tokenizer, stop_strings\)"),
        ({"num_return_sequences": 2}, "num_return_sequences"),  # greedy: transformers' own refusal
        # ZeRO-3 / FSDP set it: every process would have to keep stepping until all are done
        ({"synced_gpus": True}, "synced_gpus.*give each process a whole target"),
    ],
)
def test_generation_modes_dflash_cannot_serve(kwargs, match):
    target = tiny_target("llama")
    refuse(target, tiny_drafter(target), match, **kwargs)


def test_drafter_built_for_a_target_of_another_depth():
    """Same width and vocabulary, layer ids that exist, but the config states a deeper target: another model."""
    target = tiny_target("llama", num_hidden_layers=6)
    deep = tiny_target("llama", num_hidden_layers=12)
    refuse(target, tiny_drafter(deep, target_layer_ids=[1, 4]), "built for a target of 12 layers, this one has 6")


@pytest.mark.usefixtures("one_thread")
def test_static_cache_is_lossless_or_refused():
    """transformers 5.24 crops a StaticCache; before that its layers cannot crop, and the call is refused up front."""
    from transformers.cache_utils import StaticLayer

    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    if hasattr(StaticLayer, "crop"):
        prompt = random_prompt(5)
        plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
        out = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                              cache_implementation="static")
        assert torch.equal(out, plain)
    else:
        refuse(target, drafter, "cropped after each verify.*got StaticCache.*Drop cache_implementation",
               cache_implementation="static")


@pytest.mark.parametrize(
    "damage", ["truncated to half", "cut inside the header", "zeros", "empty", "header overwritten"]
)
def test_corrupted_safetensors_name_the_fix(tmp_path, damage):
    target = tiny_target("llama")
    tiny_drafter(target).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({
        "truncated to half": data[: len(data) // 2],
        "cut inside the header": data[:20],
        "zeros": bytes(100),
        "empty": b"",
        "header overwritten": data[:8] + b"{" * 10 + data[18:],
    }[damage])
    with pytest.raises(ValueError, match="truncated or corrupted.*download it again.*force_download=True"):
        DFlashDraftModel.from_pretrained(tmp_path)


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


def test_a_cache_that_already_holds_tokens():
    """A reused prompt cache would be read from the wrong positions: the drafter needs the whole prompt's states."""
    target = tiny_target("llama")
    out = target(random_prompt(5)[:, :3], use_cache=True)
    cache = getattr(out, "past_key_values", None) or out.cache
    given = {_cache_argument(target): cache}
    refuse(target, tiny_drafter(target), "already holds 3 tokens.*whole prompt with no cache", **given)


def test_position_ids_other_than_generate_derives():
    """generate derives position_ids from the attention mask, and so do the DFlash loops; others are refused, and the
    derived ones (padding included) pass."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    shifted = torch.arange(5)[None] + 7
    refuse(target, drafter, "position_ids other than.*drop position_ids", position_ids=shifted)
    prompt, mask = random_prompt(5, batch=2), torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    derived = (mask.cumsum(-1) - 1).clamp(min=0)
    out = target.generate(prompt, attention_mask=mask, position_ids=derived, max_new_tokens=6, do_sample=False,
                          assistant_model=drafter, pad_token_id=0)
    plain = target.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, plain)
