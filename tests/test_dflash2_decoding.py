"""A DFlash2 drafter through `target.generate(assistant_model=...)`: its `propose` (the candidate selector's path) makes
every draft, wherever the target keeps its keys/values (transformers' cache or the engine's pool); greedy output equals
plain greedy for every family of the README's table, batch 1 and a ragged batch; sampling is exactly
target-distributed with the selector's q as the proposal (chi-square); a sliding layer's block rows see each other
both ways, in both homes."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hf_dflash import DFlashConfig
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from hf_dflash.modeling.dflash_proposer import DFlashProposer
from hf_dflash.modeling.modeling_dflash2 import DFlash2DraftModel
from tests.test_batched import PAD, left_pad
from tests.test_dflash2 import randomized
from tests.test_families import FAMILIES, FAST_ATTENTION, family_target
from tests.test_runtime_state import committed_rows, record_proposals
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


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
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


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
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


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
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


@torch.no_grad()
def test_a_sliding_layers_block_rows_see_each_other_both_ways(monkeypatch):
    """DFlash2's sliding layers (is_causal false): a block row sees the rows after it within the window, the context
    only up to the window behind it. The engine's step builds that mask for every row, and its drafts, step after step
    with a window that cuts the context, equal the drafter run from scratch under the reference's symmetric window,
    wherever the target keeps its keys/values; with a causal window they would not."""
    target = family_target("qwen3", seed=6)
    window, block = 3, 4
    drafter = dflash2_drafter(target, seed=9, block_size=block, layer_types=["sliding_attention", "full_attention"],
                              sliding_window=window)
    masks = []  # (positions (n, B), what each block row sees under the sliding layer (n, B, S)) per drafter pass
    original = DFlashProposer.draft_rows

    def draft_rows(self, anchor_ids, positions, attention_mask, view):
        sliding = attention_mask["sliding_attention"][:, 0]
        masks.append((positions.clone(), sliding.clone() if sliding.dtype == torch.bool else sliding == 0))
        return original(self, anchor_ids, positions, attention_mask, view)

    monkeypatch.setattr(DFlashProposer, "draft_rows", draft_rows)
    recorded = record_proposals(monkeypatch)
    batch = left_pad([prompt_of(n, 256, n) for n in (7, 3)])
    pads = (batch["attention_mask"] == 0).sum(dim=1).tolist()
    plain = target.generate(**batch, max_new_tokens=14, do_sample=False, pad_token_id=PAD)
    for fast in (False, True):
        out = target.generate(**batch, max_new_tokens=14, do_sample=False, pad_token_id=PAD, assistant_model=drafter,
                              dflash_fast_path=fast)
        release_fast_path(drafter)
        assert torch.equal(out, plain)
    assert len(masks) == len(recorded) > 6
    for positions, seen in masks:
        keys = torch.arange(seen.shape[-1])
        expected = ((positions[:, :, None] - keys).abs() < window) & (keys < positions[:, :1] + block)[:, None]
        assert torch.equal(seen, expected)
        after = seen[torch.arange(len(positions)), 0, positions[:, 0] + 1]
        assert bool(after.all())  # the anchor's row sees the block row after it
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    cut = 0  # proposals whose context reaches past the window
    for row, context in committed_rows(recorded, plain, pads, target, drafter):
        positions = torch.arange(row.anchor_pos + block)
        logits = {}
        for causal in (False, True):
            behind = positions[row.anchor_pos :, None] - positions[None, :]  # (B, c + B)
            sliding = (behind.abs() < window) & (behind >= 0 if causal else True)
            hidden = drafter(
                noise_embeds=embed(torch.tensor([[row.anchor_id] + [drafter.config.mask_token_id] * (block - 1)])),
                context_hidden_states=context[None], position_ids=positions[None],
                attention_mask={"full_attention": None, "sliding_attention": sliding[None, None]},
            ).last_hidden_state
            logits[causal] = lm_head(hidden[0, 1:])
        torch.testing.assert_close(row.logits, logits[False], atol=1e-4, rtol=1e-4)
        cut += row.anchor_pos > window
        assert not torch.allclose(logits[True], logits[False], atol=1e-3)
    assert cut > 4
