"""Continuous batching with a DFlash drafter: transformers' manager API over the engine (modeling/dflash_engine.py,
modeling/dflash_continuous.py).

Exactness first: in float32 every greedy request's tokens equal its own plain greedy `generate`, whatever else
shares the batch, under arrival schedules hypothesis draws (staggered arrivals, cancellations, eos inside a block,
prompts and max_new_tokens of every length, requests waiting for rows or pages and admitted the step another ends),
hybrid targets (Gated DeltaNet layers) included, whose drafts an oracle makes partly right so that rows accept different
counts and the linear layers' states must roll back to each.
Most schedules run the manager's own loop body (`iteration`) one turn at a time, so that a schedule is exact and
repeatable; the threaded worker runs in the tests of the API, faults and the 1,000-request soak.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.testing_utils import CaptureLogger
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from hf_dflash import DFlashDraftModel
from hf_dflash.modeling import dflash_continuous, dflash_linear_state
from hf_dflash.modeling.dflash_continuous import DFlashContinuousBatchingManager, DFlashScheduler
from hf_dflash.modeling.dflash_engine import RECORD_SPAN_LIMIT, STATIC_SPAN_BUCKET, DFlashEngine, bucket_size
from hf_dflash.modeling.dflash_openmp import release_openmp_threads
from hf_dflash.modeling.dflash_row_sampling import SamplingSettings, penalize, warp
from tests.conftest import random_prompt, tiny_drafter, tiny_target
from tests.test_families import HYBRID, family_target

# eos -1: none (as in transformers' manager; None would fall back to the model config's eos)
GREEDY = GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=-1, pad_token_id=0)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models are bound by per-op overhead: one thread each (see conftest.one_thread)."""


_PAIRS: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}


