"""transformers' own DFlash loop (`speculation_type="dflash"`, our benchmark baseline) runs with our drafter."""

from __future__ import annotations

import torch

from tests.conftest import random_prompt, tiny_drafter, tiny_target


def test_native_dflash_loop_drives_our_drafter():
    target = tiny_target("qwen3", seed=2)
    drafter = tiny_drafter(target, block_size=4)
    calls = []
    handle = drafter.register_forward_hook(lambda module, args, kwargs, out: calls.append(sorted(kwargs)), with_kwargs=True)
    prompt = random_prompt(6, seed=2)
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    native = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter, speculation_type="dflash")
    handle.remove()
    assert torch.equal(plain, native)
    assert calls, "the native loop never called the drafter"
    # the native call, not ours: it hands over context rows and a transformers cache
    assert "context_hidden_states" in calls[0] and ({"cache", "past_key_values"} & set(calls[0]))
