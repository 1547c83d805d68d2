"""The verify policy (modeling/dflash_policy.py): its choices under injected costs and confidences, and generate with
it on: greedy tokens equal plain greedy, the widths it chose are the ones verified, sampling stays exact."""

from __future__ import annotations

import pytest
import torch

from hf_dflash.bundled_models import load_stories260k
from hf_dflash.modeling import DFlashConfig, DFlashDraftModel
from hf_dflash.modeling import dflash_decoding
from hf_dflash.modeling.dflash_acceptance import DecodingRule, draft_confidence
from hf_dflash.modeling.dflash_policy import VerifyCost, VerifyPolicy, batch_class
from tests.conftest import random_prompt, tiny_drafter, tiny_target
from tests.test_sampling import (
    SAMPLED, SMALL_VOCAB, assert_tuples_follow, pair_probabilities, sample_with_greedy_drafts,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 16


def chosen_width(cost: tuple[float, float, float], confidence: float, history: int = 0, accepted: int = 0) -> int:
    """The width a fresh policy with a fixed cost (a, b, drafter seconds) picks for one sequence whose drafts all have
    `confidence`, after `history` full-width steps that each accepted `accepted` drafts of that confidence."""
    policy = VerifyPolicy(VerifyCost(fixed=cost), explore_every=1000)
    policy.start(1)
    row = [[confidence] * (BLOCK - 1)]
    for _ in range(history):
        policy.record([0], BLOCK, [accepted], row, 0.0, 0.0)
    return policy.width([0], row, BLOCK)


def test_width_grows_with_confidence_and_cheaper_rows():
    cheap, dear = (1.0, 0.01, 0.5), (1.0, 1.0, 0.5)
    assert chosen_width(cheap, 0.97) == BLOCK  # confident drafts, rows nearly free: verify them all
    assert chosen_width(cheap, 0.97) > chosen_width(dear, 0.97) > 1  # dearer rows: fewer of them
    assert chosen_width(dear, 0.97) > chosen_width(dear, 0.6) > chosen_width(dear, 0.2)
    assert chosen_width(dear, 0.05) == 1  # drafts hopeless by the drafter's own account: the anchor alone


def test_an_over_confident_drafter_is_discounted_down_to_plain_decoding():
    cost = (1.0, 0.1, 0.5)
    assert chosen_width(cost, 0.9) > BLOCK // 2
    assert chosen_width(cost, 0.9, history=20, accepted=0) == 1  # confident, always wrong: not worth a row
    assert chosen_width(cost, 0.9, history=20, accepted=BLOCK - 1) == BLOCK  # confident and right: all rows
    # and it stops drafting: its drafted steps committed 1 token at a drafter pass plus a verify, above a plain step
    policy = VerifyPolicy(VerifyCost(fixed=cost), explore_every=8)
    policy.start(1)
    for _ in range(5):
        policy.record([0], 1, [0], [[0.9] * (BLOCK - 1)], 0.0, 0.0)
    drafts = []
    for _ in range(8):
        drafts.append(policy.should_draft([0]))
        if not drafts[-1]:
            policy.record([0], 1, [0], None, None, 0.0)
    assert drafts == [False] * 7 + [True]  # plain steps, then one that drafts again to explore


def test_a_batch_verifies_its_widest_choice_and_drafts_while_any_sequence_pays():
    cost = (1.0, 1.0, 0.5)
    policy = VerifyPolicy(VerifyCost(fixed=cost), explore_every=1000)
    policy.start(3)
    rows = [[0.05] * (BLOCK - 1), [0.97] * (BLOCK - 1), [0.6] * (BLOCK - 1)]
    assert policy.width([0, 1, 2], rows, BLOCK) == chosen_width(cost, 0.97) > 2
    assert policy.width([0, 2], [rows[0], rows[2]], BLOCK) == chosen_width(cost, 0.6) == 2
    assert policy.width([0, 1, 2], rows, 3) == 3  # dflash_verify_rows stays the cap
    # where the engine verifies ragged blocks, each sequence its own choice instead of the widest, within its cap
    own = [chosen_width(cost, 0.05), chosen_width(cost, 0.97), chosen_width(cost, 0.6)]
    assert policy.row_widths([0, 1, 2], rows, [BLOCK] * 3) == own and own[0] == 1
    assert policy.row_widths([0, 1, 2], rows, [BLOCK, 2, BLOCK]) == [1, 2, 2]
    widest = VerifyPolicy(VerifyCost(fixed=cost), explore_every=1000, per_sequence=False)
    widest.start(3)
    assert widest.row_widths([0, 1, 2], rows, [BLOCK] * 3) == [max(own)] * 3
    for _ in range(5):  # sequence 0 never gains; sequence 1 commits whole blocks
        policy.record([0, 1], BLOCK, [0, BLOCK - 1], [rows[0], rows[1]], 0.0, 0.0)
    assert policy.should_draft([0, 1]) and not policy.should_draft([0])


def test_a_whole_batch_takes_the_width_of_its_most_tokens_per_second():
    """With many sequences some one nearly always wants the full block; `whole_batch` weighs the batch's total."""
    cost = (1.0, 1.0, 0.5)
    rows = [[0.05] * (BLOCK - 1), [0.97] * (BLOCK - 1), [0.6] * (BLOCK - 1)]
    widest, whole = (VerifyPolicy(VerifyCost(fixed=cost), explore_every=1000, whole_batch=flag) for flag in (0, 1))
    for policy in (widest, whole):
        policy.start(3)
    curves = [VerifyPolicy.expected_curve(row, BLOCK) for row in rows]
    rates = [sum(curve[k - 1] for curve in curves) / (0.5 + 1.0 + k) for k in range(1, BLOCK + 1)]
    best = 1 + rates.index(max(rates))
    assert whole.width([0, 1, 2], rows, BLOCK) == best < widest.width([0, 1, 2], rows, BLOCK)
    assert 1 < best
    for policy in (widest, whole):  # sequence 1 commits whole blocks, the other two nothing
        for _ in range(5):
            policy.record([0, 1, 2], BLOCK, [0, BLOCK - 1, 0], rows, 0.0, 0.0)
    assert widest.should_draft([0, 1, 2])  # one sequence pays: the widest rule drafts for all
    assert not whole.should_draft([0, 1, 2]) and whole.should_draft([1])  # the batch's total does not pay
    whole.steps = 998  # its 999th step takes its best width, its 1000th explores at twice that, not the whole block
    now = whole.width([0, 1, 2], rows, BLOCK)
    assert whole.width([0, 1, 2], rows, BLOCK) == min(BLOCK, max(2, 2 * now)) < BLOCK
    for _ in range(1000):  # a run of plain steps: the batch drafts again, at its best width
        whole.record([0, 1, 2], 1, [0, 0, 0], None, None, 0.0)
    assert whole.should_draft([0, 1, 2]) and whole.width([0, 1, 2], rows, BLOCK) == max(2, now)


def test_each_sequence_takes_its_own_width_the_best_split_of_the_best_total():
    """`row_widths` (a ragged verify, whose cost is that of its mean width): against every split of up to 4 rows
    over 3 sequences, it commits the most expected tokens per second; a confident sequence verifies more rows than an
    unsure one, and each stays within its own cap."""
    cost = (1.0, 0.4, 0.5)
    rows = [[0.1] * 3, [0.95] * 3, [0.7] * 3]
    policy = VerifyPolicy(VerifyCost(fixed=cost), explore_every=1000, whole_batch=True)
    policy.start(3)
    widths = policy.row_widths([0, 1, 2], rows, [4, 4, 4])
    assert widths[1] > widths[2] > widths[0] == 1, widths

    def rate(split: tuple[int, ...]) -> float:
        tokens = sum(VerifyPolicy.expected_tokens(row, k) for row, k in zip(rows, split))
        return tokens / (cost[2] + cost[0] + cost[1] * sum(split) / len(split))

    splits = [(a, b, c) for a in range(1, 5) for b in range(1, 5) for c in range(1, 5)]
    assert rate(tuple(widths)) == pytest.approx(max(rate(split) for split in splits))
    assert policy.row_widths([0, 1, 2], rows, [4, 2, 4])[1] == 2  # sequence 1 has room for one draft only
    # one width for the batch: without per_sequence, and on the steps the policy explores
    uniform = VerifyPolicy(VerifyCost(fixed=cost), explore_every=1000, whole_batch=True, per_sequence=False)
    uniform.start(3)
    assert uniform.row_widths([0, 1, 2], rows, [4, 4, 4]) == [uniform.width([0, 1, 2], rows, 4)] * 3
    policy.steps = 999  # its 1000th step explores: twice the batch's one best width, for every sequence
    best = uniform.width([0, 1, 2], rows, 4)
    assert policy.row_widths([0, 1, 2], rows, [4, 4, 4]) == [min(4, max(2, 2 * best))] * 3


def test_a_ragged_verifys_timing_counts_toward_the_widths_around_its_mean():
    cost = VerifyCost(decay=1.0)
    cost.record(4, 1, 1.0, 0.5)
    cost.record(4, 4, 4.0, 0.5)
    cost.record(4, 2.25, 3.0, 0.5)  # 9 rows over 4 sequences: a quarter of the way from 2 to 3 rows
    fit = cost.fits[batch_class(4)]
    assert fit.widths[2][:2] == [0.75 * 3.0, 0.75] and fit.widths[3][:2] == [0.25 * 3.0, 0.25]
    verify, _ = cost.curve(4, 4)
    assert verify[1] == verify[2] == pytest.approx(3.0)  # each width's own mean
    policy = VerifyPolicy(cost, whole_batch=True)
    policy.start(4)
    # a ragged step of 2 rows per sequence on average
    policy.record([0, 1, 2, 3], [3, 1, 2, 2], [2, 0, 1, 1], [[0.9] * 3, [0.2] * 3, [0.5] * 3, [0.5] * 3], 0.1, 2.0)
    assert fit.widths[2][:2] == [0.75 * 3.0 + 2.0, 1.75] and list(policy.widths)[-1] == 3
    assert policy.stats[0].drafted_rows == 3 and policy.stats[1].drafted_rows == 1


def test_sequences_join_and_leave_by_key():
    policy = VerifyPolicy(VerifyCost(fixed=(1.0, 1.0, 0.5)), explore_every=1000)
    confident = [0.9] * (BLOCK - 1)
    policy.add("a")
    policy.add(("b", 2))
    for _ in range(5):
        policy.record(["a", ("b", 2)], BLOCK, [0, BLOCK - 1], [confident, confident], 0.0, 0.0)
    assert policy.calibrated("a", [0.5])[0] < 0.1 and policy.calibrated(("b", 2), [0.5])[0] > 0.5
    assert policy.should_draft(["a", ("b", 2)]) and not policy.should_draft(["a"])
    policy.remove(("b", 2))
    policy.add(("b", 2))  # joins again: from the prior
    assert policy.calibrated(("b", 2), [0.5]) == [0.5] and set(policy.stats) == {"a", ("b", 2)}
    policy.remove("a")
    with pytest.raises(KeyError):
        policy.should_draft(["a"])
    assert list(policy.widths) == [BLOCK] * 5


def test_the_cost_fit_recovers_a_line_per_batch_class_and_explores_until_it_has_one():
    cost = VerifyCost(decay=1.0)
    policy = VerifyPolicy(cost, explore_every=1000)
    policy.start(1)
    confident = [[0.9] * (BLOCK - 1)]
    widths = []
    for step in range(6):
        k = policy.width([0], confident, BLOCK)
        widths.append(k)
        policy.record([0], k, [1], confident, 0.004, 0.010 + 0.002 * k + (0.0005 if step % 2 else -0.0005))
    assert widths[:2] == [BLOCK, 2]  # no line yet: the full width, then a narrow one
    a, b, draft = cost.line(1)
    assert a == pytest.approx(0.010, abs=1e-3) and b == pytest.approx(0.002, abs=1e-4) and draft == pytest.approx(0.004)
    assert cost.line(4) is None and batch_class(3) == batch_class(4) == 4 and batch_class(1) == 1


def test_a_whole_batch_explores_4_then_2_rows_until_it_has_a_line():
    cost = VerifyCost(decay=1.0)
    policy = VerifyPolicy(cost, explore_every=1000, whole_batch=True)
    policy.start(1)
    confident = [[0.9] * (BLOCK - 1)]
    for _ in range(3):
        k = policy.width([0], confident, BLOCK)
        policy.record([0], k, [1], confident, 0.004, 0.010 + 0.002 * k)
    assert list(policy.widths)[:2] == [4, 2] and cost.line(1) is not None


def learned_cost(seconds: dict[int, float], draft: float, repeats: int = 3) -> VerifyCost:
    """A cost learned from `repeats` timings of each width in `seconds` (rows -> verify seconds), and `draft`."""
    cost = VerifyCost(decay=1.0)
    for _ in range(repeats):
        for rows, verify in seconds.items():
            cost.record(1, rows, verify, draft)
    return cost


def test_a_plain_step_is_timed_before_drafting_is_judged_against_it():
    """Drafted steps time widths of two rows and more only. Until one plain step has been timed, the policy would take
    its cost from the narrowest width's (on a CPU nearly twice a plain step): it takes one plain step first, and then
    stops drafting where drafting commits fewer tokens per second."""
    cost = learned_cost({2: 1.9, BLOCK: 2.0}, draft=0.5)
    policy = VerifyPolicy(cost, explore_every=1000)
    policy.start(1)
    policy.record([0], BLOCK, [1], [[0.5] * (BLOCK - 1)], 0.5, 2.0)  # 2 tokens for 2.5 s
    assert cost.curve(1, BLOCK)[0][0] > 1.5  # a plain step's cost as the curve extrapolates it: drafting would pay
    assert policy.should_draft([0]) is False  # a plain step, to time one
    policy.record([0], 1, [0], None, None, 1.0)
    policy.stats[0].plain_run = 0
    assert policy.should_draft([0]) is False  # 2 tokens per 2.5 s drafted, against 1 per 1.0 s plain
    fixed = VerifyPolicy(VerifyCost(fixed=(1.0, 0.1, 0.5)), explore_every=1000)
    fixed.start(1)
    fixed.record([0], BLOCK, [10], [[0.9] * (BLOCK - 1)], 0.5, 2.5)
    assert fixed.should_draft([0]) is True  # an injected cost is never timed


def test_a_stepwise_verify_cost_picks_the_cheap_width_that_the_line_fit_misses():
    """On a CPU a verify's matrix products change kernels at some row count (SmolLM2 on 2 cores: 4 rows cost a third
    more than 3). Each width's own timing shows the step; the line fitted through them all does not."""
    step = {k: 1.0 + 0.02 * k + (0.6 if k >= 4 else 0.0) for k in range(1, BLOCK + 1)}
    cost = learned_cost(step, draft=0.3)
    verify, draft = cost.curve(1, BLOCK)
    assert verify == pytest.approx([step[k] for k in range(1, BLOCK + 1)]) and draft == pytest.approx(0.3)
    row = [[0.6] * (BLOCK - 1)]
    table = VerifyPolicy(cost, explore_every=1000)
    line = VerifyPolicy(VerifyCost(fixed=cost.line(1)), explore_every=1000)
    for policy in (table, line):
        policy.start(1)
    assert table.width([0], row, BLOCK) == 3  # the most tokens per second under the true costs
    assert line.width([0], row, BLOCK) > 4  # the line charges 3 rows too much and 5 or more too little


def test_widths_never_timed_are_interpolated_and_a_stall_counts_at_most_twice():
    cost = learned_cost({2: 1.0, 6: 2.0, 10: 2.4}, draft=0.5, repeats=2)
    verify, _ = cost.curve(1, 12)
    _, b, _ = cost.line(1)
    assert verify[3] == pytest.approx(1.5) and verify[7] == pytest.approx(2.2)  # 4 and 8 rows: between their neighbours
    # beyond them: the nearest one's mean, moved along the fitted slope
    assert verify[11] == pytest.approx(2.4 + 2 * b) and verify[0] == pytest.approx(max(1.0 - b, 0.0))
    cost.record(1, 6, 200.0, None)  # one step stalled by another process: counted as 4.0, twice the mean
    assert cost.curve(1, 12)[0][5] == pytest.approx((2.0 + 2.0 + 4.0) / 3)
    cost.record(1, 7, 300.0, None)  # a width's first timing, stalled: twice the dearest mean (6 rows' now)
    assert cost.curve(1, 12)[0][6] == pytest.approx(2 * (2.0 + 2.0 + 4.0) / 3)
    drafts = VerifyCost(decay=0.5)
    for seconds in (0.5, 50.0):
        drafts.record(1, 2, 1.0, seconds)
        drafts.record(1, 3, 1.0, None)
    assert drafts.curve(1, 3)[1] == pytest.approx(0.5 * 0.5 + 0.5 * 1.0)


def test_a_probe_step_times_the_width_next_to_the_chosen_one_timed_longest_ago():
    cost = learned_cost({1: 1.0, 2: 1.02, 4: 1.04, BLOCK: 2.0}, draft=0.1)
    policy = VerifyPolicy(cost, explore_every=4)
    policy.start(1)
    row = [[0.9, 0.9, 0.9] + [0.01] * (BLOCK - 4)]
    choices = [policy.width([0], row, BLOCK) for _ in range(3)]
    assert choices[0] == choices[2] == 4  # 4 rows: every confident draft, at about the cost of one row
    assert choices[1] == 3  # the probe: 3 rows were never timed (5 neither: the one below comes first)
    cost.record(1, 3, 1.03, 0.1)
    policy.steps = 5
    assert policy.width([0], row, BLOCK) == 5  # now 5, never timed


def test_choices_repeat_given_the_same_timings():
    def run() -> list[int]:
        policy = VerifyPolicy(VerifyCost(), explore_every=4)
        policy.start(2)
        generator = torch.Generator().manual_seed(0)
        for step in range(30):
            confidence = torch.rand(2, BLOCK - 1, generator=generator).tolist()
            k = policy.width([0, 1], confidence, BLOCK) if policy.should_draft([0, 1]) else 1
            policy.record([0, 1], k, [min(step % 5, k - 1), 0], confidence if k > 1 else None, 0.003, 0.01 + 0.001 * k)
        return policy.widths

    first = run()
    assert first == run() and len(set(first)) > 2


def test_confidence_reads_the_distribution_never_the_sampled_draft():
    """A width chosen from which token was drawn would bias rejection sampling; the row's distribution alone cannot."""
    logits = torch.randn(2, 5, 11)
    rule = DecodingRule(do_sample=True, rejection=True)
    torch.manual_seed(0)
    _, probs_a = rule.propose(logits)
    torch.manual_seed(1)
    _, probs_b = rule.propose(logits)
    torch.testing.assert_close(draft_confidence(logits, probs_a), draft_confidence(logits, probs_b))
    torch.testing.assert_close(draft_confidence(logits, probs_a), torch.softmax(logits, -1).amax(-1))


def test_an_argmax_proposals_confidence_is_the_largest_probability_the_policy_reads():
    """The policy reads a greedy DFlash proposal's own confidence instead of a second softmax of its logits."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    logits = torch.randn(2, drafter.config.block_size - 1, target.config.vocab_size) * 4
    proposal = drafter.propose(logits, None, lambda rows: rows, DecodingRule(do_sample=False, rejection=False))
    assert torch.equal(proposal.confidence, draft_confidence(logits, None))


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
def test_greedy_with_the_policy_equals_plain_greedy_and_verifies_what_it_chose(fast):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=8)  # random: its drafts are mostly wrong
    prompt = random_prompt(6, batch=2)
    plain = target.generate(prompt, max_new_tokens=40, do_sample=False)
    policy = VerifyPolicy(explore_every=8)
    out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter,
                          dflash_adaptive=policy, return_dict_in_generate=True, dflash_fast_path=fast)
    assert torch.equal(out.sequences, plain)
    # the policy ran: the loop verified the widths it chose, narrower than the block most of the time
    steps = max(len(lengths) for lengths in out.acceptance_lengths)
    assert len(policy.widths) == steps and policy.widths[0] == 8
    assert sum(width < 8 for width in policy.widths) > steps // 2
    for lengths in out.acceptance_lengths:
        assert all(taken <= width for taken, width in zip(lengths, policy.widths))


class Scripted(VerifyPolicy):
    """Drafts on the steps `script` marks True (3 rows), plain steps otherwise; keeps each drafted step's drafts."""

    def __init__(self, script: list[bool]):
        super().__init__(VerifyCost(fixed=(1.0, 1.0, 0.5)))
        self.script, self.drafted = script, []

    def should_draft(self, live) -> bool:
        return self.script[len(self.widths) % len(self.script)]

    def width(self, live, confidence, cap: int) -> int:
        self.drafted.append(confidence)
        return min(3, cap)


@pytest.fixture
def context_passes(monkeypatch) -> list[int]:
    """The rows of every pass that computes drafter context keys/values (`write_context`), in order."""
    from hf_dflash.modeling.dflash_proposer import DFlashProposer

    passes = []
    write_context = DFlashProposer.write_context

    def counted(self, rows, positions, slots):
        passes.append(rows.shape[1])
        write_context(self, rows, positions, slots)

    monkeypatch.setattr(DFlashProposer, "write_context", counted)
    return passes


@pytest.mark.parametrize("pool", [False, True], ids=["transformers-cache", "pool"])
def test_plain_steps_leave_their_rows_waiting_and_the_next_drafts_are_the_same(monkeypatch, context_passes, pool):
    """A plain step captures its row behind those still waiting to become drafter context (`waiting_rows`), so a run
    of plain steps is stored in one pass by the next drafted step, and its drafts do not change, wherever the target's
    keys/values live. The reference run stores every plain step's rows at once."""
    from hf_dflash.modeling.dflash_engine import DFlashEngine

    target = tiny_target("llama")
    drafter = tiny_drafter(target, block_size=8)
    prompt = random_prompt(6, batch=2)
    plain = target.generate(prompt, max_new_tokens=40, do_sample=False)
    script = [True] + [False] * 5
    passes = context_passes
    runs = {}
    for waiting in (True, False):
        if not waiting:
            draft_at_width = DFlashEngine._draft_at_width

            def storing_at_once(self, rows, keys):
                width, confidence, probs, waits = draft_at_width(self, rows, keys)
                if waits:
                    self.store_context(rows, self.context_rows)
                return width, confidence, probs, False

            monkeypatch.setattr(DFlashEngine, "_draft_at_width", storing_at_once)
        passes.clear()
        policy = Scripted(script)
        out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter,
                              dflash_adaptive=policy, dflash_fast_path=pool)
        assert torch.equal(out, plain)
        runs[waiting] = (list(passes), policy.drafted, list(policy.widths))
    (waited, drafted, widths), (stored, drafted_stored, widths_stored) = runs[True], runs[False]
    assert widths == widths_stored and widths.count(1) >= 20  # the same steps, most of them plain
    # the prefill's pass, then one per drafted step (its waiting rows and the last verify's: 1 + 5 + ... rows)
    assert len(waited) < len(stored) // 2 and max(waited[1:]) > max(stored[1:])
    torch.testing.assert_close(torch.tensor(drafted), torch.tensor(drafted_stored), rtol=1e-5, atol=0)