def pair(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny float32 target of `family` and a random drafter for it (built once per module). Hybrid targets get
    weights at ten times the default scale, as in tests/test_hybrid_fast_path.py: at the default scale a linear state
    advanced one row too far did not change their greedy output; at this one it does."""
    if family not in _PAIRS:
        if family in ("llama", "qwen3"):
            target = tiny_target(family)
        else:
            target = family_target(family, **(dict(initializer_range=0.2) if family in HYBRID else {}))
        _PAIRS[family] = (target, tiny_drafter(target))
    return _PAIRS[family]


@torch.no_grad()
def plain_greedy(target: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """Plain greedy generate's new tokens, up to and including the first eos."""
    out = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    return new[: new.index(eos) + 1] if eos is not None and eos in new else new


def drain(manager: DFlashContinuousBatchingManager) -> list:
    outputs = []
    while not manager.output_queue.empty():
        outputs.append(manager.output_queue.get_nowait())
    return outputs


class OracleHead(torch.nn.Module):
    """Stands in for the drafter's lm_head inside the engine's step: each row drafts its own request's plain greedy
    continuation (references[key]: prompt and new tokens, by position), wrong wherever position + the request's
    number is a multiple of `wrong_every`, so that in one step some rows accept no draft and others several."""

    def __init__(self, engine: DFlashEngine, references: dict[str, list[int]], wrong_every: int):
        super().__init__()
        self.engine, self.references, self.wrong_every = engine, references, wrong_every
        self.weight = engine.proposer.lm_head.weight
        self.vocab = self.weight.shape[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows, drafts = hidden.shape[:2]
        tokens = []
        for row, sequence in enumerate(self.engine.sequences[:rows]):
            reference, number = self.references[sequence.key], int(sequence.key[1:])
            positions = int(self.engine.anchor_pos[row]) + 1 + torch.arange(drafts)
            right = torch.tensor([reference[p] if p < len(reference) else 0 for p in positions.tolist()])
            wrong = ((positions + number) % self.wrong_every == 0) | (positions >= len(reference))
            tokens.append(torch.where(wrong, (right + 1) % self.vocab, right))
        tokens += [torch.zeros(drafts, dtype=torch.long)] * (rows - len(tokens))  # idle rows of a static shape
        return torch.nn.functional.one_hot(torch.stack(tokens), self.vocab).to(hidden.dtype)


@contextlib.contextmanager
def oracle_drafts(references: dict[str, list[int]], wrong_every: int):
    """Within, the engine's drafts come from `OracleHead` (at full-width steps and the verify policy's alike: both
    draft through `propose`)."""
    propose = DFlashEngine.propose

    def oracle_propose(self, rows, *args):
        head = self.proposer.lm_head
        self.proposer.lm_head = OracleHead(self, references, wrong_every)
        try:
            return propose(self, rows, *args)
        finally:
            self.proposer.lm_head = head

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DFlashEngine, "propose", oracle_propose)
        yield


def run_schedule(manager: DFlashContinuousBatchingManager, arrivals: dict[int, list[dict]],
                 cancels: dict[int, list[str]], turns: int = 500) -> tuple[dict[str, list], DFlashScheduler, int]:
    """Run the manager's loop body turn by turn: before turn t the requests of arrivals[t] are added and those of
    cancels[t] cancelled. Returns every output per request id, the scheduler, and the turns run."""
    scheduler, outputs = DFlashScheduler(), {}
    last = max([*arrivals, *cancels, 0])
    turn = 0
    waited_while_running = False
    for turn in range(turns):
        for request in arrivals.get(turn, []):
            manager.add_request(**request)
        for request_id in cancels.get(turn, []):
            manager.cancel_request(request_id)
        manager.iteration(scheduler)
        waited_while_running |= bool(scheduler.waiting_requests) and bool(scheduler.active_requests)
        for output in drain(manager):
            outputs.setdefault(output.request_id, []).append(output)
        if turn >= last and not scheduler.active_requests and not scheduler.waiting_requests:
            break
    scheduler.waited_while_running = waited_while_running
    return outputs, scheduler, turn


# --------------------------------------------------------------------------------------------------
# Greedy identity under drawn arrival schedules
# --------------------------------------------------------------------------------------------------

request_plans = st.lists(
    st.fixed_dictionaries(dict(
        prompt_length=st.integers(1, 40),
        max_new_tokens=st.integers(1, 24),
        arrival=st.integers(0, 6),
        cancel_after=st.one_of(st.none(), st.integers(0, 4)),
        eos_at=st.one_of(st.none(), st.integers(0, 23)),  # the reference's token there becomes the request's eos
        seed=st.integers(0, 10_000),
    )),
    min_size=1, max_size=6,
)


def schedule(plans: list[dict], reference: Callable[[list[int], int], list[int]]) -> tuple[dict, dict, dict, dict]:
    """The requests of `plans` as turns of arrivals and cancellations, and per request id the tokens it must get
    (its `reference` greedy answer, cut at its eos) and its prompt followed by its whole reference answer."""
    arrivals, cancels, expected, full = {}, {}, {}, {}
    for i, plan in enumerate(plans):
        prompt = random_prompt(plan["prompt_length"], seed=plan["seed"])[0].tolist()
        answer = reference(prompt, plan["max_new_tokens"])
        full[f"r{i}"] = prompt + answer
        eos = answer[plan["eos_at"]] if plan["eos_at"] is not None and plan["eos_at"] < len(answer) else None
        expected[f"r{i}"] = answer[: answer.index(eos) + 1] if eos is not None else answer
        arrivals.setdefault(plan["arrival"], []).append(dict(
            input_ids=prompt, request_id=f"r{i}", max_new_tokens=plan["max_new_tokens"], streaming=True,
            eos_token_id=-1 if eos is None else eos,
        ))
        if plan["cancel_after"] is not None:
            cancels.setdefault(plan["arrival"] + plan["cancel_after"], []).append(f"r{i}")
    return arrivals, cancels, expected, full


def check_schedule(family: str, plans: list[dict], max_batch_size: int, small_pool: bool,
                   wrong_every: int | None = None, static_shapes: bool = False,
                   warm_up: bool = False) -> DFlashEngine:
    """Run the schedule of `plans` and check every request against its own plain greedy generate; with
    `wrong_every`, under `oracle_drafts`; with `static_shapes`, every step padded to its bucketed shape, as a GPU
    records it (dflash_engine.py); with `warm_up`, after the manager's `warmup`. Returns the engine."""
    target, drafter = pair(family)
    manager = DFlashContinuousBatchingManager(target, drafter, GREEDY, max_batch_size=max_batch_size,
                                              max_tokens=128 if small_pool else None, static_shapes=static_shapes)
    if warm_up:
        engine = manager.engine
        run_at = []  # the rows of every step run, idle ones included
        run_rows = engine._run_rows
        engine._run_rows = lambda n, span, *rest: run_at.append((n, span)) or run_rows(n, span, *rest)
        manager.warmup()
        del engine._run_rows
        # with static shapes, the step ran over idle rows at every row bucket and at every span bucket up to
        # RECORD_SPAN_LIMIT (on a GPU: its run and its recording), then the warm-up request's steps ran
        buckets = {bucket_size(n, max_batch_size) for n in range(1, max_batch_size + 1)}
        longest = engine._static_shape(1, min(engine.max_sequence_length + engine.block_size, RECORD_SPAN_LIMIT))[1]
        spans = {min(STATIC_SPAN_BUCKET << k, longest) for k in range(8) if STATIC_SPAN_BUCKET << k < 2 * longest}
        if static_shapes:
            assert len(spans) > 1 and {(n, span) for n in buckets for span in spans} <= set(run_at)
        else:
            assert not run_at
        # with static shapes its request ran two steps at least (a first run and, on a GPU, its recording) and left
        assert engine.row_steps >= 2 if static_shapes else engine.row_steps == 0
        assert not engine.sequences and engine.pool_usage()["target_pages_used"] == 0
    arrivals, cancels, expected, full = schedule(plans, lambda prompt, new: plain_greedy(target, prompt, new))
    with oracle_drafts(full, wrong_every) if wrong_every else contextlib.nullcontext():
        outputs, scheduler, _ = run_schedule(manager, arrivals, cancels)
    cancelled = {request_id for ids in cancels.values() for request_id in ids}
    for request_id, reference in expected.items():
        got = outputs.get(request_id, [])
        for output in got:  # every streamed output is a prefix of the request's own greedy answer
            assert output.error is None, output.error
            assert output.generated_tokens == reference[: len(output.generated_tokens)], (request_id, family)
        if request_id not in cancelled:
            assert got and got[-1].is_finished() and got[-1].generated_tokens == reference, (request_id, family)
    assert not scheduler.active_requests and not scheduler.waiting_requests
    usage = manager.engine.pool_usage()
    assert usage["target_pages_used"] == usage["drafter_pages_used"] == 0
    assert manager.engine.row_steps > 0 or all(len(r) <= 1 for r in expected.values())
    return manager.engine


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(plans=request_plans, max_batch_size=st.integers(1, 4), small_pool=st.booleans())
def test_greedy_identity_under_drawn_arrival_schedules(family, plans, max_batch_size, small_pool):
    check_schedule(family, plans, max_batch_size, small_pool)


FIXED_PLANS = [
    dict(prompt_length=5, max_new_tokens=20, arrival=0, cancel_after=None, eos_at=None, seed=1),
    dict(prompt_length=23, max_new_tokens=7, arrival=0, cancel_after=None, eos_at=3, seed=2),
    dict(prompt_length=2, max_new_tokens=15, arrival=1, cancel_after=2, eos_at=None, seed=3),
    dict(prompt_length=31, max_new_tokens=12, arrival=2, cancel_after=None, eos_at=None, seed=4),
    dict(prompt_length=9, max_new_tokens=18, arrival=3, cancel_after=None, eos_at=None, seed=5),
]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mistral"])
def test_greedy_identity_other_families(family):
    check_schedule(family, FIXED_PLANS, max_batch_size=3, small_pool=False)


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_greedy_identity_with_static_shapes(family):
    """The padded steps a GPU records as CUDA graphs, run eagerly: 1 to 4 running requests step at 1, 2 or 4 rows
    (idle rows write only to the scratch page) and spans of 256 times a power of two, a long request's span growing
    from 256 to 512 positions as it decodes; every request equals plain greedy."""
    shapes = []
    run_static = DFlashEngine._run_static
    long_request = dict(prompt_length=236, max_new_tokens=24, arrival=1, cancel_after=None, eos_at=None, seed=6)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DFlashEngine, "_run_static",
                      lambda self, *shape: shapes.append((len(self.sequences), *shape)) or run_static(self, *shape))
        engine = check_schedule(family, [*FIXED_PLANS, long_request], max_batch_size=4, small_pool=False,
                                static_shapes=True)
    assert engine.static_shapes and not engine.use_graphs
    assert {rows for _, _, rows, _, _ in shapes} == {1, 2, 4} and {span for *_, span, _ in shapes} == {256, 512}
    assert any(running < rows for running, _, rows, _, _ in shapes)  # idle rows ran beside running ones
    assert engine.pool_usage()["target_pages_used"] == 0 and engine.compute_free_capacity() == 1.0


