"""Hybrid targets (Gated DeltaNet layers between full-attention ones) whose keys/values and states stay in transformers'
cache (`dflash_fast_path=False`, or padding between real tokens): the engine's step rolls the linear layers back by
the one rule of the pool: `LinearStates.commit` over the DynamicCache's own state tensors
(modeling/dflash_target_cache.py's `LinearVerifyCache`).

The targets use weights at ten times the default scale, so that a linear state advanced over the wrong rows changes
the greedy output (tests/test_hybrid_fast_path.py); each test checks that a commit that keeps one row too few does.
"""

from __future__ import annotations

import pytest
import torch

from hf_dflash.modeling.dflash_linear_state import LinearStates
from hf_dflash.modeling.dflash_policy import VerifyCost, VerifyPolicy
from tests.conftest import random_prompt, tiny_drafter
from tests.test_batched import PAD, left_pad
from tests.test_families import family_target
from tests.test_fast_path import oracle_drafts

SCALE = dict(initializer_range=0.2)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models are bound by per-op overhead: one thread each (see conftest.one_thread)."""


def commits_seen(monkeypatch, shift: int = 0) -> list[tuple[list[int], int]]:
    """Record every `LinearStates.commit` as (rows kept per sequence, rows verified); with `shift`, each sequence
    keeps `shift` rows fewer than it accepted (at least none): a wrong rollback, to show the output depends on it."""
    seen = []
    original = LinearStates.commit

    def commit(self, taken: torch.LongTensor) -> None:
        verified = next(iter(self.pending.values())).window.shape[-1] - self.kernel_size
        seen.append((taken.tolist(), verified))
        original(self, (taken - shift).clamp(min=0))

    monkeypatch.setattr(LinearStates, "commit", commit)
    return seen


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_the_step_over_transformers_cache_commits_by_the_shared_rule(family, monkeypatch):
    """A left-padded batch of 3 with acceptance varying per sequence, one sequence ending at eos early (it leaves the
    batch): equal to plain greedy, with one `commit` per verify step taking each running sequence's kept rows."""
    target = family_target(family, seed=5, **SCALE)
    drafter = tiny_drafter(target, block_size=4)
    batch = left_pad([random_prompt(n, seed=20 + n) for n in (6, 3, 8)])
    free = target.generate(**batch, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    prompt_len = batch["input_ids"].shape[1]
    eos = int(free[1, prompt_len + 4])  # sequence 1 stops after at most 5 tokens
    plain = target.generate(**batch, max_new_tokens=24, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    assert (plain[:, prompt_len:] == eos).any(dim=1).sum() < 3, "pick a prompt where not every sequence stops"
    kwargs = dict(
        max_new_tokens=24, do_sample=False, pad_token_id=PAD, eos_token_id=eos, assistant_model=drafter,
        dflash_fast_path=False, return_dict_in_generate=True,
    )
    seen = commits_seen(monkeypatch)
    with oracle_drafts(free, wrong_every=3):
        out = target.generate(**batch, **kwargs)
    assert torch.equal(out.sequences, plain)
    steps = max(len(lengths) for lengths in out.acceptance_lengths)
    assert len(seen) == steps  # one commit per verify, for every linear layer at once
    assert seen[0][1] == 4 and all(verified <= 4 for _, verified in seen)  # fewer only where max_length is near
    assert any(len(set(taken)) > 1 for taken, _ in seen), "no step kept different counts per sequence"
    assert len(seen[-1][0]) < 3, "no sequence left the batch"
    for row, lengths in enumerate(out.acceptance_lengths):  # before a sequence ends, it keeps what it accepted
        kept = [taken[row] for taken, _ in seen[: len(lengths) - 1] if len(taken) == 3]
        assert kept == lengths[: len(kept)]

    commits_seen(monkeypatch, shift=1)  # the rule's states are what the loop decodes from
    with oracle_drafts(free, wrong_every=3):
        assert not torch.equal(target.generate(**batch, **kwargs).sequences, plain)


def test_one_row_verifies_commit_by_the_shared_rule(monkeypatch):
    """With a verify policy whose costs make drafting rarely pay, most steps verify the anchor alone (the layers'
    one-row paths: the recurrent rule and the conv's one-row update, which `LinearStates` records as a window) and
    every few steps it drafts again: a left-padded batch equals plain greedy, and one-row commits ran."""
    target = family_target("qwen3_next", seed=3, **SCALE)
    drafter = tiny_drafter(target, block_size=5)  # random: its drafts are mostly wrong
    batch = left_pad([random_prompt(n, seed=n) for n in (4, 9, 2)])
    plain = target.generate(**batch, max_new_tokens=20, do_sample=False, pad_token_id=PAD)

    def adaptive() -> dict:
        policy = VerifyPolicy(VerifyCost(fixed=(1.0, 1.0, 0.5)), explore_every=4)
        return dict(max_new_tokens=20, do_sample=False, pad_token_id=PAD, assistant_model=drafter,
                    dflash_fast_path=False, dflash_adaptive=policy)

    seen = commits_seen(monkeypatch)
    assert torch.equal(target.generate(**batch, **adaptive()), plain)
    widths = [verified for _, verified in seen]
    assert 1 in widths and max(widths) > 1, widths

    commits_seen(monkeypatch, shift=1)
    assert not torch.equal(target.generate(**batch, **adaptive()), plain)


def test_layers_whose_rule_cannot_be_recorded_are_refused_in_one_line(monkeypatch):
    """The rollback re-runs the chunked rule the layers called; a transformers whose modeling file calls it under
    another name is refused before any forward, in one line."""
    from hf_dflash.modeling import dflash_target_cache

    target = family_target("qwen3_5_text")
    monkeypatch.setattr(dflash_target_cache, "chunk_rule_reachable", lambda module: False)
    with pytest.raises(ValueError, match=r"cannot roll back the Gated DeltaNet layers \[0, 2\]") as error:
        target.generate(random_prompt(5), max_new_tokens=4, assistant_model=tiny_drafter(target))
    assert "\n" not in str(error.value)