def test_dflash_adaptive_true_makes_a_policy_per_call_and_false_keeps_the_full_width(monkeypatch):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target)
    prompt = random_prompt(5)
    made = []

    class Recording(VerifyPolicy):
        def start(self, batch_size: int) -> None:
            made.append(batch_size)
            super().start(batch_size)

    monkeypatch.setattr(dflash_decoding, "VerifyPolicy", Recording)
    out = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter, dflash_adaptive=True)
    assert torch.equal(out, target.generate(prompt, max_new_tokens=12, do_sample=False))
    assert made == [1]
    made.clear()
    full = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                           return_dict_in_generate=True)
    assert made == [] and torch.equal(full.sequences, out)
    with pytest.raises(ValueError, match="dflash_adaptive must be"):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter, dflash_adaptive="yes")


def test_stories260k_with_the_policy_equals_plain_greedy():
    target, tokenizer = load_stories260k()
    torch.manual_seed(0)
    config = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=8, mask_token_id=0)
    drafter = DFlashDraftModel(config).eval()
    inputs = tokenizer(["Once upon a time"], return_tensors="pt")
    plain = target.generate(**inputs, max_new_tokens=48, do_sample=False)
    policy = VerifyPolicy(explore_every=4)
    out = target.generate(**inputs, max_new_tokens=48, do_sample=False, assistant_model=drafter, dflash_adaptive=policy)
    assert torch.equal(out, plain) and len(set(policy.widths)) > 1


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
@pytest.mark.parametrize("rule", ["point_mass", "rejection"])
def test_sampling_with_the_policy_follows_the_target_distribution(rule, fast):
    """Rows cost 0.1 of a step here, so the width follows the drafter's confidence (1 to 3 of 4 rows)."""
    target = tiny_target("llama", seed=21, vocab_size=SMALL_VOCAB)
    drafter = tiny_drafter(target, block_size=4, mask_token_id=SMALL_VOCAB - 1)
    prompt = torch.tensor([[3, 7, 1, 4]])
    pair = pair_probabilities(target, prompt)
    greedy = target.generate(prompt, max_new_tokens=6, do_sample=False)
    policy = VerifyPolicy(VerifyCost(fixed=(1.0, 0.1, 0.0)), explore_every=1000)
    torch.manual_seed(0)
    settings = {**SAMPLED, "dflash_adaptive": policy}
    outs = sample_with_greedy_drafts(target, drafter, prompt, greedy, rule, fast, settings)
    assert 1 < max(policy.widths) and min(policy.widths) < 4, policy.widths  # the last call's
    assert max(max(lengths) for out in outs for lengths in out.acceptance_lengths) > 1, "no draft was ever accepted"
    samples = torch.cat([out.sequences[:, prompt.shape[1] : prompt.shape[1] + 2] for out in outs])
    assert_tuples_follow(samples, pair, greedy[0, prompt.shape[1] : prompt.shape[1] + 2].tolist())


