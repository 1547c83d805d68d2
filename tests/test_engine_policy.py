"""The verify policy in the continuous-batching engine (modeling/dflash_engine.py, modeling/dflash_policy.py).

Exactness under the policy: greedy requests equal plain greedy under drawn arrival schedules while the policy narrows
the verify or skips drafting (fixed costs force each), and while a drawn policy mixes every width with plain steps;
an oracle drafter proposes the reference continuation with planted mistakes, so that narrow steps accept drafts and
the drafter context written at one width is read at another. Every test checks that the engine verified what the
policy chose (a policy silently ignored fails). Sampled requests stay target-distributed with the policy narrowing,
and a seeded sampled run repeats given fixed costs. With static shapes (what a GPU records as CUDA graphs, run
eagerly here) the same hold for the step in parts: padded rows, widths rounded up to their buckets, no waiting rows.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from hf_dflash.modeling.dflash_acceptance import Proposal
from hf_dflash.modeling.dflash_capture import TargetHiddenCapture
from hf_dflash.modeling.dflash_continuous import DFlashContinuousBatchingManager
from hf_dflash.modeling.dflash_engine import DFlashEngine, StepPart, bucket_size
from hf_dflash.modeling.dflash_policy import VerifyCost, VerifyPolicy
from tests.conftest import random_prompt, scratch_draft_logits, tiny_drafter, tiny_target
from tests.test_continuous_batching import (
    GREEDY, chi_square_upper, exact_distribution, pair, plain_greedy, request_plans, run_schedule, statistic,
)

BLOCK = 6
# Fixed costs (a, b, drafter seconds) with the oracle's confidence of 0.8: rows at 0.2 of a step verify about half
# the block; a drafter pass dearer than five plain steps makes plain steps pay after a sequence's first drafted one.
NARROW, PLAIN = (1.0, 0.2, 0.1), (1.0, 1.0, 5.0)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models are bound by per-op overhead: one thread each (see conftest.one_thread)."""


class DrawnWidths(VerifyPolicy):
    """A policy whose choices are drawn (seeded): plain steps and every width up to the cap, in any order, and
    where the engine verifies ragged blocks every sequence its own."""

    def __init__(self, seed: int):
        super().__init__(VerifyCost(fixed=NARROW), whole_batch=True)
        self.draw = random.Random(seed)

    def should_draft(self, live) -> bool:
        return self.draw.random() < 0.75

    def width(self, live, confidence, cap) -> int:
        return self.draw.randint(1, cap)

    def row_widths(self, live, confidence, caps) -> list[int]:
        return [self.draw.randint(1, cap) for cap in caps]


def make_policy(kind: str, seed: int = 0) -> VerifyPolicy:
    if kind == "drawn":
        return DrawnWidths(seed)
    return VerifyPolicy(VerifyCost(fixed=NARROW if kind == "narrow" else PLAIN), whole_batch=True)


@contextlib.contextmanager
def oracle(engine: DFlashEngine, references: dict[str, list[int]], wrong_every: int) -> Iterator[None]:
    """The engine's drafter proposes each request's reference continuation after its anchor, except at every
    `wrong_every`-th position, with confidence 0.8 everywhere. The real drafter still runs (its context is written
    and read as always); only its proposal is replaced."""
    proposer = engine.proposer
    propose = proposer.propose

    def oracle_propose(hidden, logits, anchor_ids, rule):
        proposal = propose(hidden, logits, anchor_ids, rule)
        drafts = proposal.drafts.clone()
        for row, sequence in enumerate(engine.sequences):
            reference = references[sequence.key]
            done = len(reference) - (sequence.max_length - sequence.position - 1)  # committed tokens, anchor included
            for j in range(drafts.shape[1]):
                column = done + j
                right = column < len(reference) and (column + row) % wrong_every
                drafts[row, j] = reference[column] if right else (reference[min(column, len(reference) - 1)] + 1) % 200
        return Proposal(drafts=drafts, probs=None, confidence=torch.full_like(proposal.confidence, 0.8))

    proposer.propose = oracle_propose
    try:
        yield
    finally:
        del proposer.propose


