"""Faults inside a generate call leave target and drafter as they were, and the next call right.

Each fault is raised on purpose part-way through decoding: a stopping criterion that raises, ctrl-c inside a
streamer's `put`, an out-of-memory error from the drafter's forward or from a target layer. After it: no forward hook
is left on the target, no parameter, mode or generation config changed, every drafter page went back to its pool,
and the next call (greedy and batched) equals plain generate. The engine, which the drafter keeps for its next call,
holds no row, every page of both pools and no reference to the failed call's transformers cache, wherever the
target's keys/values lived.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import StoppingCriteriaList

from hf_dflash.bench.soak import InterruptingStreamer, RaiseAtLength
from hf_dflash import DFlashProposer
from tests.conftest import hook_count, random_prompt, tiny_drafter, tiny_target
from tests.test_batched import PAD, left_pad

pytestmark = pytest.mark.usefixtures("one_thread")


def fail_on_call(module: torch.nn.Module, call: int, where: str) -> None:
    """Make `module`'s forward raise an out-of-memory error on its `call`-th call (an instance attribute, removed by
    `restore`). The error is made when raised: a stored one would keep its traceback, and the call's frames, alive."""
    original = module.forward
    count = 0

    def forward(*args, **kwargs):
        nonlocal count
        count += 1
        if count == call:
            raise torch.OutOfMemoryError(f"CUDA out of memory (raised on purpose in the {where})")
        return original(*args, **kwargs)

    module.forward = forward


def restore(module: torch.nn.Module) -> None:
    del module.forward


def snapshot(model: torch.nn.Module) -> dict:
    return {
        "hooks": hook_count(model),
        "training": [m.training for m in model.modules()],
        "parameters": {k: v.clone() for k, v in model.state_dict().items()},
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "config": model.config.to_dict(),
        "generation_config": model.generation_config.to_dict() if model.can_generate() else None,
    }


def assert_unchanged(before: dict, model: torch.nn.Module) -> None:
    after = snapshot(model)
    assert after["hooks"] == before["hooks"], "a forward hook stayed on the model"
    assert after["training"] == before["training"]
    assert after["requires_grad"] == before["requires_grad"]
    assert after["config"] == before["config"]
    assert after["generation_config"] == before["generation_config"]
    for key, value in before["parameters"].items():
        assert torch.equal(after["parameters"][key], value), key


@pytest.fixture
def proposers(monkeypatch):
    """Weak references to every DFlashProposer (one per engine) created during the test."""
    made = []
    original = DFlashProposer.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(DFlashProposer, "__init__", init)
    return made


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
@pytest.mark.parametrize(
    "fault", ["stopping criterion raises", "ctrl-c in streamer.put", "drafter out of memory", "target out of memory"]
)
def test_a_fault_leaves_everything_usable(fault, fast, proposers):
    target = tiny_target("qwen3", seed=31)
    drafter = tiny_drafter(target, seed=32, block_size=5)
    before_target, before_drafter = snapshot(target), snapshot(drafter)
    kwargs, module, error_type = {}, None, torch.OutOfMemoryError
    if fault == "stopping criterion raises":
        kwargs, error_type = {"stopping_criteria": StoppingCriteriaList([RaiseAtLength(12)])}, ValueError
    elif fault == "ctrl-c in streamer.put":
        kwargs, error_type = {"streamer": InterruptingStreamer(calls=4)}, KeyboardInterrupt
    elif fault == "drafter out of memory":
        module = drafter
        fail_on_call(module, 3, "drafter")
    else:  # the third verify forward of the target
        module = target.model.layers[1]
        fail_on_call(module, 4, "target")
    try:
        with pytest.raises(error_type):
            target.generate(
                random_prompt(6, seed=31), max_new_tokens=30, do_sample=False, assistant_model=drafter,
                dflash_fast_path=fast, **kwargs,
            )
    finally:
        if module is not None:
            restore(module)

    assert len(proposers) == 1
    gc.collect()
    # the engine held for the next call is whole: no row, every page back, no hold on the failed call's cache
    engine = drafter._dflash_engine[1]
    usage = engine.pool_usage()
    assert not engine.sequences and usage["target_pages_used"] == usage["drafter_pages_used"] == 0
    assert engine.call_cache is None
    assert_unchanged(before_target, target)
    assert_unchanged(before_drafter, drafter)
    # the next calls are right: one sequence, then a left-padded batch
    prompt = random_prompt(7, seed=33)
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter), plain)
    batch = left_pad([random_prompt(n, seed=n) for n in (2, 9, 5)])
    plain = target.generate(**batch, max_new_tokens=15, do_sample=False, pad_token_id=PAD)
    dflash = target.generate(**batch, max_new_tokens=15, do_sample=False, pad_token_id=PAD, assistant_model=drafter)
    assert torch.equal(dflash, plain)