@pytest.mark.parametrize("static_shapes", [True, False])
def test_warmup_runs_a_request_through_static_shapes_and_changes_no_answer(static_shapes):
    check_schedule("llama", FIXED_PLANS, max_batch_size=4, small_pool=False, static_shapes=static_shapes,
                   warm_up=True)


def test_greedy_identity_with_a_dflash2_drafter():
    """A DFlash2 drafter (convolutions and selector active) in the engine: its selector's path drafts, the target
    decides; the fixed schedule's requests equal plain greedy, and the selector ran."""
    from hf_dflash.modeling.modeling_dflash2 import DFlash2DraftModel
    from tests.test_dflash2_decoding import dflash2_drafter

    target = tiny_target("qwen3")
    _PAIRS["qwen3-dflash2"] = (target, dflash2_drafter(target).eval())
    proposals = []
    propose = DFlash2DraftModel.propose
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DFlash2DraftModel, "propose", lambda *a, **k: proposals.append(1) or propose(*a, **k))
        check_schedule("qwen3-dflash2", FIXED_PLANS, max_batch_size=3, small_pool=False)
    assert proposals


# --------------------------------------------------------------------------------------------------
# Hybrid targets: Gated DeltaNet states per row, rolled back to each row's accepted drafts
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", HYBRID)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(plans=request_plans, max_batch_size=st.integers(1, 4), small_pool=st.booleans())
def test_hybrid_greedy_identity_under_drawn_arrival_schedules(family, plans, max_batch_size, small_pool):
    check_schedule(family, plans, max_batch_size, small_pool, wrong_every=3)


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_rows_accept_drafts_retire_and_move(family):
    """The fixed schedule (an eos inside a block, a cancellation, staggered arrivals) under the oracle: every request
    equals plain greedy, drafts were accepted and rejected, and a row retired while a later one ran on, whose
    linear-attention states moved into its place with the rest of the row."""
    moves, retire = [], DFlashEngine.retire

    def spying(self, key):
        moves.append([sequence.key for sequence in self.sequences].index(key) < len(self.sequences) - 1)
        retire(self, key)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DFlashEngine, "retire", spying)
        engine = check_schedule(family, FIXED_PLANS, max_batch_size=3, small_pool=False, wrong_every=3)
    assert any(moves)
    assert 0 < engine.accepted_drafts < (engine.block_size - 1) * engine.row_steps
    assert engine.conv and engine.recurrent  # the states were the engine's, per row
    assert all(state.shape[0] == 3 for state in (*engine.conv.values(), *engine.recurrent.values()))


def test_a_hybrid_the_rollback_cannot_serve_is_refused_in_one_line():
    target, drafter = pair("qwen3_5_text")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dflash_linear_state, "chunk_rule_reachable", lambda module: False)
        with pytest.raises(ValueError, match="continuous batching cannot serve this target") as error:
            target.init_continuous_batching(generation_config=GREEDY, assistant_model=drafter)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_a_request_admitted_the_step_another_ends_and_one_waiting_for_pages(family):
    """One row's worth of pages: each request waits until the one before it ends, and is admitted at once (into the
    row it left: a hybrid's states there start afresh)."""
    target, drafter = pair(family)
    manager = DFlashContinuousBatchingManager(target, drafter, GREEDY, max_batch_size=4, max_tokens=64)
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (20, 11, 30)]
    arrivals = {0: [dict(input_ids=p, request_id=f"r{i}", max_new_tokens=12) for i, p in enumerate(prompts)]}
    outputs, scheduler, turns = run_schedule(manager, arrivals, {})
    assert scheduler.waited_while_running
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"][-1].generated_tokens == plain_greedy(target, prompt, 12)
    assert manager.engine.row_steps > 0


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_long_prompts_are_prefilled_in_chunks_and_stay_exact(family):
    """Prompts longer than `prefill_chunk` (7) take one target forward per chunk, none longer than the chunk, and
    every request still equals plain greedy: a chunk reads the chunks before it from the pages (a hybrid's linear
    layers carry their states on from chunk to chunk, a last chunk of one token included)."""
    target, drafter = pair(family)
    engine = DFlashEngine(target, drafter, max_batch_size=2, prefill_chunk=7)
    widths = []
    handle = target.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                              with_kwargs=True)
    try:
        prompts = [random_prompt(n, seed=n)[0].tolist() for n in (30, 15)]
        firsts = [engine.admit(f"r{i}", prompt, 10, SamplingSettings.from_config(GREEDY))
                  for i, prompt in enumerate(prompts)]
    finally:
        handle.remove()
    assert widths == [7, 7, 7, 7, 2, 7, 7, 1]
    tokens = {f"r{i}": [first] for i, first in enumerate(firsts)}
    while any(len(t) < 10 for t in tokens.values()):
        for key, new in engine.run_step().items():
            tokens[key] += new
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"][:10] == plain_greedy(target, prompt, 10)


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_requests_admitted_together_are_prefilled_in_one_forward_and_stay_exact(family):
    """`admit_many` packs prompts end to end into one target forward (a sliding-window family included: its window is
    applied within each prompt); every request then equals plain greedy. A packed forward that raises is retried one
    request at a time, so a fault stays with its request: here only the packed forward fails."""
    target, drafter = pair(family)
    greedy = SamplingSettings.from_config(GREEDY)
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (5, 17, 33, 9)]
    for fail_packed in (False, True):
        engine = DFlashEngine(target, drafter, max_batch_size=8, adaptive=False)
        widths = []

        def hook(module, args, kwargs):
            widths.append(kwargs["input_ids"].shape[1])
            if fail_packed and widths[-1] == sum(map(len, prompts)):
                raise RuntimeError("injected fault in the packed forward")

        handle = target.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            firsts = engine.admit_many([(f"r{i}", prompt, 10, greedy) for i, prompt in enumerate(prompts)])
        finally:
            handle.remove()
        assert widths == [64] + ([5, 17, 33, 9] if fail_packed else [])
        assert engine.pool_usage()["target_pages_used"] == sum(engine.pages_for(len(p), 0) for p in prompts)
        tokens = {f"r{i}": [first] for i, first in enumerate(firsts)}
        while any(len(t) < 10 for t in tokens.values()):
            for key, new in engine.run_step().items():
                tokens[key] += new
        for i, prompt in enumerate(prompts):
            assert tokens[f"r{i}"][:10] == plain_greedy(target, prompt, 10), (family, fail_packed, i)


