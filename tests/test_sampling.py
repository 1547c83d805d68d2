"""Speculative sampling is distributed exactly as the target's own sampling (chi-square over sampled tokens), with the
target's keys/values in transformers' cache and in the engine's pool (the fast path's step, run on the CPU without a
graph)."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import (
    GenerationConfig, LogitsProcessorList, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from hf_dflash.modeling.dflash_acceptance import DecodingRule, exponential_race_sample, inverse_cdf_sample, sample
from hf_dflash.modeling import dflash_fast_path
from hf_dflash.modeling.dflash_engine import DFlashEngine
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from tests.conftest import tiny_drafter, tiny_target
from tests.test_fast_path import oracle_drafts

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL_VOCAB = 12
TEMPERATURE, TOP_K = 0.8, 4
SAMPLES = 3000


def processed_probs(logits: torch.Tensor) -> torch.Tensor:
    """The distribution generate samples from with temperature TEMPERATURE and top_k TOP_K."""
    scores = logits / TEMPERATURE
    kth = scores.topk(TOP_K).values[..., -1:]
    return torch.softmax(scores.masked_fill(scores < kth, float("-inf")), dim=-1)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square test of observed counts against expected probabilities (bins under 5 expected merged)."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    expected = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), statistic / 2))


# More settings, each with the processors generate builds for it, in its order; their expected distribution comes from
# transformers' own processors. A processor that reads the prefix (the repetition penalty) before temperature and
# top-p; top-k followed by top-p, which the step applies as one (TopKTopP).
SETTINGS = {
    "penalty_top_p": (
        dict(temperature=TEMPERATURE, top_p=0.9, repetition_penalty=1.5),
        LogitsProcessorList(
            [RepetitionPenaltyLogitsProcessor(1.5), TemperatureLogitsWarper(TEMPERATURE), TopPLogitsWarper(0.9)]
        ),
    ),
    "top_k_top_p": (
        dict(temperature=TEMPERATURE, top_k=6, top_p=0.8),
        LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(6), TopPLogitsWarper(0.8)]),
    ),
    # a processor that reads the whole prefix, called on the host for each verified row (`PROMPTS`: on a prompt where
    # it moves 14% of the second token's probability)
    "no_repeat_ngram": (
        dict(temperature=TEMPERATURE, top_k=TOP_K, no_repeat_ngram_size=2),
        LogitsProcessorList(
            [NoRepeatNGramLogitsProcessor(2), TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K)]
        ),
    ),
}
# The prompt of each setting: [3, 7, 1, 4] unless named here.
PROMPTS = {"no_repeat_ngram": [4, 6, 4, 6]}


def pair_probabilities(target: torch.nn.Module, prompt: torch.LongTensor, setting: str = "top_k") -> torch.Tensor:
    """Exact probabilities (V, V) of the first two sampled tokens, under temperature + top-k (or a named SETTING)."""

    def probs(prefix: torch.LongTensor) -> torch.Tensor:
        logits = target(prefix).logits[0, -1]
        if setting == "top_k":
            return processed_probs(logits)
        return torch.softmax(SETTINGS[setting][1](prefix, logits[None].clone())[0], dim=-1)

    with torch.no_grad():
        first = probs(prompt)
        pair = torch.zeros(SMALL_VOCAB, SMALL_VOCAB)
        for t1 in range(SMALL_VOCAB):
            if first[t1] > 0:
                pair[t1] = first[t1] * probs(torch.cat([prompt, torch.tensor([[t1]])], dim=1))
    return pair


def triple_probabilities(target: torch.nn.Module, prompt: torch.LongTensor) -> torch.Tensor:
    """Exact probabilities (V, V, V) of the first three sampled tokens under temperature + top-k. The third token is
    the first one a verify chooses after another token of the same verify (the pairs end at its first row)."""

    def probs(prefix: list[int]) -> torch.Tensor:
        return processed_probs(target(torch.tensor([prefix])).logits[0, -1])

    start = prompt[0].tolist()
    triple = torch.zeros(SMALL_VOCAB, SMALL_VOCAB, SMALL_VOCAB)
    with torch.no_grad():
        first = probs(start)
        for t1 in first.nonzero()[:, 0].tolist():
            second = probs(start + [t1])
            for t2 in second.nonzero()[:, 0].tolist():
                triple[t1, t2] = first[t1] * second[t2] * probs(start + [t1, t2])
    return triple


def assert_tuples_follow(samples: torch.LongTensor, expected: torch.Tensor, greedy: list[int]) -> None:
    """samples (N, k) follow `expected` (V, ..., V) over k-tuples of tokens; `greedy` is the greedy k-tuple."""
    counts = torch.zeros_like(expected)
    for tokens in samples.tolist():
        counts[tuple(tokens)] += 1
    assert chi_square_p_value(counts.flatten(), expected.flatten()) > 1e-3
    # The test has teeth: "accept the greedy draft whenever offered" would put far more mass on the greedy tuple.
    biased = expected.clone()
    biased[tuple(greedy)] += 0.1
    biased /= biased.sum()
    assert chi_square_p_value(counts.flatten(), biased.flatten()) < 1e-3


SAMPLED = dict(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K, return_dict_in_generate=True, pad_token_id=0)


def sample_with_greedy_drafts(target, drafter, prompt, greedy, rule: str, fast: bool, settings: dict) -> list:
    """The outputs of SAMPLES sampled sequences of 3 new tokens, with the drafter proposing the target's greedy
    continuation `greedy` (1, L). The fast path runs five calls of SAMPLES / 5 on one held step (its buffers hold every
    sequence's whole cache); over transformers' cache one call."""
    calls, batch = (5, SAMPLES // 5) if fast else (1, SAMPLES)
    drafts = greedy.repeat(batch, 1)
    with oracle_drafts(drafts, 10**6, vocab=SMALL_VOCAB):
        outs = [
            target.generate(
                prompt.repeat(batch, 1), max_new_tokens=3, assistant_model=drafter, dflash_sampling=rule,
                dflash_fast_path=fast, **settings,
            )
            for _ in range(calls)
        ]
    release_fast_path(drafter)
    return outs


@pytest.mark.parametrize("rule", ["point_mass", "rejection"])
def test_sampled_pairs_follow_the_target_distribution(rule):
    target = tiny_target("llama", seed=21, vocab_size=SMALL_VOCAB)
    drafter = tiny_drafter(target, block_size=4, mask_token_id=SMALL_VOCAB - 1)
    prompt = torch.tensor([[3, 7, 1, 4]])
    pair = pair_probabilities(target, prompt)
    # Point mass: drafts are the target's greedy continuation, accepted exactly when the sample equals it (often).
    # Rejection: drafts are sampled from the random drafter's distribution over 12 tokens, which overlaps p.
    greedy = target.generate(prompt, max_new_tokens=6, do_sample=False)
    torch.manual_seed(0)
    (out,) = sample_with_greedy_drafts(target, drafter, prompt, greedy, rule, False, SAMPLED)
    assert max(max(lengths) for lengths in out.acceptance_lengths) > 1, "no draft was ever accepted"
    samples = out.sequences[:, prompt.shape[1] : prompt.shape[1] + 2]
    assert_tuples_follow(samples, pair, greedy[0, prompt.shape[1] : prompt.shape[1] + 2].tolist())


@pytest.mark.parametrize("setting", ["top_k", *SETTINGS])
@pytest.mark.parametrize("rule", ["point_mass", "rejection"])
def test_the_static_step_samples_the_target_distribution(rule, setting):
    """The fast path's step (processors, drafts, acceptance and the random numbers all inside it) against the same
    exact pair distribution. The drafter's lm_head proposes one-hot logits of the target's greedy continuation: its
    argmax under point mass, samples of their softmax at the temperature under rejection sampling."""
    target = tiny_target("llama", seed=21, vocab_size=SMALL_VOCAB)
    drafter = tiny_drafter(target, block_size=4, mask_token_id=SMALL_VOCAB - 1)
    prompt = torch.tensor([PROMPTS.get(setting, [3, 7, 1, 4])])
    pair = pair_probabilities(target, prompt, setting)
    settings = {**SAMPLED, **({"top_k": None, **SETTINGS[setting][0]} if setting in SETTINGS else {})}
    greedy = target.generate(prompt, max_new_tokens=6, do_sample=False)
    torch.manual_seed(1)
    outs = sample_with_greedy_drafts(target, drafter, prompt, greedy, rule, True, settings)
    assert max(max(lengths) for out in outs for lengths in out.acceptance_lengths) > 1, "no draft was ever accepted"
    samples = torch.cat([out.sequences[:, prompt.shape[1] : prompt.shape[1] + 2] for out in outs])
    assert_tuples_follow(samples, pair, greedy[0, prompt.shape[1] : prompt.shape[1] + 2].tolist())


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
@pytest.mark.parametrize("rule", ["point_mass", "rejection"])
def test_a_token_after_an_accepted_draft_follows_the_target_distribution(rule, fast):
    """The first three sampled tokens against their exact distribution. The third is drawn at a verify's second row,
    after the first row's draft was accepted: it must follow the target given the token committed at the first row.
    Point mass catches an acceptance that compares the draft with anything but that committed token (the target's
    argmax, say): the pairs alone cannot, since the first row's token is the target's own sample either way."""
    target = tiny_target("llama", seed=21, vocab_size=SMALL_VOCAB)
    drafter = tiny_drafter(target, block_size=4, mask_token_id=SMALL_VOCAB - 1)
    prompt = torch.tensor([[3, 7, 1, 4]])
    triple = triple_probabilities(target, prompt)
    greedy = target.generate(prompt, max_new_tokens=6, do_sample=False)
    torch.manual_seed(2)
    outs = sample_with_greedy_drafts(target, drafter, prompt, greedy, rule, fast, SAMPLED)
    # the second and third tokens came from one verify, its first draft accepted, for many of the sequences
    together = sum(lengths[0] > 1 for out in outs for lengths in out.acceptance_lengths)
    assert together > SAMPLES // 10, together
    samples = torch.cat([out.sequences[:, prompt.shape[1] : prompt.shape[1] + 3] for out in outs])
    assert_tuples_follow(samples, triple, greedy[0, prompt.shape[1] : prompt.shape[1] + 3].tolist())


def test_a_call_whose_policy_chooses_widths_at_static_shapes_samples_the_target_distribution(monkeypatch):
    """The step in parts that a GPU records when a call's policy chooses each width (`StepPart`; here its static
    shapes run eagerly): under rejection sampling the drafts' distributions pass from the drafter's part to the
    verify's through the engine's buffer, at every width and around plain steps, and the first three sampled tokens
    still follow the target (six are drawn, so that the first verify may take the whole block)."""
    from tests.test_engine_policy import DrawnWidths

    monkeypatch.setattr(dflash_fast_path, "DFlashEngine", functools.partial(DFlashEngine, static_shapes=True))
    target = tiny_target("llama", seed=21, vocab_size=SMALL_VOCAB)
    drafter = tiny_drafter(target, block_size=4, mask_token_id=SMALL_VOCAB - 1)
    prompt = torch.tensor([[3, 7, 1, 4]])
    triple = triple_probabilities(target, prompt)
    greedy = target.generate(prompt, max_new_tokens=6, do_sample=False)
    policy = DrawnWidths(seed=5)
    torch.manual_seed(3)
    with oracle_drafts(greedy.repeat(SAMPLES // 5, 1), 10**6, vocab=SMALL_VOCAB):
        outs = [
            target.generate(prompt.repeat(SAMPLES // 5, 1), max_new_tokens=6, assistant_model=drafter,
                            dflash_sampling="rejection", dflash_adaptive=policy, **SAMPLED)
            for _ in range(5)
        ]
    engine = drafter._dflash_engine[1]
    assert engine.static_shapes and engine.draft_probs is not None and {1, 2, 4} <= set(engine.width_steps)
    release_fast_path(drafter)
    together = sum(lengths[0] > 1 for out in outs for lengths in out.acceptance_lengths)
    assert together > SAMPLES // 10, together
    samples = torch.cat([out.sequences[:, prompt.shape[1] : prompt.shape[1] + 3] for out in outs])
    assert_tuples_follow(samples, triple, greedy[0, prompt.shape[1] : prompt.shape[1] + 3].tolist())


@pytest.mark.parametrize("temperature", [0.3, 1.7])
def test_rejection_sampling_drafts_at_the_calls_temperature(temperature):
    """Drafts are sampled from the drafter's softmax at the call's temperature: any proposal keeps the output exact,
    so only this keeps a drafter's proposals as sharp (or flat) as the target's and acceptance high; a rule that
    dropped the temperature would pass every distribution test and lose speed."""
    rule = DecodingRule.for_call(GenerationConfig(do_sample=True, temperature=temperature), "rejection")
    logits = torch.randn(2, 3, SMALL_VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    torch.manual_seed(0)
    drafts, probs = rule.propose(logits)
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))
    assert drafts.shape == (2, 3) and bool((probs.gather(-1, drafts[..., None]) > 0).all())


@pytest.mark.parametrize("fast", [False, True])
def test_manual_seed_reproduces_a_sampled_run(fast):
    target = tiny_target("qwen3", seed=3)
    drafter = tiny_drafter(target, block_size=4)
    prompt = torch.tensor([[5, 9, 2, 7, 1]])
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(
            target.generate(
                prompt.repeat(4, 1), max_new_tokens=12, assistant_model=drafter, dflash_fast_path=fast,
                do_sample=True, temperature=1.5, pad_token_id=0,
            )
        )
    release_fast_path(drafter)
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


# A distribution with zeros between, before and after its tokens, one token of tiny weight, and rows that sum to 3
# (sample normalizes), as top-k/top-p filtered rows and rejection sampling's residuals are.
ROW = torch.tensor([0.0, 0.5, 0.0, 0.0, 1.2, 1e-4, 0.0, 0.7, 0.6, 0.0])


@pytest.mark.parametrize("rule", [inverse_cdf_sample, exponential_race_sample])
def test_each_sampler_draws_the_row_distribution_and_never_a_zero(rule):
    torch.manual_seed(0)
    draws = rule(ROW.expand(20000, 3, -1))  # (20000, 3): the leading dimensions are kept
    assert draws.shape == (20000, 3)
    counts = torch.bincount(draws.flatten(), minlength=ROW.numel()).float()
    assert counts[ROW == 0].sum() == 0
    assert chi_square_p_value(counts, ROW / ROW.sum()) > 1e-3
    skewed = ROW.clone()  # teeth: 5% of the mass moved from token 4 to token 1 is seen
    skewed[1], skewed[4] = skewed[1] + 0.15, skewed[4] - 0.15
    assert chi_square_p_value(counts, skewed / skewed.sum()) < 1e-3


def test_sample_takes_the_inverse_cdf_on_the_cpu():
    """The rule the CPU runs (the other is run on accelerators) draws the same tokens as the inverse CDF for a seed."""
    torch.manual_seed(5)
    chosen = sample(ROW.expand(64, -1))
    torch.manual_seed(5)
    assert torch.equal(chosen, inverse_cdf_sample(ROW.expand(64, -1)))


def test_the_cpu_running_sum_is_flat_at_zero_probability_tokens():
    """What the inverse CDF relies on: on the CPU a zero-probability token adds exactly nothing to the running sum,
    on rows of a real vocabulary's width with most tokens filtered out and the survivors' weights spread widely."""
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(64, 49152) * 6, dim=-1)
    probs[torch.rand_like(probs) < 0.9] = 0
    running = probs.cumsum(dim=-1)
    assert torch.equal(running[:, 1:][probs[:, 1:] == 0], running[:, :-1][probs[:, 1:] == 0])
    assert (running.diff(dim=-1) >= 0).all()


def test_inverse_cdf_at_the_top_of_the_line_draws_the_last_token_of_weight(monkeypatch):
    """A uniform just below 1 whose product with the total rounds up to the total still lands on a token of weight,
    not past the row nor on the zeros that end it."""
    row = torch.tensor([[0.3, 0.0, 0.1, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand_like", lambda t: torch.full_like(t, 1.0))  # beyond any real draw
    assert inverse_cdf_sample(row).tolist() == [2]
    assert inverse_cdf_sample(torch.zeros(1, 5)).tolist() == [4]  # a row with no weight: a token of the row


@pytest.mark.parametrize("fast", [False, True])
def test_a_draft_vocabulary_keeps_rejection_sampling_target_distributed(fast):
    """Drafts only from a draft vocabulary without the target's greedy pair: under rejection sampling the drafter's q
    is 0 outside it and the target's residual alone gives those tokens, on which the pair distribution puts most
    mass."""
    target = tiny_target("llama", seed=21, vocab_size=SMALL_VOCAB)
    drafter = tiny_drafter(target, block_size=4, mask_token_id=SMALL_VOCAB - 1)
    prompt = torch.tensor([[3, 7, 1, 4]])
    pair = pair_probabilities(target, prompt)
    greedy_pair = target.generate(prompt, max_new_tokens=2, do_sample=False)[0, prompt.shape[1] :].tolist()
    vocabulary = [t for t in range(SMALL_VOCAB) if t not in greedy_pair]
    drafter.set_draft_vocabulary(vocabulary)
    torch.manual_seed(2)
    out = target.generate(
        prompt.repeat(SAMPLES, 1), max_new_tokens=3, assistant_model=drafter, dflash_sampling="rejection",
        dflash_fast_path=fast, **SAMPLED,
    )
    release_fast_path(drafter)
    assert max(max(lengths) for lengths in out.acceptance_lengths) > 1, "no draft was ever accepted"
    samples = out.sequences[:, prompt.shape[1] : prompt.shape[1] + 2]
    assert_tuples_follow(samples, pair, greedy_pair)