@contextlib.contextmanager
def verify_widths(target: torch.nn.Module) -> Iterator[Counter]:
    """Counts the rows of each of the target's verify forwards (position 0 not among them: not a prompt): a
    ragged verify's are its sequences' rows, packed into one."""
    seen: Counter = Counter()

    def count(_module, _args, kwargs):
        if int(kwargs["position_ids"][0, 0]) > 0:
            seen[kwargs["input_ids"].shape[1]] += 1

    handle = target.register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def check_policy_schedule(
    plans: list[dict], max_batch_size: int, kind: str, wrong_every: int, static_shapes: bool = False
) -> tuple[DFlashEngine, list[tuple[StepPart, int, int]]]:
    """Run the plans under a `make_policy(kind)` policy with the oracle drafter and check every request against
    plain greedy and the verify widths against the policy's. Returns the engine, and with static shapes every part
    run: (part, rows it ran at, rows running)."""
    target, _ = pair("llama")
    drafter = tiny_drafter(target, block_size=BLOCK)
    policy = make_policy(kind, seed=len(plans))
    manager = DFlashContinuousBatchingManager(target, drafter, GREEDY, max_batch_size=max_batch_size, adaptive=policy,
                                              static_shapes=static_shapes)
    assert manager.engine.policy is policy and manager.engine.static_shapes == static_shapes
    assert manager.engine.ragged_verify != static_shapes
    # each step's verified rows, as the policy records them: (rows of the verify's forward, whether ragged)
    chosen, record = [], policy.record
    policy.record = lambda live, rows, *rest: (
        chosen.append((rows, False) if isinstance(rows, int) else (sum(rows), True)) or record(live, rows, *rest)
    )
    arrivals, expected = {}, {}
    for i, plan in enumerate(plans):
        prompt = random_prompt(plan["prompt_length"], seed=plan["seed"])[0].tolist()
        expected[f"r{i}"] = plain_greedy(target, prompt, plan["max_new_tokens"])
        arrivals.setdefault(plan["arrival"], []).append(dict(
            input_ids=prompt, request_id=f"r{i}", max_new_tokens=plan["max_new_tokens"], streaming=True,
        ))
    parts = []  # with static shapes: (part, rows run, rows running) of every part run
    run_static = manager.engine._run_static
    manager.engine._run_static = lambda part, n, *shape: (
        parts.append((part, n, len(manager.engine.sequences))) or run_static(part, n, *shape)
    )
    with oracle(manager.engine, expected, wrong_every), verify_widths(target) as seen:
        outputs, scheduler, _ = run_schedule(manager, arrivals, {})
    for request_id, reference in expected.items():
        got = outputs[request_id]
        assert all(o.generated_tokens == reference[: len(o.generated_tokens)] for o in got), request_id
        assert got[-1].is_finished() and got[-1].generated_tokens == reference, (request_id, kind)
    engine = manager.engine
    # the engine verified exactly what the policy chose, and the target's forwards had those rows
    assert engine.width_steps == Counter(policy.widths), (engine.width_steps, policy.widths)
    assert Counter(rows for rows, _ in chosen) == seen, (chosen, seen)
    assert engine.ragged_steps == sum(ragged for _, ragged in chosen)
    assert not policy.stats and not engine.sequences  # every request left the policy with its row
    if static_shapes:  # the step ran in parts, each verify at a width bucket (1, 2, 4 or the block), rows padded
        assert set(engine.width_steps) <= {1, 2, 4, BLOCK}, engine.width_steps
        verified = Counter(part.width for part, _, _ in parts if part.kind != "draft")
        assert verified == engine.width_steps and {part.kind for part, _, _ in parts} <= {"draft", "verify", "plain"}
        assert all(rows == bucket_size(running, max_batch_size) for _, rows, running in parts)
    else:
        assert not parts
    return engine, parts


