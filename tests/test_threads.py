"""Several threads using one target (or one drafter) at once: every DFlash call still equals plain greedy.

DFlash calls on one target, or with one drafter, take turns (a lock per target and per drafter,
dflash_capture.py); the capture hooks and every wrapper a call installs act only in the thread that installed them, so
plain generate in another thread on the same target runs as if no DFlash call were in flight. Each case runs with the
target's keys/values in transformers' cache and in the engine's pool (the fast path's step, on a CPU without a graph).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from hf_dflash.modeling.dflash_fast_path import release_fast_path
from tests.conftest import left_padded, random_prompt, tiny_drafter, tiny_target
from tests.test_families import family_target

CALLS = 6  # per thread
NEW_TOKENS = 10


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models are bound by per-op overhead: one intra-op thread each (see conftest.one_thread)."""


def prompts(first_seed: int) -> list[torch.LongTensor]:
    """CALLS prompts of different lengths, so that one call's rows cannot fit another call's buffers by chance."""
    return [random_prompt(3 + (first_seed + i) % 7, seed=first_seed + i) for i in range(CALLS)]


def plain(target: torch.nn.Module, prompt: torch.LongTensor) -> torch.LongTensor:
    return target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)


def dflash(target: torch.nn.Module, drafter: torch.nn.Module, prompt: torch.LongTensor, fast: bool) -> torch.LongTensor:
    out = target.generate(
        prompt, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter, dflash_fast_path=fast,
        return_dict_in_generate=True,
    )
    assert out.acceptance_lengths is not None  # the DFlash loop ran, not plain generate
    return out.sequences


def run_at_once(jobs: list[Callable[[], list[torch.LongTensor]]]) -> list[list[torch.LongTensor]]:
    """Run each job in its own thread, all released together; re-raise the first error a thread met."""
    start = threading.Barrier(len(jobs))
    results: list[list[torch.LongTensor] | None] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            start.wait()
            results[i] = jobs[i]()
        except BaseException as error:  # reported in the main thread below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish (deadlock?)"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
@pytest.mark.parametrize("drafters", [1, 2])
def test_two_threads_one_target(fast, drafters):
    """2 threads x CALLS calls on one target, with one drafter object shared or one each: every result equals plain
    greedy."""
    target = tiny_target("llama")
    own = [tiny_drafter(target, seed=1 + i) for i in range(drafters)]
    work = [prompts(0), prompts(CALLS)]
    expected = [[plain(target, p) for p in thread_prompts] for thread_prompts in work]
    jobs = [
        lambda t=t: [dflash(target, own[t % drafters], p, fast) for p in work[t]] for t in range(2)
    ]
    got = run_at_once(jobs)
    for thread_got, thread_expected in zip(got, expected):
        for out, reference in zip(thread_got, thread_expected):
            assert torch.equal(out, reference)
    for drafter in own:
        release_fast_path(drafter)


def plain_padded(target: torch.nn.Module, batch: tuple[torch.LongTensor, torch.Tensor]) -> torch.LongTensor:
    ids, mask = batch
    return target.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
def test_plain_generate_beside_dflash(fast):
    """One thread runs plain generate on the target while another runs DFlash on it: both exact. The plain calls are
    left-padded batches, whose forwards need their padding mask: one built for another attention implementation (or
    none) would change their tokens."""
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    plain_batches = [left_padded(2, 4 + i, [0, 1 + i], seed=i) for i in range(CALLS)]
    dflash_prompts = prompts(CALLS)
    expected_plain = [plain_padded(target, batch) for batch in plain_batches]
    expected_dflash = [plain(target, p) for p in dflash_prompts]
    got_plain, got_dflash = run_at_once([
        lambda: [plain_padded(target, batch) for batch in plain_batches],
        lambda: [dflash(target, drafter, p, fast) for p in dflash_prompts],
    ])
    assert all(torch.equal(a, b) for a, b in zip(got_plain, expected_plain))
    assert all(torch.equal(a, b) for a, b in zip(got_dflash, expected_dflash))
    release_fast_path(drafter)


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
def test_two_hybrid_targets_at_once(fast):
    """Two Qwen3.5 targets (one modeling module, so one module-level Gated DeltaNet rule) decoded by two threads at
    once, each with its own drafter: both exact. The weights are at ten times the default scale so that a linear
    layer's state advanced over the wrong rows changes the output (tests/test_hybrid_fast_path.py)."""
    targets = [family_target("qwen3_5_text", seed=seed, initializer_range=0.2) for seed in (0, 1)]
    drafters = [tiny_drafter(target, seed=5 + i) for i, target in enumerate(targets)]
    work = [prompts(0), prompts(CALLS)]
    expected = [[plain(target, p) for p in thread_prompts] for target, thread_prompts in zip(targets, work)]
    got = run_at_once([
        lambda t=t: [dflash(targets[t], drafters[t], p, fast) for p in work[t]] for t in range(2)
    ])
    for thread_got, thread_expected in zip(got, expected):
        for out, reference in zip(thread_got, thread_expected):
            assert torch.equal(out, reference)
    for drafter in drafters:
        release_fast_path(drafter)


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
def test_two_targets_one_drafter(fast):
    """Two targets of one shape share one drafter object (whose fast-path step and buffers are held on it): two
    threads decoding one target each at once are both exact."""
    targets = [tiny_target("llama", seed=seed) for seed in (0, 1)]
    drafter = tiny_drafter(targets[0])
    work = [prompts(0), prompts(CALLS)]
    expected = [[plain(target, p) for p in thread_prompts] for target, thread_prompts in zip(targets, work)]
    got = run_at_once([
        lambda t=t: [dflash(targets[t], drafter, p, fast) for p in work[t]] for t in range(2)
    ])
    for thread_got, thread_expected in zip(got, expected):
        for out, reference in zip(thread_got, thread_expected):
            assert torch.equal(out, reference)
    release_fast_path(drafter)
