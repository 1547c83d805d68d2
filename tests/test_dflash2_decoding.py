"""A DFlash2 drafter through `target.generate(assistant_model=...)`: its `propose` (the candidate selector's path) makes
every draft, in the eager loop and on the fast path alike; greedy output equals plain greedy for every family of the
README's table, batch 1 and a ragged batch; sampling is exactly target-distributed with the selector's q as the
proposal (chi-square); a sliding layer's block rows see each other both ways, in both loops."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hf_dflash import DFlashCandidateGenerator, DFlashConfig
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from hf_dflash.modeling.dflash_paged_cache import PagedCacheView
from hf_dflash.modeling.modeling_dflash2 import DFlash2DraftModel
from tests.test_batched import PAD, left_pad
from tests.test_dflash2 import randomized
from tests.test_families import FAMILIES, FAST_ATTENTION, family_target
from tests.test_sampling import (
    SAMPLED,
    SAMPLES,
    SMALL_VOCAB,
    assert_tuples_follow,
    chi_square_p_value,
    pair_probabilities,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def dflash2_drafter(target: torch.nn.Module, seed: int = 1, block_size: int = 5, top_k: int = 4, **fields):
    """A DFlash2 drafter for `target` with every weight random (the selector and the convolutions active), the mask
    token the last row of the target's embedding."""
    vocab = target.config.get_text_config().vocab_size
    config = DFlashConfig.for_target(
        target.config, num_hidden_layers=2, block_size=block_size, mask_token_id=vocab - 1, conv_kernel_size=2,
        conv_group_size=16, selector_rank=8, selector_top_k=top_k, output_multiplier=0.8, final_logit_softcapping=6.0,
        input_embedding_scale=1.2, **fields,
    )
    return randomized(DFlash2DraftModel(config), seed)