@pytest.mark.parametrize("kind", ["narrow", "plain", "drawn"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(plans=request_plans, max_batch_size=st.integers(1, 4), wrong_every=st.sampled_from([3, 7, 1000]))
def test_greedy_identity_under_drawn_schedules_with_the_policy(kind, plans, max_batch_size, wrong_every):
    for plan in plans:  # eos and cancellations are covered by test_continuous_batching.py; widths are the point here
        plan.update(eos_at=None, cancel_after=None)
    engine, _ = check_policy_schedule(plans, max_batch_size, kind, wrong_every)
    steps = sum(engine.width_steps.values())
    # an oracle wrong only every 7th token or less earns the whole block: its calibration trusts it
    if steps >= 4 and kind == "narrow" and wrong_every == 3:
        assert any(1 < width < BLOCK for width in engine.width_steps), engine.width_steps
    if steps >= 4 and kind == "plain":
        assert engine.width_steps[1] > 0, engine.width_steps


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(plans=request_plans, max_batch_size=st.integers(1, 4), wrong_every=st.sampled_from([3, 1000]))
def test_greedy_identity_under_drawn_schedules_with_the_policy_at_static_shapes(plans, max_batch_size, wrong_every):
    for plan in plans:
        plan.update(eos_at=None, cancel_after=None)
    check_policy_schedule(plans, max_batch_size, "drawn", wrong_every, static_shapes=True)


def test_warmup_at_static_shapes_runs_every_part_of_the_policys_step():
    """The manager's warmup runs (on a GPU: records) the drafter's part, the plain part and the verify part at every
    width bucket, at every row bucket; requests then still equal plain greedy."""
    target, _ = pair("llama")
    drafter = tiny_drafter(target, block_size=BLOCK)
    manager = DFlashContinuousBatchingManager(target, drafter, GREEDY, max_batch_size=4, static_shapes=True,
                                              adaptive=make_policy("drawn", seed=2))
    engine, runs = manager.engine, []
    run_static = engine._run_static
    engine._run_static = lambda part, n, *shape: runs.append((part, n)) or run_static(part, n, *shape)
    manager.warmup()
    widths = [StepPart("verify", width) for width in (1, 2, 4, BLOCK)]
    assert {part for part, _ in runs} == {StepPart("draft", BLOCK), StepPart("plain", 1), *widths}
    assert {(part, n) for part in widths for n in (1, 2, 4)} <= set(runs)
    prompts = {f"r{i}": random_prompt(n, seed=40 + i)[0].tolist() for i, n in enumerate((7, 12, 3))}
    arrivals = {0: [dict(input_ids=prompt, request_id=key, max_new_tokens=20) for key, prompt in prompts.items()]}
    outputs, _, _ = run_schedule(manager, arrivals, {})
    assert all(outputs[key][-1].generated_tokens == plain_greedy(target, prompt, 20) for key, prompt in prompts.items())


@pytest.mark.parametrize("static_shapes", [False, True])
@pytest.mark.parametrize("kind", ["narrow", "plain", "drawn"])
def test_a_fixed_schedule_with_the_policy_accepts_drafts_at_narrow_widths(kind, static_shapes):
    plans = [
        dict(prompt_length=5, max_new_tokens=30, arrival=0, seed=1),
        dict(prompt_length=23, max_new_tokens=17, arrival=0, seed=2),
        dict(prompt_length=2, max_new_tokens=25, arrival=1, seed=3),
        dict(prompt_length=31, max_new_tokens=12, arrival=4, seed=4),
    ]
    # 4 rows with static shapes: three running requests step padded to 4
    engine, parts = check_policy_schedule(plans, 4 if static_shapes else 3, kind, 5, static_shapes=static_shapes)
    widths = engine.width_steps
    assert engine.accepted_drafts > 0
    assert not static_shapes or any(rows > running for _, rows, running in parts)
    if kind == "narrow":  # it chooses 5 of 6 rows here, which static shapes verify at the bucket of 6
        assert sum(widths.values()) < 40 and (static_shapes or any(1 < width < BLOCK for width in widths)), widths
    elif kind == "plain":
        assert widths[1] > sum(widths.values()) // 2, widths
    else:
        assert widths[1] > 0 and len(widths) >= 4 and any(1 < width < BLOCK for width in widths), widths
        assert static_shapes or engine.ragged_steps > 0


@pytest.mark.parametrize("static_shapes", [False, True])
@torch.no_grad()
def test_the_drafter_reads_exactly_the_committed_context_whatever_the_widths_were(static_shapes):
    """At every drafted step, after plain steps and verifies of every width, each row's draft logits equal the
    drafter run from scratch over the target's rows of exactly its committed tokens: rows written past the accepted
    ones (or never captured by a narrower verify) are never read. With static shapes every drafted step stores all B
    captured rows, stale ones included, and rows run padded."""
    target, _ = pair("llama")
    drafter = tiny_drafter(target, block_size=BLOCK)
    policy = make_policy("drawn", seed=11)
    # 4 rows with static shapes: three running requests step padded to 4
    manager = DFlashContinuousBatchingManager(target, drafter, GREEDY, max_batch_size=4 if static_shapes else 3,
                                              adaptive=policy, static_shapes=static_shapes)
    engine = manager.engine
    prompts = {f"r{i}": random_prompt(n, seed=20 + i)[0].tolist() for i, n in enumerate((6, 17, 3, 11))}
    references = {key: plain_greedy(target, prompt, 28) for key, prompt in prompts.items()}
    capture = TargetHiddenCapture(target, drafter.config.target_layer_ids, target.config.hidden_size)
    draft, checked = engine.draft, []

    def context_rows(tokens: list[int]) -> torch.Tensor:
        """The target's captured rows (c, k * H) of a plain forward over `tokens`."""
        rows = torch.empty(1, len(tokens), drafter.config.num_context_features)
        capture.destination = rows
        try:
            target(torch.tensor([tokens]))
        finally:
            capture.destination = None
        return rows[0]

    def checked_draft(rows, context_rows_count=None):
        hidden, logits = draft(rows, context_rows_count)
        for row, sequence in enumerate(list(engine.sequences)):
            reference = references[sequence.key]
            done = len(reference) - (sequence.max_length - sequence.position - 1)
            committed = prompts[sequence.key] + reference[: done - 1]  # every token before the anchor
            with one_thread_capture(capture):
                expected = scratch_draft_logits(target, drafter, context_rows(committed), reference[done - 1])
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
            checked.append(done)
        return hidden, logits

    engine.draft = checked_draft
    arrivals = {}
    for arrival, key in zip((0, 0, 2, 5), prompts):
        arrivals.setdefault(arrival, []).append(dict(input_ids=prompts[key], request_id=key, max_new_tokens=28))
    with oracle(engine, references, wrong_every=4):
        outputs, _, _ = run_schedule(manager, arrivals, {})
    assert all(outputs[key][-1].generated_tokens == references[key] for key in prompts)
    widths = engine.width_steps
    assert widths[1] > 0 and any(1 < width < BLOCK for width in widths) and engine.accepted_drafts > 0, widths
    assert static_shapes or engine.ragged_steps > 0  # sequences of one step verified different widths
    assert len(checked) > 10


@contextlib.contextmanager
def one_thread_capture(capture: TargetHiddenCapture) -> Iterator[None]:
    """The capture's hooks, on for this thread's forwards while inside (the engine's own capture is off then)."""
    with capture:
        yield


@pytest.mark.parametrize("static_shapes", [False, True])
def test_sampled_requests_follow_the_target_with_the_policy_narrowing(static_shapes):
    """Vocabulary 4, three new tokens, temperature 1: a fixed cost narrows most drafted steps to 2 or 3 of 4 rows
    (with static shapes: 2 of 4) and skips drafting on others; the samples still fit the target's own
    distribution."""
    target = tiny_target("llama", seed=3, vocab_size=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(4)
    drafter = tiny_drafter(target, mask_token_id=3)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=3, eos_token_id=-1)
    policy = make_policy("drawn", seed=7)
    manager = DFlashContinuousBatchingManager(target, drafter, config, max_batch_size=16, adaptive=policy,
                                              static_shapes=static_shapes)
    prompt, samples = [0, 1, 2, 1], 800
    requests = [dict(input_ids=prompt, request_id=f"s{i}") for i in range(samples)]
    torch.manual_seed(0)
    outputs, _, _ = run_schedule(manager, {0: requests}, {}, turns=10_000)
    widths = manager.engine.width_steps
    assert widths[1] > 0 and any(1 < width < 4 for width in widths), widths
    assert manager.engine.accepted_drafts > 0 and (static_shapes or manager.engine.ragged_steps > 0)
    counts = Counter(tuple(outputs[f"s{i}"][-1].generated_tokens) for i in range(samples))
    value, degrees = statistic(counts, exact_distribution(target, prompt, 3, 1.0), samples)
    assert value < chi_square_upper(degrees), (value, degrees)


@pytest.mark.parametrize("adaptive", [False, "narrow", "drawn"])
def test_a_seeded_sampled_run_repeats_given_fixed_costs(adaptive):
    target, drafter = pair("llama")
    config = GenerationConfig(do_sample=True, temperature=0.9, top_k=20, top_p=0.9, max_new_tokens=12, eos_token_id=-1)

    def run() -> tuple[list[list[int]], Counter]:
        policy = adaptive if adaptive is False else make_policy(adaptive, seed=3)
        manager = DFlashContinuousBatchingManager(target, drafter, config, max_batch_size=3, adaptive=policy)
        arrivals = {t: [dict(input_ids=random_prompt(3 + t, seed=t)[0].tolist(), request_id=f"r{t}")] for t in range(5)}
        torch.manual_seed(1234)
        outputs, _, _ = run_schedule(manager, arrivals, {})
        return [outputs[f"r{t}"][-1].generated_tokens for t in range(5)], manager.engine.width_steps

    first, widths = run()
    assert run() == (first, widths)
    assert len({tuple(tokens) for tokens in first}) > 1
    assert (set(widths) == {drafter.config.block_size}) == (adaptive is False), widths


def test_the_option_defaults_to_on_on_a_cpu_and_passes_through_the_entry_points():
    target, drafter = pair("qwen3")
    engine = DFlashEngine(target, drafter, max_batch_size=2)
    assert isinstance(engine.policy, VerifyPolicy) and engine.policy.whole_batch  # the target runs on a CPU
    assert DFlashEngine(target, drafter, max_batch_size=2, adaptive=False).policy is None
    with pytest.raises(ValueError, match="adaptive must be True, False, None"):
        DFlashEngine(target, drafter, adaptive="yes")
    # static shapes (a GPU's default) keep the full width unless asked; asked, the policy runs the step in parts
    assert DFlashEngine(target, drafter, max_batch_size=2, static_shapes=True).policy is None
    assert DFlashEngine(target, drafter, max_batch_size=2, static_shapes=True, adaptive=True).policy.whole_batch
    policy = make_policy("plain")
    manager = target.init_continuous_batching(generation_config=GREEDY, assistant_model=drafter,
                                              dflash_adaptive=policy)
    assert manager.engine.policy is policy
    assert target.init_continuous_batching(generation_config=GREEDY, assistant_model=drafter,
                                           dflash_adaptive=False).engine.policy is None
    with pytest.raises(ValueError, match="dflash_adaptive sets the DFlash engine's verify policy"):
        target.init_continuous_batching(generation_config=GREEDY, dflash_adaptive=True)
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (4, 9)]
    policy = make_policy("plain")
    out = target.generate_batch(prompts, generation_config=GREEDY, assistant_model=drafter, dflash_adaptive=policy)
    assert [o.generated_tokens for o in out.values()] == [plain_greedy(target, p, 16) for p in prompts]
    assert 1 in policy.widths and not policy.stats
