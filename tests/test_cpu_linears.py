"""Prepacked oneDNN linear layers on a CPU (dflash_cpu_linears.py): which forwards use them, that they are put back,
that a changed weight is packed again, and that DFlash on the engine uses them for every verify and stays identical
to plain greedy."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import GenerationConfig

import hf_dflash.modeling.dflash_cpu_linears as cpu_linears
from hf_dflash.modeling.dflash_cpu_linears import OneDNNLinears, onednn_linears_blocker
from hf_dflash.modeling.dflash_engine import DFlashEngine
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from hf_dflash.modeling.dflash_policy import VerifyPolicy
from hf_dflash.modeling.dflash_row_sampling import SamplingSettings
from tests.conftest import random_prompt, tiny_drafter, tiny_target

pytestmark = pytest.mark.skipif(
    onednn_linears_blocker(torch.nn.Linear(8, 8)) is not None, reason="this torch build has no oneDNN packed linear"
)


@pytest.fixture
def products(monkeypatch):
    """Counts the packed products, per thread name; `weights_seen` keeps the packed weights they read."""
    counts: dict[str, int] = {}
    product = cpu_linears.onednn_linear

    def counted(x, packed, bias):
        name = threading.current_thread().name
        counts[name] = counts.get(name, 0) + 1
        weights_seen.append(packed)
        return product(x, packed, bias)

    monkeypatch.setattr(cpu_linears, "onednn_linear", counted)
    weights_seen.clear()
    return counts


weights_seen: list[torch.Tensor] = []


def test_forwards_inside_the_block_use_the_packed_weights_and_get_their_own_back(products):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16, bias=False))
    x = torch.randn(3, 5, 32)
    expected = model(x)
    packed = OneDNNLinears(model)
    assert len(packed.modules) == 2 and packed.nbytes >= (32 * 64 + 64 * 16) * 4
    with packed.active():
        inside = model(x)
    assert products == {threading.current_thread().name: 2}
    torch.testing.assert_close(inside, expected, rtol=1e-5, atol=1e-5)
    assert all("forward" not in module.__dict__ for module in model)
    model(x)
    assert sum(products.values()) == 2  # outside the block: the model's own forwards


def test_another_threads_forward_keeps_the_models_own(products):
    model = torch.nn.Linear(16, 16)
    packed = OneDNNLinears(model)
    other = threading.Thread(target=lambda: model(torch.randn(2, 16)), name="other")
    with packed.active():
        other.start()
        other.join()
        model(torch.randn(2, 16))
    assert products == {threading.current_thread().name: 1}


def test_the_forwards_come_back_after_an_exception():
    model = torch.nn.Linear(16, 16)
    packed = OneDNNLinears(model)
    with pytest.raises(RuntimeError, match="inside"):
        with packed.active():
            raise RuntimeError("inside")
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("change", ["in place", "replaced"])
def test_a_changed_weight_is_packed_again(change):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    packed = OneDNNLinears(model)
    x = torch.randn(4, 16)
    if change == "in place":  # as an optimizer step or load_state_dict changes it
        with torch.no_grad():
            model.weight.mul_(-3.0)
    else:
        model.weight = torch.nn.Parameter(torch.randn(8, 16))
    with packed.active():
        inside = model(x)
    torch.testing.assert_close(inside, torch.nn.functional.linear(x, model.weight, model.bias), rtol=1e-5, atol=1e-5)


def test_what_is_not_packed_and_why(monkeypatch):
    assert onednn_linears_blocker(torch.nn.Linear(8, 8).to(torch.bfloat16)) == (
        "no float32 nn.Linear layer computes on the CPU"
    )
    monkeypatch.setattr(cpu_linears, "_machine_memory", lambda: 2**20)
    message = onednn_linears_blocker(torch.nn.Linear(1024, 1024))
    assert message.startswith("a packed copy of its linear weights (0.0 GiB) would take more than 25%")
    target = tiny_target()
    with pytest.raises(ValueError, match="without prepacked oneDNN weights .*: a packed copy"):
        DFlashEngine(target, tiny_drafter(target), max_batch_size=1, onednn_linears=True)
    engine = DFlashEngine(target, tiny_drafter(target), max_batch_size=1)
    assert engine.target_linears is None


class _NeverDrafts(VerifyPolicy):
    def should_draft(self, live):
        return False


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "transformers-cache"])
@pytest.mark.parametrize("policy, batch", [(None, 2), ("never drafts", 1), ("never drafts", 2)])
def test_generate_runs_every_verify_on_the_packed_weights_and_stays_plain_greedy(products, policy, batch, pool):
    """Full-width steps run the target's verify and the drafter's pass on the packed weights, and so does every plain
    step, of one sequence (one row, where oneDNN's product is no slower than MKL's) or of several, wherever the
    target's keys/values live (the engine's pool, or transformers' cache); the prompt's forward runs the target's own
    layers."""
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=8)
    input_ids = random_prompt(12, batch=batch)
    new_tokens = 24
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False)
    plain = target.generate(input_ids, generation_config=config)
    settings = {} if policy is None else {"dflash_adaptive": _NeverDrafts()}
    release_fast_path(drafter)
    out = target.generate(
        input_ids, generation_config=config, assistant_model=drafter, dflash_fast_path=pool, **settings
    )
    assert torch.equal(out, plain) and drafter._dflash_engine[1].target_pool.holds_keys == pool
    counted = sum(products.values())
    linears = sum(isinstance(module, torch.nn.Linear) for module in target.modules())
    if policy is None:
        assert counted >= linears  # at least one verify of drafts went through them
    else:  # the prefill's token, then one plain step per token: each step's forward, and only those, packed
        assert counted == (new_tokens - 1) * linears
    assert all("forward" not in module.__dict__ for module in [*target.modules(), *drafter.modules()])


def test_the_draft_vocabularys_head_runs_on_the_packed_weights_too(products):
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=8)
    drafter.set_draft_vocabulary(torch.arange(0, 200, 2))
    engine = DFlashEngine(target, drafter, max_batch_size=1, adaptive=False)
    kept = engine.proposer.draft_head.kept
    assert kept in engine.drafter_linears.modules
    engine.admit("a", random_prompt(10)[0].tolist(), 8, SamplingSettings())
    engine.run_step()
    assert any(seen is engine.drafter_linears.packed[kept][2] for seen in weights_seen)
    assert "forward" not in kept.__dict__


def test_a_deep_copy_packs_its_own_copies():
    """A deep copy of a drafter copies the engine it holds (training copies drafters): oneDNN's packed tensors have
    no storage to copy, so the copy packs its own."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    packed = OneDNNLinears(model)
    copied_model, copied = copy.deepcopy((model, packed))
    assert copied.modules == list(copied_model) and copied.packed[copied_model[0]][0] is copied_model[0].weight
    x = torch.randn(2, 16)
    with copied.active():
        torch.testing.assert_close(copied_model(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pool", [True, False], ids=["pool", "transformers-cache"])
def test_insisting_on_onednn_where_it_cannot_pack_is_an_error_in_both_homes(pool):
    target = tiny_target().to(torch.bfloat16)
    drafter = tiny_drafter(target, block_size=4).to(torch.bfloat16)
    with pytest.raises(ValueError, match="without prepacked oneDNN weights .*: no float32 nn.Linear"):
        target.generate(random_prompt(8), max_new_tokens=4, assistant_model=drafter, dflash_onednn_linears=True,
                        dflash_fast_path=pool)
