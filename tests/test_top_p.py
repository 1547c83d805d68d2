"""Top-k followed by top-p as one step (`TopKTopP`): the scores transformers' two warpers give in sequence, bit for bit,
without a sort of the whole vocabulary; and StepProcessors uses it exactly where it is exact."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hf_dflash.modeling.dflash_processors import StepProcessors, TopKTopP

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, VOCAB = 16, 3000


def pair(scores: torch.Tensor, top_k: int, top_p: float, keep_k: int = 1, keep_p: int = 1) -> torch.Tensor:
    """transformers' own warpers in sequence, as generate applies them."""
    top_k_scores = TopKLogitsWarper(top_k, min_tokens_to_keep=keep_k)(None, scores.clone())
    return TopPLogitsWarper(top_p, min_tokens_to_keep=keep_p)(None, top_k_scores)


def stable_pair(scores: torch.Tensor, top_k: int, top_p: float, keep_k: int = 1, keep_p: int = 1):
    """The pair with top-p's sort made stable (its code otherwise as in transformers), so exact ties have one order:
    the lower token index first. Returns the scores and whether each row's result depends on the order of ties (a
    group of equal scores that top-p's cut splits)."""
    scores = TopKLogitsWarper(top_k, min_tokens_to_keep=keep_k)(None, scores.clone())
    ascending, order = torch.sort(scores, descending=False, stable=True)
    cut = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
    cut[..., -keep_p:] = False
    split = (ascending[:, 1:] == ascending[:, :-1]) & (cut[:, 1:] != cut[:, :-1]) & (ascending[:, 1:] > -float("inf"))
    split_ties = split.any(-1)
    return scores.masked_fill(cut.scatter(1, order, cut), -float("inf")), split_ties


def merged(scores: torch.Tensor, top_k: int, top_p: float, keep_k: int = 1, keep_p: int = 1) -> torch.Tensor:
    # As StepProcessors builds it from the pair: TopKLogitsWarper folds its min_tokens_to_keep into top_k.
    return TopKTopP(TopKLogitsWarper(top_k, min_tokens_to_keep=keep_k).top_k, top_p, keep_p)(None, scores.clone())