def test_the_manager_packs_waiting_prompts_up_to_prefill_chunk_tokens():
    """Requests waiting together are admitted in forwards of at most `max_batch_tokens` prompt tokens (a longer prompt
    alone, in chunks), in arrival order."""
    target, drafter = pair("llama")
    config = ContinuousBatchingConfig(max_batch_tokens=40)
    manager = DFlashContinuousBatchingManager(target, drafter, GREEDY, config, max_batch_size=8)
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (10, 20, 15, 50, 6)]
    widths = []
    handle = target.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        arrivals = {0: [dict(input_ids=p, request_id=f"r{i}", max_new_tokens=6) for i, p in enumerate(prompts)]}
        outputs, _, _ = run_schedule(manager, arrivals, {})
    finally:
        handle.remove()
    assert widths[:5] == [30, 15, 40, 10, 6]  # 10 + 20; 15 (+ 50 would pass 40); 50 in chunks of 40 and 10; 6
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"][-1].generated_tokens == plain_greedy(target, prompt, 6)


# --------------------------------------------------------------------------------------------------
# The drafter runs, and with the trained pair its drafts are accepted
# --------------------------------------------------------------------------------------------------


def test_the_drafter_runs():
    target, drafter = pair("qwen3")
    calls = []
    handle = drafter.register_forward_hook(lambda *args: calls.append(1))
    try:
        prompts = [random_prompt(n, seed=n)[0].tolist() for n in (4, 9)]
        out = target.generate_batch(prompts, generation_config=GREEDY, assistant_model=drafter)
    finally:
        handle.remove()
    assert [o.generated_tokens for o in out.values()] == [plain_greedy(target, p, 16) for p in prompts]
    assert len(calls) > 0


@pytest.fixture(scope="module")
def smollm2():
    from hf_dflash.bundled_models import load_smollm2

    return load_smollm2()


def test_smollm2_with_the_shipped_drafter_is_exact_and_accepts_drafts(smollm2):
    from hf_dflash.generate_cli import DEFAULT_DRAFTER

    target, tokenizer = smollm2
    drafter = DFlashDraftModel.from_pretrained(DEFAULT_DRAFTER, dtype=torch.float32).eval()
    prompts = [
        tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True))["input_ids"]
        for text in ("Write a Python function that returns the factorial of n.", "What is the capital of France?",
                     "Give me three tips for sleeping better.")
    ]
    config = GenerationConfig(do_sample=False, max_new_tokens=24, eos_token_id=tokenizer.eos_token_id)
    manager = DFlashContinuousBatchingManager(target, drafter, config, max_batch_size=2)
    arrivals = {0: [dict(input_ids=prompts[0], request_id="r0")], 2: [dict(input_ids=prompts[1], request_id="r1")],
                3: [dict(input_ids=prompts[2], request_id="r2")]}
    outputs, _, _ = run_schedule(manager, arrivals, {})
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"][-1].generated_tokens == plain_greedy(target, prompt, 24, tokenizer.eos_token_id)
    engine = manager.engine
    assert engine.accepted_drafts / engine.row_steps > 0.3, (engine.accepted_drafts, engine.row_steps)


# --------------------------------------------------------------------------------------------------
# Sampling: each request's own settings, target-distributed (a seeded run repeats: tests/test_engine_policy.py)
# --------------------------------------------------------------------------------------------------


def test_per_row_warp_equals_transformers_warpers():
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 50) * 3
    settings_ = [(0.7, 0, 0.9), (1.3, 5, 1.0), (1.0, 1, 0.5), (2.0, 12, 0.3)]
    warped = warp(logits, torch.tensor([s[0] for s in settings_]), torch.tensor([s[1] for s in settings_]),
                  torch.tensor([s[2] for s in settings_]))
    for row, (temperature, top_k, top_p) in enumerate(settings_):
        scores = logits[row].clone()
        for processor in (TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k) if top_k else None,
                          TopPLogitsWarper(top_p) if top_p < 1 else None):
            if processor is not None:
                scores = processor(None, scores)
        assert torch.equal(torch.isinf(warped[row]), torch.isinf(scores))
        torch.testing.assert_close(warped[row][~torch.isinf(scores)], scores[~torch.isinf(scores)])


def test_per_row_penalty_then_warp_equals_transformers_processors():
    """Each row's repetition penalty on its prefix's tokens and, at verify row j, the drafts before it, then its
    warpers: transformers' processors in generate's order, called on each row's whole prefix."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 30) * 3  # 2 sequences, 3 verify rows
    prefixes = [[3, 7, 7, 12], [0, 29, 5]]
    drafts = torch.tensor([[12, 4], [6, 6]])  # row j follows the prefix and drafts[:j]
    penalty, temperature, top_k, top_p = (1.4, 2.5), (0.8, 1.5), (0, 6), (0.9, 1.0)
    presence = torch.zeros(2, 30, dtype=torch.bool)
    for i, prefix in enumerate(prefixes):
        presence[i, prefix] = True
    scores = warp(penalize(logits, presence, drafts, torch.tensor(penalty)), torch.tensor(temperature),
                  torch.tensor(top_k), torch.tensor(top_p))
    for i, prefix in enumerate(prefixes):
        processors = [RepetitionPenaltyLogitsProcessor(penalty[i]), TemperatureLogitsWarper(temperature[i])]
        processors += [TopKLogitsWarper(top_k[i])] if top_k[i] else []
        processors += [TopPLogitsWarper(top_p[i])] if top_p[i] < 1 else []
        for j in range(3):
            expected = logits[i, j][None].clone()
            ids = torch.tensor([prefix + drafts[i, :j].tolist()])
            for processor in processors:
                expected = processor(ids, expected)
            assert torch.equal(torch.isinf(scores[i, j]), torch.isinf(expected[0]))
            finite = ~torch.isinf(expected[0])
            torch.testing.assert_close(scores[i, j][finite], expected[0][finite])


def chi_square_upper(degrees: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001, by Wilson and Hilferty's approximation."""
    return degrees * (1 - 2 / (9 * degrees) + z * math.sqrt(2 / (9 * degrees))) ** 3


