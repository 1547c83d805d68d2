"""Speculative sampling is distributed exactly as the target's own sampling (chi-square over sampled tokens)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_drafter, tiny_target
from tests.test_greedy_identity import oracle_drafts

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


@pytest.mark.parametrize("rule", ["point_mass", "rejection"])
def test_sampled_pairs_follow_the_target_distribution(rule):
    target = tiny_target("llama", seed=21, vocab_size=SMALL_VOCAB)
    drafter = tiny_drafter(target, block_size=4, mask_token_id=SMALL_VOCAB - 1)
    prompt = torch.tensor([[3, 7, 1, 4]])
    # Exact probabilities of the first two sampled tokens.
    with torch.no_grad():
        first = processed_probs(target(prompt).logits[0, -1])
        pair = torch.zeros(SMALL_VOCAB, SMALL_VOCAB)
        for t1 in range(SMALL_VOCAB):
            if first[t1] > 0:
                nxt = torch.cat([prompt, torch.tensor([[t1]])], dim=1)
                pair[t1] = first[t1] * processed_probs(target(nxt).logits[0, -1])
    # Point mass: drafts are the target's greedy continuation, accepted exactly when the sample equals it (often).
    # Rejection: drafts are sampled from the random drafter's distribution over 12 tokens, which overlaps p.
    greedy = target.generate(prompt, max_new_tokens=6, do_sample=False).repeat(SAMPLES, 1)
    torch.manual_seed(0)
    with oracle_drafts(greedy, wrong_every=10**6):
        out = target.generate(
            prompt.repeat(SAMPLES, 1), max_new_tokens=3, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
            assistant_model=drafter, return_dict_in_generate=True, pad_token_id=0, dflash_sampling=rule,
        )
    assert max(max(lengths) for lengths in out.acceptance_lengths) > 1, "no draft was ever accepted"
    samples = out.sequences[:, prompt.shape[1] : prompt.shape[1] + 2]
    counts = torch.zeros(SMALL_VOCAB, SMALL_VOCAB)
    for t1, t2 in samples.tolist():
        counts[t1, t2] += 1
    assert chi_square_p_value(counts.flatten(), pair.flatten()) > 1e-3
    # The test has teeth: "accept the greedy draft whenever offered" would put far more mass on the greedy pair.
    biased = pair.clone()
    g1, g2 = greedy[0, prompt.shape[1] : prompt.shape[1] + 2].tolist()
    biased[g1, g2] += 0.1
    biased /= biased.sum()
    assert chi_square_p_value(counts.flatten(), biased.flatten()) < 1e-3