def prompt_of(length: int, vocab: int, seed: int) -> torch.LongTensor:
    return torch.randint(0, vocab - 1, (1, length), generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def spied_proposals():
    """Every call of DFlash2DraftModel.propose, as (rule, drafts, the per-row argmax of the same logits)."""
    calls = []
    original = DFlash2DraftModel.propose

    def propose(self, hidden, anchor_ids, head, rule):
        proposal = original(self, hidden, anchor_ids, head, rule)
        calls.append((rule, proposal.drafts.clone(), head(hidden).argmax(-1)))
        return proposal

    DFlash2DraftModel.propose = propose
    try:
        yield calls
    finally:
        DFlash2DraftModel.propose = original


def decode(target, drafter, batch, fast: bool, **kwargs):
    with spied_proposals() as calls:
        out = target.generate(
            **batch, pad_token_id=PAD, assistant_model=drafter, dflash_fast_path=fast, return_dict_in_generate=True,
            **kwargs,
        )
    release_fast_path(drafter)
    assert calls, "the DFlash2 drafter's propose never ran"
    return out, calls


def selector_moved_a_draft(calls) -> bool:
    """Whether some draft differs from its row's argmax: the selector, not the unary head, chose it."""
    return any(bool((drafts != argmax.to(drafts.device)).any()) for _, drafts, argmax in calls)


@pytest.mark.parametrize("fast", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_plain_greedy_in_every_family(family, fast):
    target = family_target(family, seed=2)
    if fast:
        target.set_attn_implementation(next(attention for name, attention in FAST_ATTENTION if name == family))
    drafter = dflash2_drafter(target, seed=3)
    vocab = target.config.get_text_config().vocab_size
    moved = False
    for batch in (left_pad([prompt_of(7, vocab, 1)]), left_pad([prompt_of(n, vocab, n) for n in (4, 9, 2)])):
        plain = target.generate(**batch, max_new_tokens=16, do_sample=False, pad_token_id=PAD)
        out, calls = decode(target, drafter, batch, fast, max_new_tokens=16, do_sample=False)
        assert torch.equal(out.sequences, plain)
        moved |= selector_moved_a_draft(calls)
    assert moved


@pytest.mark.parametrize("fast", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_identity_with_accepted_drafts_in_a_ragged_batch(family, fast):
    """A vocabulary of 12 tokens: the random drafter's paths are often right for a few rows, so acceptance varies
    from step to step and from sequence to sequence, and every rollback length runs."""
    target = family_target(family, seed=5, vocab_size=SMALL_VOCAB)
    drafter = dflash2_drafter(target, seed=6, block_size=4, top_k=6)
    batch = left_pad([prompt_of(n, SMALL_VOCAB, 10 + n) for n in (3, 8, 5)])
    plain = target.generate(**batch, max_new_tokens=30, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    out, calls = decode(target, drafter, batch, fast, max_new_tokens=30, do_sample=False, eos_token_id=None)
    assert torch.equal(out.sequences, plain)
    lengths = [n for row in out.acceptance_lengths for n in row]
    assert max(lengths) > 1 and min(lengths) < drafter.config.block_size
    assert len({tuple(row) for row in out.acceptance_lengths}) > 1
    assert selector_moved_a_draft(calls)


SAMPLING = {k: v for k, v in SAMPLED.items() if k not in ("pad_token_id", "return_dict_in_generate")}


@pytest.mark.parametrize("fast", [False, True], ids=["eager", "static"])
def test_sampled_pairs_follow_the_target_distribution_with_the_selectors_q(fast):
    """Rejection sampling against the selector's proposal: the first two sampled tokens follow their exact
    distribution (chi-square), drafts were accepted often, and each step's proposal rows are the selector's q."""
    target = family_target("llama", seed=21, vocab_size=SMALL_VOCAB)
    drafter = dflash2_drafter(target, seed=8, block_size=4, top_k=6)
    prompt = torch.tensor([[3, 7, 1, 4]])
    pair = pair_probabilities(target, prompt)
    greedy = target.generate(prompt, max_new_tokens=6, do_sample=False)
    calls_per_run, batch = (5, SAMPLES // 5) if fast else (1, SAMPLES)
    torch.manual_seed(3)
    outs, calls = [], []
    for _ in range(calls_per_run):
        out, run_calls = decode(target, drafter, {"input_ids": prompt.repeat(batch, 1)}, fast, max_new_tokens=3,
                                dflash_sampling="rejection", **SAMPLING)
        outs.append(out)
        calls += run_calls
    assert all(rule.rejection for rule, _, _ in calls)
    together = sum(lengths[0] > 1 for out in outs for lengths in out.acceptance_lengths)
    assert together > SAMPLES // 10, together  # the second token often came from an accepted draft
    samples = torch.cat([out.sequences[:, prompt.shape[1] : prompt.shape[1] + 2] for out in outs])
    assert_tuples_follow(samples, pair, greedy[0, prompt.shape[1] : prompt.shape[1] + 2].tolist())


def test_the_sampling_test_catches_a_q_other_than_the_one_the_drafts_came_from(monkeypatch):
    """The same check fails when the verifier is handed the unary head's softmax (DFlash's q) instead of the
    selector's q the drafts were drawn from: exactness rests on the two being the same."""
    target = family_target("llama", seed=21, vocab_size=SMALL_VOCAB)
    drafter = dflash2_drafter(target, seed=8, block_size=4, top_k=6)
    prompt = torch.tensor([[3, 7, 1, 4]])
    original = DFlash2DraftModel.propose

    def unary_q(self, hidden, anchor_ids, head, rule):
        proposal = original(self, hidden, anchor_ids, head, rule)
        proposal.probs = torch.softmax(head(hidden).float() / rule.temperature, dim=-1)
        return proposal

    monkeypatch.setattr(DFlash2DraftModel, "propose", unary_q)
    torch.manual_seed(3)
    out = target.generate(prompt.repeat(SAMPLES, 1), max_new_tokens=3, assistant_model=drafter,
                          dflash_sampling="rejection", dflash_fast_path=False, **SAMPLED)
    counts = torch.zeros(SMALL_VOCAB, SMALL_VOCAB)
    for first, second in out.sequences[:, 4:6].tolist():
        counts[first, second] += 1
    assert chi_square_p_value(counts.flatten(), pair_probabilities(target, prompt).flatten()) < 1e-3


def test_a_sliding_layers_block_rows_see_each_other_both_ways():
    """DFlash2's sliding layers (is_causal false): a block row sees the rows after it within the window, the context
    only up to the window behind it. The eager loop's view says so, and the fast path drafts what the eager loop
    drafts, step after step, with a window that cuts the context."""
    target = family_target("qwen3", seed=6)
    layout = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    drafter = dflash2_drafter(target, seed=9, block_size=4, **layout)
    generator = DFlashCandidateGenerator(drafter, target, batch_size=1, max_length=32, max_rows=8)
    state = generator.states[0]
    state.ctx_len = state.ctx_committed = 6
    window = PagedCacheView(generator.cache, generator.states, 4, 3, generator.causal_window).window_mask[0, 0]
    # block rows at positions 6..9 over keys 0..9: |query - key| < 3
    expected = (torch.arange(6, 10)[:, None] - torch.arange(10)[None, :]).abs() < 3
    assert torch.equal(window, expected) and bool(window[0, 7])
    generator.release()

    recorded: list[list[torch.Tensor]] = []
    original = DFlashCandidateGenerator.draft_rows

    def record(self, *args):
        hidden, logits = original(self, *args)
        recorded[-1].append(logits.clone())
        return hidden, logits

    batch = left_pad([prompt_of(n, 256, n) for n in (7, 3)])
    outputs = []
    DFlashCandidateGenerator.draft_rows = record
    try:
        for fast in (False, True):
            recorded.append([])
            outputs.append(target.generate(**batch, max_new_tokens=14, do_sample=False, pad_token_id=PAD,
                                           assistant_model=drafter, dflash_fast_path=fast))
            release_fast_path(drafter)
    finally:
        DFlashCandidateGenerator.draft_rows = original
    assert torch.equal(outputs[0], outputs[1])
    eager, static = recorded
    steps = [i for i, logits in enumerate(eager) if logits.shape[0] == 2]
    assert len(steps) > 3
    for i in steps:
        torch.testing.assert_close(static[i], eager[i], atol=1e-5, rtol=1e-5)