@torch.no_grad()
def exact_distribution(target: torch.nn.Module, prompt: list[int], length: int, temperature: float) -> dict:
    """P(the next `length` tokens) under plain sampling at `temperature`, every continuation enumerated."""
    probabilities = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, p in probabilities.items():
            logits = target(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            for token, q in enumerate(torch.softmax(logits / temperature, dim=-1).tolist()):
                grown[prefix + (token,)] = p * q
        probabilities = grown
    return probabilities


def statistic(counts: Counter, probabilities: dict, total: int) -> tuple[float, int]:
    big = {key for key, p in probabilities.items() if p * total >= 5}
    value = sum((counts.get(key, 0) - probabilities[key] * total) ** 2 / (probabilities[key] * total) for key in big)
    rest_expected = total * sum(p for key, p in probabilities.items() if key not in big)
    rest = sum(n for key, n in counts.items() if key not in big)
    if rest_expected > 0:
        value += (rest - rest_expected) ** 2 / rest_expected
    return value, len(big) - (0 if rest_expected > 0 else 1)


@pytest.mark.parametrize("static_shapes", [False, True])
def test_each_request_takes_its_own_repetition_penalty(static_shapes):
    """Greedy requests with different repetition penalties (1: none) in one batch, two admitted in one packed prefill
    and two later: each equals plain greedy generate with its own penalty. The drafts are each request's reference
    answer, mostly right, so verify rows past the first count the drafts before them, as plain generate counts the
    tokens it committed; a penalty dropped or applied to the wrong tokens changes the answers."""
    target, drafter = pair("llama")
    penalties = {"r0": 1.3, "r1": 1.0, "r2": 1.8, "r3": 1.3}
    prompts = {key: random_prompt(length, seed=seed)[0].tolist()
               for (key, length, seed) in [("r0", 6, 1), ("r1", 11, 2), ("r2", 4, 3), ("r3", 9, 4)]}

    @torch.no_grad()
    def reference(key: str, penalty: float) -> list[int]:
        ids = torch.tensor([prompts[key]])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=0, repetition_penalty=penalty)
        return out[0, ids.shape[1]:].tolist()

    expected = {key: reference(key, penalty) for key, penalty in penalties.items()}
    # the penalties change these answers, so a request that lost its penalty would fail
    assert all(expected[key] != reference(key, 1.0) for key in ("r0", "r2", "r3"))
    manager = DFlashContinuousBatchingManager(target, drafter, GREEDY, max_batch_size=4, static_shapes=static_shapes)
    arrivals = {}
    for turn, key in zip((0, 0, 2, 3), penalties):
        options = {} if penalties[key] == 1.0 else {"repetition_penalty": penalties[key]}
        arrivals.setdefault(turn, []).append(dict(input_ids=prompts[key], request_id=key, max_new_tokens=20,
                                                  eos_token_id=-1, **options))
    with oracle_drafts({key: prompts[key] + expected[key] for key in prompts}, wrong_every=7):
        outputs, _, _ = run_schedule(manager, arrivals, {})
    assert {key: outputs[key][-1].generated_tokens for key in prompts} == expected
    assert manager.engine.accepted_drafts > 0
    assert manager.engine.pool_usage()["target_pages_used"] == 0


def test_a_repetition_penalty_in_the_generation_config_applies_to_every_request():
    """A model whose generation config sets a repetition penalty (several published ones do) is served with it, as
    generate applies it; a request may still set its own."""
    target, drafter = pair("llama")
    config = GenerationConfig(do_sample=False, repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)
    prompt = random_prompt(8, seed=9)[0].tolist()
    manager = DFlashContinuousBatchingManager(target, drafter, config, max_batch_size=2)
    arrivals = {0: [dict(input_ids=prompt, request_id="r0", max_new_tokens=12),
                    dict(input_ids=prompt, request_id="r1", max_new_tokens=12, repetition_penalty=1.0)]}
    outputs, _, _ = run_schedule(manager, arrivals, {})
    with torch.no_grad():
        ids = torch.tensor([prompt])
        penalized = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                    max_new_tokens=12)[0, len(prompt):].tolist()
    assert outputs["r0"][-1].generated_tokens == penalized != plain_greedy(target, prompt, 12)
    assert outputs["r1"][-1].generated_tokens == plain_greedy(target, prompt, 12)


@pytest.mark.parametrize("static_shapes", [False, True])
def test_outputs_carry_each_tokens_logprob_when_the_config_asks(static_shapes):
    """With `return_logprobs`, as transformers' manager: each generated token's log-probability under the scores it
    was chosen from (a greedy request's logits, a sampled one's warped scores), the first token's and those of
    several tokens accepted in one step included; without it, none."""
    target, drafter = pair("llama")
    prompts = {"r0": random_prompt(7, seed=5)[0].tolist(), "r1": random_prompt(5, seed=6)[0].tolist()}
    sampled = dict(temperature=0.8, top_k=20, top_p=0.9)
    greedy_answer = plain_greedy(target, prompts["r0"], 16)
    outputs = {}
    for return_logprobs in (True, False):
        manager = DFlashContinuousBatchingManager(
            target, drafter, GREEDY, ContinuousBatchingConfig(return_logprobs=return_logprobs), max_batch_size=2,
            static_shapes=static_shapes,
        )
        arrivals = {0: [dict(input_ids=prompts["r0"], request_id="r0", max_new_tokens=16, eos_token_id=-1),
                        dict(input_ids=prompts["r1"], request_id="r1", max_new_tokens=16, eos_token_id=-1, **sampled)]}
        torch.manual_seed(0)
        with oracle_drafts({"r0": prompts["r0"] + greedy_answer, "r1": prompts["r1"]}, wrong_every=5):
            results, _, _ = run_schedule(manager, arrivals, {})
        outputs[return_logprobs] = {key: results[key][-1] for key in prompts}
        assert manager.engine.accepted_drafts > 0
    assert all(output.logprobs == [] for output in outputs[False].values())
    assert outputs[True]["r0"].generated_tokens == greedy_answer
    for key, output in outputs[True].items():
        tokens = output.generated_tokens
        with torch.no_grad():
            logits = target(torch.tensor([prompts[key] + tokens])).logits[0, len(prompts[key]) - 1 : -1]  # (N, V)
        scores = logits[None] if key == "r0" else warp(
            logits[None], *(torch.tensor([sampled[name]]) for name in ("temperature", "top_k", "top_p")))
        expected = scores.float().log_softmax(dim=-1)[0].gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        assert len(output.logprobs) == len(tokens)
        torch.testing.assert_close(torch.tensor(output.logprobs), expected, atol=1e-4, rtol=0)