def random_rows(seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def huge_tie_rows(seed: int) -> torch.Tensor:
    """Rows whose k-th largest value is shared by hundreds of tokens: a few tokens above it, most of the rest on it."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.full((ROWS, VOCAB), 1.0)
    rows[torch.rand(ROWS, VOCAB, generator=generator) < 0.7] = -2.0
    above = torch.randint(0, VOCAB, (ROWS, 8), generator=generator)
    rows.scatter_(1, above, 2.0 + torch.randint(0, 3, (ROWS, 8), generator=generator).float())  # ties above, too
    return rows


def rows_with_minus_inf(seed: int) -> torch.Tensor:
    """Rows with -inf entries (an earlier processor's filter): some with fewer finite scores than k."""
    rows = random_rows(seed)
    finite = torch.randint(1, 60, (ROWS, 1), generator=torch.Generator().manual_seed(seed + 1))
    ranks = torch.rand(ROWS, VOCAB, generator=torch.Generator().manual_seed(seed + 2)).argsort(-1).argsort(-1)
    return rows.masked_fill(ranks >= finite, -float("inf"))


# name -> (rows, top_k, top_p, top-k's min_tokens_to_keep, top-p's min_tokens_to_keep)
CASES = {
    "float32_llama_defaults": (random_rows(0), 50, 0.9, 1, 1),
    "float32_qwen3_defaults": (random_rows(1), 20, 0.95, 1, 1),
    "float32_flat_rows": (random_rows(2, scale=0.05), 50, 0.9, 1, 1),
    "bf16_rounded_llama": (random_rows(3).bfloat16().float(), 50, 0.9, 1, 1),
    "bf16_rounded_qwen3": (random_rows(4).bfloat16().float(), 20, 0.95, 1, 1),
    "bf16_rounded_small_k": (random_rows(5).bfloat16().float(), 3, 0.5, 1, 1),
    "coarse_rounding": (random_rows(6).round(), 40, 0.7, 1, 1),
    "huge_tie_groups": (huge_tie_rows(7), 20, 0.9, 1, 1),
    "huge_tie_groups_cut_inside": (huge_tie_rows(8), 20, 0.3, 1, 1),
    "k_above_finite_count": (rows_with_minus_inf(9), 50, 0.9, 1, 1),
    "k_above_vocab": (random_rows(10), VOCAB + 7, 0.9, 1, 1),
    "top_p_zero": (random_rows(11), 50, 0.0, 1, 1),
    "top_p_near_zero": (random_rows(12), 50, 1e-6, 1, 1),
    "top_p_near_one": (random_rows(13), 50, 1 - 1e-7, 1, 1),
    "top_p_one": (random_rows(14, scale=400.0), 50, 1.0, 1, 1),  # so spread that some probabilities underflow to 0
    "min_tokens_to_keep": (random_rows(15), 5, 0.2, 8, 3),
    "top_p_keeps_more_than_top_k": (random_rows(16), 4, 0.1, 1, 10),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_merged_step_equals_the_pair_bit_for_bit(name):
    rows, top_k, top_p, keep_k, keep_p = CASES[name]
    got = merged(rows, top_k, top_p, keep_k, keep_p)
    stable, split_ties = stable_pair(rows, top_k, top_p, keep_k, keep_p)
    assert torch.equal(got, stable)
    # Where no group of equal scores straddles top-p's cut, the order of ties changes nothing: transformers' own pair.
    theirs = pair(rows, top_k, top_p, keep_k, keep_p)
    assert torch.equal(got[~split_ties], theirs[~split_ties])
    if name.startswith("float32"):
        assert not split_ties.any() and torch.equal(got, theirs)
    kept = got > -float("inf")
    assert kept.any(-1).all() and not kept.all(-1).any()  # the test has teeth: each row keeps some and cuts some


def test_the_cases_reach_the_ties_they_are_named_for():
    """Tie groups larger than k, groups that top-p's cut splits (where the tie rule decides), rows with fewer finite
    scores than k, and top-p 1 cutting tokens whose probability underflows to 0, all occur."""
    rows, top_k, top_p, keep_k, keep_p = CASES["huge_tie_groups_cut_inside"]
    kth = rows.topk(top_k).values[:, -1:]
    assert ((rows >= kth).sum(-1) > 10 * top_k).all()
    rows, top_k = CASES["k_above_finite_count"][:2]
    assert (rows.isfinite().sum(-1) < top_k).any()
    rows, top_k, top_p = CASES["top_p_one"][:3]
    assert ((merged(rows, top_k, top_p) > -float("inf")).sum(-1) < top_k).any()
    for name in ("huge_tie_groups_cut_inside", "bf16_rounded_qwen3", "coarse_rounding"):
        rows, top_k, top_p, keep_k, keep_p = CASES[name]
        assert stable_pair(rows, top_k, top_p, keep_k, keep_p)[1].any(), name


def test_tied_tokens_are_cut_lowest_index_first():
    """Four tokens tied at the top and top-p keeping half of them: the two of higher index stay."""
    rows = torch.tensor([[0.0, 5.0, 5.0, 0.0, 5.0, 5.0, 0.0]])
    got = merged(rows, top_k=4, top_p=0.5)
    assert (got > -float("inf")).nonzero()[:, 1].tolist() == [4, 5]


def test_the_merged_step_records_without_a_host_sync():
    """No .item(), no shape that depends on the data: dynamo traces it as one graph (what a CUDA graph needs)."""
    step = TopKTopP(50, 0.9, 1)
    traced = torch.compile(step.__call__, fullgraph=True, backend="eager", dynamic=False)
    rows = random_rows(20).bfloat16().float()
    assert torch.equal(traced(None, rows.clone()), stable_pair(rows, 50, 0.9)[0])


def test_step_processors_merge_top_k_then_top_p_only():
    temperature, top_k, top_p = TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.95)
    merged_steps = StepProcessors([temperature, top_k, top_p])
    assert [type(step) for step in merged_steps.merged_steps] == [TemperatureLogitsWarper, TopKTopP]
    assert merged_steps.processors == [temperature, top_k, top_p]  # what the signature and first token read
    assert [type(step) for step in StepProcessors([top_p, top_k]).merged_steps] == [TopPLogitsWarper, TopKLogitsWarper]
    finite_filter = TopKLogitsWarper(20, filter_value=-1e4)
    assert [type(s) for s in StepProcessors([finite_filter, top_p]).merged_steps] == [TopKLogitsWarper, TopPLogitsWarper]
    assert merged_steps.signature != StepProcessors([temperature, top_p, top_k]).signature
    # The verify rows come out as the pair gives them.
    logits = random_rows(21).bfloat16().float().view(2, ROWS // 2, VOCAB)
    got = merged_steps(logits, torch.tensor([5, 7]), None, torch.zeros(2, ROWS // 2 - 1, dtype=torch.long))
    expected = stable_pair(temperature(None, logits.reshape(ROWS, VOCAB).clone()), 20, 0.95)[0]
    assert torch.equal(got.reshape(ROWS, VOCAB), expected)


def test_the_pair_runs_where_the_merged_step_does_not_pay(monkeypatch):
    """Below the GPU's line the verify rows go through transformers' own pair, not TopKTopP; the scores are the
    same (on a GPU the pair's sort orders ties stably, which these float32 rows, without ties, do not test)."""
    import hf_dflash.modeling.dflash_processors as processors

    assert processors.merged_pays(torch.zeros(16, 3))  # a CPU: always merged
    assert processors.MERGED_TOP_K_TOP_P_FROM_CUDA > 16 * 151_936  # Qwen3-8B's batch-1 rows: the pair was faster
    assert processors.MERGED_TOP_K_TOP_P_FROM_CUDA <= 256 * 49_152  # SmolLM2's batch-16 rows: the merged step was
    step = StepProcessors([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.95)])
    logits = random_rows(22).view(2, ROWS // 2, VOCAB)
    args = (torch.tensor([5, 7]), None, torch.zeros(2, ROWS // 2 - 1, dtype=torch.long))
    merged_scores = step(logits, *args)
    monkeypatch.setattr(processors, "merged_pays", lambda scores: False)
    monkeypatch.setattr(TopKTopP, "__call__", lambda *a: pytest.fail("the merged step ran below the line"))
    assert torch.equal(step(logits, *args), merged_scores)
