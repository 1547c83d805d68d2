"""Targets placed by `device_map` (accelerate): offloaded and split layers, the drafter's device, and its errors. An
offloaded target computes on one device, so the engine's pool serves it; a split one keeps its keys/values in
transformers' cache.

This machine has one device, so the split over two devices is checked by accelerate's own offloading (weights on the
meta device, brought to the CPU by accelerate's hooks for each forward) and by hooks that name other devices; the
test at the end runs a real split where two GPUs exist.
"""

from __future__ import annotations

import pytest
import torch
from accelerate.hooks import AlignDevicesHook, SequentialHook
from transformers import AutoModelForCausalLM

from hf_dflash import place_drafter
from hf_dflash.modeling.dflash_devices import execution_device, target_devices
from hf_dflash.modeling.dflash_fast_path_blockers import fast_path_blocker
from tests.conftest import random_prompt, tiny_drafter, tiny_target
from tests.test_batched import PAD, left_pad
from tests.test_errors import refuse
from tests.test_fast_path import oracle_drafts


def layer_map(where: list[str], **ends: str) -> dict[str, str]:
    """A device_map giving decoder layer i to where[i], the embedding to ends["embed"], the rest to ends["head"]."""
    return {
        "model.embed_tokens": ends.get("embed", "cpu"),
        **{f"model.layers.{i}": device for i, device in enumerate(where)},
        "model.norm": ends.get("head", "cpu"),
        "model.rotary_emb": ends.get("head", "cpu"),
        "lm_head": ends.get("head", "cpu"),
    }


@pytest.mark.parametrize("sampling", [False, True])
def test_offloaded_target_is_lossless(tmp_path, sampling):
    reference = tiny_target("llama", seed=41)
    reference.save_pretrained(tmp_path / "target")
    device_map = layer_map(["cpu", "cpu", "cpu", "disk", "disk", "disk"], embed="disk", head="disk")
    target = AutoModelForCausalLM.from_pretrained(
        tmp_path / "target", device_map=device_map, offload_folder=tmp_path / "offload"
    ).eval()
    head = target.get_output_embeddings()
    assert head.weight.device.type == "meta" and hasattr(head, "_hf_hook"), "accelerate did not offload the lm_head"
    drafter = place_drafter(tiny_drafter(reference), target)
    assert next(drafter.parameters()).device == torch.device("cpu")  # where the lm_head computes, not meta
    batch = left_pad([random_prompt(n, seed=n) for n in (5, 8)])
    settings = dict(max_new_tokens=16, pad_token_id=PAD, do_sample=sampling)
    if sampling:  # the rejection rule reads the drafter's logits, which come from the offloaded lm_head
        torch.manual_seed(0)
        out = target.generate(**batch, **settings, assistant_model=drafter, top_k=0)
        assert out.shape == (2, batch["input_ids"].shape[1] + 16)
        return
    plain = reference.generate(**batch, **settings)
    assert torch.equal(target.generate(**batch, **settings), plain)
    with oracle_drafts(plain, wrong_every=4):
        out = target.generate(
            **batch, **settings, assistant_model=drafter, return_dict_in_generate=True, dflash_fast_path=True
        )
    assert torch.equal(out.sequences, plain)
    assert max(max(lengths) for lengths in out.acceptance_lengths) > 1, "no draft was accepted"


def pretend_split(target: torch.nn.Module, second: str) -> None:
    """Give layers 3.. and the lm_head accelerate hooks that name `second` as their device (nothing runs there)."""
    for layer in target.model.layers[3:]:
        layer._hf_hook = AlignDevicesHook(execution_device=second)
    target.lm_head._hf_hook = SequentialHook(AlignDevicesHook(execution_device=second))


def test_a_split_target_reports_each_part_where_it_computes():
    target = tiny_target("llama")
    pretend_split(target, "cuda:1")
    assert target_devices(target) == [torch.device("cpu"), torch.device("cuda:1")]
    assert execution_device(target.lm_head) == torch.device("cuda:1")
    assert execution_device(target.model.layers[0]) == torch.device("cpu")
    blocker = fast_path_blocker(target, tiny_drafter(target), torch.ones(1, 4, dtype=torch.long))
    assert blocker == (
        "the target and drafter compute on cpu, cuda:1; the fast path needs one device (load both on one GPU)"
    )


def test_drafter_on_a_device_the_target_does_not_use_is_refused():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    for module in (target.model.embed_tokens, *target.model.layers, target.lm_head):
        module._hf_hook = AlignDevicesHook(execution_device="cuda:0")
    refuse(target, drafter, r"drafter is on cpu, but the target computes on cuda:0.*drafter.to\('cuda:0'\)")


def test_place_drafter_takes_an_explicit_device():
    target = tiny_target("llama")
    drafter = place_drafter(tiny_drafter(target), target, device="meta")
    assert next(drafter.parameters()).device.type == "meta"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (run on the multi-GPU machine)")
def test_target_split_over_two_gpus_is_lossless(tmp_path):
    reference = tiny_target("qwen3", seed=42)
    reference.save_pretrained(tmp_path / "target")
    device_map = layer_map([0, 0, 0, 1, 1, 1], embed=0, head=1)
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target", device_map=device_map).eval()
    drafter = place_drafter(tiny_drafter(reference), target)
    assert next(drafter.parameters()).device == torch.device("cuda:1")
    batch = {k: v.to("cuda:0") for k, v in left_pad([random_prompt(n, seed=n) for n in (5, 8)]).items()}
    settings = dict(max_new_tokens=16, pad_token_id=PAD, do_sample=False)
    plain = target.generate(**batch, **settings)
    with oracle_drafts(plain, wrong_every=4):
        out = target.generate(**batch, **settings, assistant_model=drafter, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert max(max(lengths) for lengths in out.acceptance_lengths) > 1
    torch.manual_seed(0)
    target.generate(**batch, max_new_tokens=16, pad_token_id=PAD, do_sample=True, assistant_model=drafter)