def test_sampled_requests_follow_their_own_temperature_and_greedy_ones_stay_exact():
    """Vocabulary 4, three new tokens (the last two from verify steps, drafts accepted or not): requests at
    temperature 0.6 and 1.6 and greedy ones share the batch; each sampled set fits its own distribution."""
    target = tiny_target("llama", seed=3, vocab_size=4)
    with torch.no_grad():  # sharper logits, so that the two temperatures' distributions differ clearly
        target.lm_head.weight.mul_(4)
    drafter = tiny_drafter(target, mask_token_id=3)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=3, eos_token_id=-1)
    manager = DFlashContinuousBatchingManager(target, drafter, config, max_batch_size=16)
    prompt, samples = [0, 1, 2, 1], 700
    requests = []
    for i in range(samples):
        for temperature in (0.6, 1.6):
            requests.append(dict(input_ids=prompt, request_id=f"t{temperature}-{i}", temperature=temperature))
        if i % 50 == 0:
            requests.append(dict(input_ids=prompt, request_id=f"greedy-{i}", top_k=1))
    torch.manual_seed(0)
    outputs, _, _ = run_schedule(manager, {0: requests}, {}, turns=10_000)
    greedy = plain_greedy(target, prompt, 3)
    assert all(outputs[r["request_id"]][-1].generated_tokens == greedy for r in requests if "greedy" in r["request_id"])
    assert manager.engine.accepted_drafts > 0  # the steps accepted drafts under sampling too
    for own, other in ((0.6, 1.6), (1.6, 0.6)):
        counts = Counter(tuple(outputs[f"t{own}-{i}"][-1].generated_tokens) for i in range(samples))
        value, degrees = statistic(counts, exact_distribution(target, prompt, 3, own), samples)
        assert value < chi_square_upper(degrees), (own, value, degrees)
        value, degrees = statistic(counts, exact_distribution(target, prompt, 3, other), samples)
        assert value > chi_square_upper(degrees), (own, "fits the other temperature too")


# --------------------------------------------------------------------------------------------------
# The threaded manager: transformers' API, faults, and 1,000 requests
# --------------------------------------------------------------------------------------------------


def test_generate_batch_with_the_drafter_equals_plain_greedy():
    target, drafter = pair("llama")
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (3, 12, 7, 25, 1)]
    out = target.generate_batch(prompts, generation_config=GREEDY, assistant_model=drafter, max_new_tokens=10)
    assert list(out) == [f"req_{i}" for i in range(len(prompts))]
    assert [o.generated_tokens for o in out.values()] == [plain_greedy(target, p, 10) for p in prompts]


def test_generate_batch_serves_in_the_calling_thread_through_a_bounded_queue(capsys):
    """generate_batch runs the manager's loop in its caller's thread (no worker thread), feeds a queue bounded by
    max_queue_size as it drains, and shows transformers' progress bar."""
    target, drafter = pair("llama")
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (3, 12, 7, 25, 1)]
    threads = set()
    handle = drafter.register_forward_hook(lambda *args: threads.add(threading.current_thread()))
    try:
        out = target.generate_batch(prompts, generation_config=GREEDY, assistant_model=drafter, max_new_tokens=10,
                                    continuous_batching_config=ContinuousBatchingConfig(max_queue_size=2),
                                    progress_bar=True)
    finally:
        handle.remove()
    assert threads == {threading.current_thread()}  # the drafter ran, in this thread
    assert [o.generated_tokens for o in out.values()] == [plain_greedy(target, p, 10) for p in prompts]
    assert "Solving 5 requests" in capsys.readouterr().err
    # a prompt the engine can never hold is refused before any work, also when it would enter the queue late
    threads.clear()
    handle = drafter.register_forward_hook(lambda *args: threads.add(threading.current_thread()))
    try:
        with pytest.raises(ValueError):
            target.generate_batch([*prompts, [1] * 100_000], generation_config=GREEDY, assistant_model=drafter,
                                  continuous_batching_config=ContinuousBatchingConfig(max_queue_size=2))
    finally:
        handle.remove()
    assert not threads


def test_run_until_done_serves_the_queued_requests_and_returns():
    target, drafter = pair("qwen3")
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (6, 14, 3)]
    manager = target.init_continuous_batching(generation_config=GREEDY, assistant_model=drafter)
    request_ids = manager.add_requests(prompts, max_new_tokens=12)
    manager.run_until_done()
    outputs = {}
    while (output := manager.get_result(timeout=0)) is not None:
        outputs[output.request_id] = output.generated_tokens
    assert [outputs[request_id] for request_id in request_ids] == [plain_greedy(target, p, 12) for p in prompts]
    assert not manager.is_running() and manager.engine.row_steps > 0


def test_the_api_streams_cancels_and_passes_through_without_a_drafter():
    # transformers' own manager, without a drafter (on a model of its own: it switches the model to paged attention)
    assert isinstance(tiny_target().init_continuous_batching(generation_config=GREEDY), ContinuousBatchingManager)
    target, drafter = pair("qwen3")
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (6, 14)]
    with target.continuous_batching_context_manager(generation_config=GREEDY, assistant_model=drafter) as manager:
        assert manager.is_running() and manager.batch_processor is not None
        streamed = manager.add_request(prompts[0], max_new_tokens=16, streaming=True)
        cancelled = manager.add_request(prompts[1], max_new_tokens=400)
        manager.cancel_request(cancelled)
        outputs = list(manager.request_id_iter(streamed))
    assert not manager.is_running()
    assert len(outputs) > 1 and outputs[-1].generated_tokens == plain_greedy(target, prompts[0], 16)
    assert all(a.generated_tokens == b.generated_tokens[: len(a.generated_tokens)]
               for a, b in zip(outputs, outputs[1:]))
    assert manager.engine.pool_usage()["target_pages_used"] == 0


def test_two_managers_on_one_drafter_keep_their_own_buffers():
    """The engine's buffers belong to its manager, not to the drafter: two running at once stay exact."""
    target, drafter = pair("llama")
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (4, 13, 8, 21)]
    managers = [target.init_continuous_batching(generation_config=GREEDY, assistant_model=drafter) for _ in range(2)]
    for manager in managers:
        manager.start()
    ids = [[manager.add_request(p, max_new_tokens=14) for p in prompts[i::2]] for i, manager in enumerate(managers)]
    answers = [finished_results(manager, len(request_ids)) for manager, request_ids in zip(managers, ids)]
    for manager in managers:
        manager.stop()
    for i, request_ids in enumerate(ids):
        for request_id, prompt in zip(request_ids, prompts[i::2]):
            assert answers[i][request_id].generated_tokens == plain_greedy(target, prompt, 14)