def test_the_main_job_passes_one_policy_to_its_calls_on_a_cpu(tmp_path, monkeypatch, capsys):
    import hf_dflash.generate_cli as generate_cli
    from hf_dflash.cli import main

    target, _ = load_stories260k()
    torch.manual_seed(0)
    config = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=0)
    DFlashDraftModel(config).save_pretrained(tmp_path / "drafter")
    policies = []

    class Recording(VerifyPolicy):
        def start(self, batch_size: int) -> None:
            policies.append(self)
            super().start(batch_size)

    monkeypatch.setattr(generate_cli, "VerifyPolicy", Recording)
    argv = ["generate", "--target", "stories260k", "--drafter", str(tmp_path / "drafter"), "--max-new-tokens", "8",
            "--prompt", "Once upon a time"]
    main(argv)
    assert "[identical to plain greedy generate: True]" in capsys.readouterr().out
    assert len(policies) == 2 and policies[0] is policies[1]  # the warm-up's call and the prompt's, one cost fit
    policies.clear()
    main([*argv, "--no-adaptive"])
    assert "[identical to plain greedy generate: True]" in capsys.readouterr().out and policies == []


def test_a_narrow_width_never_timed_never_costs_nothing():
    """Timed widths 2 and 16 with a steep slope between them put a 1-row verify below zero on their line; it costs at
    least half the 2-row verify, and the policy's choices divide by it without error."""
    cost = VerifyCost()
    for _ in range(3):  # the wide width first, so that no stall cap holds its timings down
        cost.record(4, 16, 0.5, 0.005)
        cost.record(4, 2, 0.01, 0.005)
    verify, _ = cost.curve(4, 16)
    assert verify[0] == pytest.approx(0.005) and all(seconds > 0 for seconds in verify)
    policy = VerifyPolicy(cost=cost, whole_batch=True)
    policy.start(4)
    live = list(range(4))
    assert policy.should_draft(live) in (True, False)
    assert 1 <= policy.width(live, [[0.9] * 15] * 4, 16) <= 16