def os_threads() -> set[int]:
    """The ids of this process's threads, OpenMP's among them (Python's `threading` knows only its own)."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def openmp_pool_of_this_thread() -> set[int]:
    """The threads the calling thread's next parallel op starts: its OpenMP pool, freed first, then built again."""
    assert release_openmp_threads()
    before = os_threads()
    torch.randn(1 << 20).exp_()  # one parallel region over both intra-op threads
    return os_threads() - before


def gone(threads: set[int], seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while threads & os_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not threads & os_threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_releasing_the_openmp_threads_ends_the_calling_threads_pool_and_the_next_parallel_op_builds_it_again():
    torch.set_num_threads(2)  # the module's fixture puts it back to one
    pool = openmp_pool_of_this_thread()
    assert len(pool) == 1  # torch's second intra-op thread
    assert release_openmp_threads() and gone(pool)
    assert openmp_pool_of_this_thread()  # parallel work goes on, on a new pool


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_start_frees_the_calling_threads_openmp_pool_on_a_cpu_and_the_worker_stays_exact():
    """A worker thread steps slower beside the caller's waiting OpenMP threads (dflash_openmp.py): `start` ends them."""
    target, drafter = pair("llama")
    torch.set_num_threads(2)
    pool = openmp_pool_of_this_thread()
    manager = target.init_continuous_batching(generation_config=GREEDY, assistant_model=drafter)
    manager.start()
    try:
        assert gone(pool), "the caller's OpenMP threads outlived start()"
        prompt = random_prompt(9, seed=3)[0].tolist()
        request_id = manager.add_request(prompt, max_new_tokens=12)
        answer = finished_results(manager, 1)[request_id].generated_tokens
    finally:
        manager.stop()
    assert answer == plain_greedy(target, prompt, 12)


def finished_results(manager: DFlashContinuousBatchingManager, count: int, seconds: float = 60) -> dict:
    """The first `count` finished outputs of a running manager, by request id."""
    finished, deadline = {}, time.monotonic() + seconds
    while len(finished) < count and time.monotonic() < deadline:
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            finished[result.request_id] = result
    return finished


def test_config_settings_the_engine_does_not_apply_are_named_and_the_queue_bound_is_kept():
    target, drafter = pair("llama")
    config = ContinuousBatchingConfig(allow_block_sharing=False, q_padding_interval_size=64, max_queue_size=3,
                                      max_batch_tokens=64)
    with CaptureLogger(dflash_continuous.logger) as captured:
        manager = DFlashContinuousBatchingManager(target, drafter, GREEDY, config)
    named = captured.out.split("settings: ")[1].split(" (")[0]
    assert named == "allow_block_sharing, q_padding_interval_size"  # not what it applies, nor what was left alone
    assert manager.input_queue.maxsize == 3 and manager.engine.prefill_chunk == 64
    with CaptureLogger(dflash_continuous.logger) as captured:
        DFlashContinuousBatchingManager(target, drafter, GREEDY, ContinuousBatchingConfig(max_batch_tokens=64))
    assert "does not apply" not in captured.out


def test_bad_requests_are_refused_before_any_work():
    target, drafter = pair("llama")
    manager = target.init_continuous_batching(generation_config=GREEDY, assistant_model=drafter)
    with pytest.raises(ValueError, match="more than a sequence may hold"):
        manager.add_request([1] * 1000, max_new_tokens=100)
    with pytest.raises(ValueError, match="min_p is not served per request"):
        manager.add_request([1, 2], min_p=0.1)
    with pytest.raises(ValueError, match="also sets min_p"):
        target.init_continuous_batching(generation_config=GenerationConfig(min_p=0.1), assistant_model=drafter)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        manager.add_request([1, 2], repetition_penalty=0.0)
    with pytest.raises(ValueError, match="takes a DFlash drafter"):
        target.init_continuous_batching(generation_config=GREEDY, assistant_model=target)
    assert manager.input_queue.empty()


def test_a_failing_prefill_fails_its_request_alone_and_a_failing_step_fails_its_requests():
    target, drafter = pair("llama")
    poison, fail_next_step = 200, threading.Event()

    def faults(_module, args):  # prompts are not a block long; a verify's and a draft's rows are
        if args[0].shape[1] != drafter.config.block_size and bool((args[0] == poison).any()):
            raise RuntimeError("injected fault")
        if args[0].shape[1] == drafter.config.block_size and fail_next_step.is_set():
            fail_next_step.clear()
            raise RuntimeError("injected step fault")

    good = [1, 2, 3, 4, 7]
    expected = plain_greedy(target, good, 8)
    handle = target.get_input_embeddings().register_forward_pre_hook(faults)
    try:
        # full-width steps: the hook tells a step's forwards from a prefill by their block of rows
        manager = target.init_continuous_batching(generation_config=GREEDY, assistant_model=drafter,
                                                  dflash_adaptive=False)
        manager.start()
        ids = [manager.add_request([5, poison, 6], max_new_tokens=8), manager.add_request(good, max_new_tokens=8)]
        results = finished_results(manager, len(ids))
        assert "injected fault" in results[ids[0]].error
        assert results[ids[1]].error is None and results[ids[1]].generated_tokens == expected
        fail_next_step.set()
        failed = manager.add_request(good, max_new_tokens=8)
        assert "injected step fault" in manager.get_result(failed, timeout=30).error
        again = manager.add_request(good, max_new_tokens=8)
        assert manager.get_result(again, timeout=30).generated_tokens == expected
        assert manager.is_running() and manager.background_thread_status.fatal_error is None
        manager.stop()
    finally:
        handle.remove()
    assert manager.engine.pool_usage()["target_pages_used"] == manager.engine.pool_usage()["drafter_pages_used"] == 0


def live_tensor_bytes() -> int:
    """Bytes of every tensor the garbage collector can reach (what a request that leaked state would grow); a oneDNN
    tensor (the CPU engine's packed weights) has no storage to ask, and counts its elements."""
    gc.collect()
    return sum(
        o.numel() * o.element_size() if o.is_mkldnn else o.untyped_storage().nbytes()
        for o in gc.get_objects() if issubclass(type(o), torch.Tensor)
    )


@pytest.mark.parametrize("family, count, sample", [("llama", 1000, 50), ("qwen3_5_text", 60, 4)])
def test_a_burst_of_short_requests_with_cancellations_leaves_both_pools_whole(family, count, sample):
    """Two waves of count / 2 requests, every fifth cancelled: both pools are whole after each wave, and the second
    wave leaves no more tensor memory behind than the first did (memory is flat, not growing per request); every
    `sample`-th request is checked against plain greedy."""
    target, drafter = pair(family)
    manager = DFlashContinuousBatchingManager(target, drafter, GREEDY, max_batch_size=8, max_tokens=512)
    manager.start()
    expected, finished, held, half = {}, {}, [], count // 2
    for wave in range(2):
        for i in range(half * wave, half * (wave + 1)):
            request_id = manager.add_request(random_prompt(1 + i % 6, seed=i)[0].tolist(), max_new_tokens=1 + i % 5)
            if i % 5 == 2:
                manager.cancel_request(request_id)
            else:
                expected[request_id] = i
        deadline = time.monotonic() + 300
        while len(finished) < len(expected) and time.monotonic() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None:
                assert result.error is None and result.request_id in expected, result
                finished[result.request_id] = result
        assert len(finished) == len(expected)
        usage = manager.engine.pool_usage()
        assert usage["target_pages_used"] == usage["drafter_pages_used"] == 0, wave
        held.append(live_tensor_bytes())
    scheduler = manager.batch_processor.scheduler
    manager.stop()
    assert held[1] <= held[0], held
    assert not scheduler.active_requests and not scheduler.waiting_requests and not manager.engine.sequences
    assert manager.engine.compute_free_capacity() == 1.0  # what transformers serve's stats line reads
    assert len(manager.engine.target_pool.free_pages) == len(set(manager.engine.target_pool.free_pages))
    assert not manager.result_handlers and not manager._unclaimed
    for request_id in list(expected)[::sample]:  # a sample of them against plain greedy
        i = expected[request_id]
        assert finished[request_id].generated_tokens == plain_greedy(
            target, random_prompt(1 + i % 6, seed=i)[0].tolist(), 1 + i % 5)


def test_a_request_that_can_carry_a_length_dependent_rope_past_its_switch_is_warned_about():
    """As generate warns of a call (tests/test_families.py), the manager warns of a request whose verify blocks can
    reach a dynamic RoPE's switch before plain decoding does; a request a block short of it is queued silently."""
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    target = family_target("llama", max_position_embeddings=64, rope_parameters=dynamic)
    drafter = tiny_drafter(target, block_size=4, max_position_embeddings=128)
    manager = target.init_continuous_batching(generation_config=GREEDY, assistant_model=drafter)
    prompt = random_prompt(8)[0].tolist()
    with CaptureLogger(dflash_continuous.logger) as captured:  # 8 + 52 tokens, and a block of 4, stay within 64
        manager.add_request(prompt, max_new_tokens=52)
    assert "RoPE" not in captured.out
    with CaptureLogger(dflash_continuous.logger) as captured:
        manager.add_request(prompt, max_new_tokens=56)
    assert "dynamic RoPE changes its frequencies once a forward passes 64 positions" in captured.out
    assert "keep prompt + max_new_tokens at or below 60" in captured.out


@pytest.mark.parametrize("static_shapes", [False, True])
def test_requests_take_pages_as_they_grow_and_the_newest_is_preempted_when_they_run_out(static_shapes):
    """A pool of 12 pages (192 positions) and four requests of 20-token prompts asking 60 new tokens: reserving their
    whole length up front (6 pages each) two would run at once. Taking pages as they grow, all four start together;
    when the next step needs more pages than are free the newest goes back to the queue and comes back with what it
    generated as its prompt. Every request equals its own plain greedy, its streamed outputs only grow, and the pools
    end whole."""
    target, drafter = pair("llama")
    manager = DFlashContinuousBatchingManager(target, drafter, GREEDY, max_batch_size=4, max_tokens=192,
                                              static_shapes=static_shapes)
    engine = manager.engine
    prompts = [random_prompt(20, seed=70 + i)[0].tolist() for i in range(4)]
    requests = [dict(input_ids=prompt, request_id=f"r{i}", max_new_tokens=60, streaming=True)
                for i, prompt in enumerate(prompts)]
    running, run_step = [], engine.run_step
    engine.run_step = lambda: running.append(len(engine.sequences)) or run_step()
    outputs, scheduler, _ = run_schedule(manager, {0: requests}, {})
    for i, prompt in enumerate(prompts):
        got, reference = outputs[f"r{i}"], plain_greedy(target, prompt, 60)
        lengths = [len(output.generated_tokens) for output in got]
        assert lengths == sorted(lengths) and all(o.generated_tokens == reference[: len(o.generated_tokens)] for o in got)
        assert got[-1].is_finished() and got[-1].generated_tokens == reference, i
    assert manager.preemptions > 0 and max(running) == 4, (manager.preemptions, running)
    assert not scheduler.active_requests and not scheduler.waiting_requests
    usage = engine.pool_usage()
    assert usage["target_pages_used"] == usage["drafter_pages_used"] == 0


@pytest.mark.parametrize("prefill_chunk", [3, 512])  # admitted one at a time, or packed into one forward
def test_requests_that_fit_together_are_admitted_together(prefill_chunk):
    """`fits_now` over requests admitted together (each after the ones `ahead` of it) agrees with the check each
    meets once the ones before it run: a pool of 8 pages, a block of 16, two requests that grow a page in their next
    steps and one that would fill the rest (the state machine found them disagreeing)."""
    target, _ = pair("llama")
    engine = DFlashEngine(target, tiny_drafter(target, block_size=16), max_batch_size=3, max_tokens=128,
                          prefill_chunk=prefill_chunk)
    shapes, ahead = [(1, 16), (1, 16), (17, 1)], []
    for shape in shapes:  # as the manager takes them: in order, while they fit
        if not engine.fits_now(*shape, ahead=ahead):
            break
        ahead.append(shape)
    assert ahead == shapes[:2]  # each of the first two holds 3 pages for its first two steps: 6 of 8
    firsts = engine.admit_many([(i, random_prompt(length, seed=i)[0].tolist(), new, SamplingSettings())
                                for i, (length, new) in enumerate(ahead)])
    assert not any(isinstance(first, Exception) for first in firsts) and len(engine.sequences) == 2
    assert not engine.fits_now(*shapes[2])  # and the third does not fit after them either


def test_the_engine_refuses_what_it_can_never_hold():
    target, drafter = pair("llama")
    engine = DFlashEngine(target, drafter, max_batch_size=2, max_tokens=64)
    with pytest.raises(ValueError, match="engine's whole memory"):
        engine.check_request(40, 30)
    assert not engine.fits_now(40, 30)
