"""Batched DFlash decoding: left-padded prompts of different lengths, ragged acceptance, per-sequence stops."""

from __future__ import annotations

import pytest
import torch

from transformers import DynamicCache

from hf_dflash.modeling.dflash_compat import cache_argument
from hf_dflash.modeling.dflash_engine import DFlashEngine
from hf_dflash.modeling.dflash_fast_path import engine_for, release_fast_path
from hf_dflash.modeling.dflash_paged_cache import page_slots
from hf_dflash.modeling.dflash_processors import StepProcessors
from hf_dflash.modeling.dflash_target_cache import TransformersTargetCache
from tests.conftest import VOCAB, random_prompt, tiny_drafter, tiny_target
from tests.test_fast_path import oracle_drafts

PAD = 0


def left_pad(prompts: list[torch.LongTensor]) -> dict[str, torch.Tensor]:
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), PAD)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1] :] = p[0]
        mask[i, width - p.shape[1] :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def strip(row: torch.LongTensor, prompt_width: int, prompt: torch.LongTensor, eos: int | None) -> list[int]:
    """A batched output row as the unpadded sequence: its prompt, then new tokens up to eos (padding dropped)."""
    new = row[prompt_width:].tolist()
    if eos is not None and eos in new:
        new = new[: new.index(eos) + 1]
    return prompt[0].tolist() + new


@pytest.mark.parametrize("family, wrong_every", [("llama", 3), ("qwen3", 2), ("qwen3", 1000)])
def test_batch_equals_each_sequence_alone(family, wrong_every):
    target = tiny_target(family, seed=11)
    drafter = tiny_drafter(target, block_size=5)
    prompts = [random_prompt(n, seed=n) for n in (3, 9, 1, 6)]
    alone = [target.generate(p, max_new_tokens=24, do_sample=False) for p in prompts]
    batch = left_pad(prompts)
    plain = target.generate(**batch, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    with oracle_drafts(plain, wrong_every):
        out = target.generate(
            **batch, max_new_tokens=24, do_sample=False, pad_token_id=PAD, assistant_model=drafter,
            return_dict_in_generate=True,
        )
    width = batch["input_ids"].shape[1]
    for row, prompt, single in zip(out.sequences, prompts, alone):
        assert strip(row, width, prompt, None) == single[0].tolist()
    assert torch.equal(out.sequences, plain)
    if wrong_every == 3:  # the oracle's mistakes sit at different places in each row: acceptance is ragged
        assert len({tuple(lengths) for lengths in out.acceptance_lengths}) > 1


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
def test_acceptance_lengths_count_what_each_step_commits_up_to_max_length(fast):
    """A left-padded batch whose sequences reach max_length inside a block, each at its own step: every step reports
    the tokens it committed, so that with the prefill's first token they add up to the new tokens, none past
    max_length (a step whose room ignored the padding, or was one too large, reports drafts it never committed)."""
    target = tiny_target("qwen3", seed=11)  # no eos: every sequence runs to max_length
    drafter = tiny_drafter(target, block_size=5)
    prompts = [random_prompt(n, seed=n) for n in (3, 9, 1, 6)]
    batch = left_pad(prompts)
    for new_tokens in (9, 10, 11, 12):  # the last step ends at every place of a block
        plain = target.generate(**batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD)
        oracle = oracle_drafts(plain, 7, VOCAB)
        with oracle:
            out = target.generate(
                **batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD, assistant_model=drafter,
                dflash_fast_path=fast, return_dict_in_generate=True,
            )
        assert torch.equal(out.sequences, plain)
        assert [1 + sum(lengths) for lengths in out.acceptance_lengths] == [new_tokens] * len(prompts), new_tokens
        assert len({tuple(lengths) for lengths in out.acceptance_lengths}) > 1  # the sequences progressed unevenly
    release_fast_path(drafter)


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
def test_acceptance_lengths_stop_at_the_eos_that_ends_a_sequence(fast):
    """A sequence that meets eos inside a block commits the tokens up to it; the step's acceptance length counts those,
    not the drafts it accepted after the eos, so 1 + their sum is the sequence's new tokens here too."""
    target = tiny_target("qwen3", seed=11)
    drafter = tiny_drafter(target, block_size=5)
    batch = left_pad([random_prompt(n, seed=n) for n in (3, 9, 1, 6)])
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    prompt_len = batch["input_ids"].shape[1]
    free = target.generate(**batch, **settings)  # without the eos: the drafts below go on past it, and are accepted
    for position in range(2, 7):  # sequence 0 ends on its (position + 1)-th new token: at each place of a block
        eos = int(free[0, prompt_len + position])
        plain = target.generate(**batch, eos_token_id=eos, **settings)
        with oracle_drafts(free, 7, VOCAB):
            out = target.generate(
                **batch, eos_token_id=eos, assistant_model=drafter, dflash_fast_path=fast, return_dict_in_generate=True,
                **settings,
            )
        assert torch.equal(out.sequences, plain)
        new = [row.tolist() for row in plain[:, prompt_len:]]
        committed = [row.index(eos) + 1 if eos in row else len(row) for row in new]
        assert committed[0] <= position + 1 < 12
        assert [1 + sum(lengths) for lengths in out.acceptance_lengths] == committed, position
    release_fast_path(drafter)


@pytest.mark.parametrize("pool", [False, True], ids=["transformers-cache", "pool"])
def test_a_sequence_that_ends_on_the_first_step_leaves_the_others_alone(pool, monkeypatch):
    target = tiny_target("llama", seed=12)
    drafter = tiny_drafter(target, block_size=4)
    prompts = [random_prompt(n, seed=20 + n) for n in (5, 2, 7)]
    first_token = int(target.generate(prompts[1], max_new_tokens=1, do_sample=False)[0, -1])
    eos = first_token  # sequence 1 ends with its very first token
    alone = [target.generate(p, max_new_tokens=20, do_sample=False, eos_token_id=eos) for p in prompts]
    assert alone[1].shape[1] == prompts[1].shape[1] + 1
    batch = left_pad(prompts)
    plain = target.generate(**batch, max_new_tokens=20, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    live_batch_sizes = []
    original = DFlashEngine.propose

    def recording(self, rows, *args):
        live_batch_sizes.append(rows.anchor_ids.shape[0])
        return original(self, rows, *args)

    monkeypatch.setattr(DFlashEngine, "propose", recording)
    with oracle_drafts(plain, wrong_every=4):
        out = target.generate(
            **batch, max_new_tokens=20, do_sample=False, pad_token_id=PAD, eos_token_id=eos,
            assistant_model=drafter, dflash_fast_path=pool,
        )
    release_fast_path(drafter)
    width = batch["input_ids"].shape[1]
    for row, prompt, single in zip(out, prompts, alone):
        assert strip(row, width, prompt, eos) == single[0].tolist()
    assert torch.equal(out, plain)  # finished rows are padded exactly as plain generate pads them
    assert live_batch_sizes[0] == 2, "the finished sequence still cost drafter work"


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
def test_repetition_penalty_follows_each_sequence_after_another_leaves_the_batch(fast):
    """Under a repetition penalty, the first sequence of a batch ends early: the others, now at other batch rows, are
    still penalized for their own tokens, as plain generate penalizes them."""
    target = tiny_target("llama", seed=12)
    drafter = tiny_drafter(target, block_size=4)
    prompts = [random_prompt(n, seed=20 + n) for n in (5, 2, 7)]
    batch = left_pad(prompts)
    width = batch["input_ids"].shape[1]
    settings = dict(max_new_tokens=24, do_sample=False, pad_token_id=PAD, repetition_penalty=1.3)
    free_run = target.generate(**batch, **settings, eos_token_id=None)
    eos = int(free_run[0, width + 2])  # the first sequence's third new token
    others = free_run[1:, width : width + 12]
    assert not (others == eos).any(), "the other sequences should run on well after the first ends"
    plain = target.generate(**batch, **settings, eos_token_id=eos)
    with oracle_drafts(plain, 3, VOCAB):
        out = target.generate(**batch, **settings, eos_token_id=eos, assistant_model=drafter, dflash_fast_path=fast)
    release_fast_path(drafter)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("pool", [False, True], ids=["transformers-cache", "pool"])
def test_padding_never_reaches_the_drafter_context(pool):
    """After a left-padded batch is admitted, the short row's drafter pages hold the keys/values of its unpadded
    prompt's own hidden states at positions 0 and 1, whether the target's keys/values went to the engine's pool (the
    prompts prefilled without padding) or to transformers' cache (the padded batch, as plain generate reads it)."""
    target = tiny_target("qwen3", seed=13)
    drafter = tiny_drafter(target)
    prompts = [random_prompt(2, seed=1), random_prompt(8, seed=2)]
    batch = left_pad(prompts)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    engine = engine_for(target, drafter, 2, 32, onednn_linears=False, transformers_cache=not pool)
    call_cache = None if pool else TransformersTargetCache(
        target, DynamicCache(config=target.config), mask, cache_argument(target)
    )
    try:
        engine.admit_call(ids, mask, 32, StepProcessors([]), call_cache)
        assert [sequence.position for sequence in engine.sequences] == [2, 8]
        slots = page_slots(engine.drafter_tables[:1], torch.arange(2)[None])
        stored = [engine.drafter_pool.read(layer, slots) for layer in range(drafter.config.num_hidden_layers)]
    finally:
        engine.retire_all()
        release_fast_path(drafter)
    with torch.no_grad():  # the pages hold the keys/values of the unpadded prompt's own hidden states, at 0 and 1
        hidden = target(prompts[0], output_hidden_states=True).hidden_states
        rows = torch.cat([hidden[i + 1] for i in drafter.config.target_layer_ids], dim=-1)
        expected = drafter.context_key_values(rows, torch.arange(2)[None])
    for (key, value), (stored_key, stored_value) in zip(expected, stored):
        torch.testing.assert_close(stored_key, key, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(stored_value, value, rtol=1e-4, atol=1e-4)


def test_num_return_sequences_expands_the_batch():
    target = tiny_target("llama", seed=14)
    drafter = tiny_drafter(target)
    prompt = random_prompt(5, seed=14)
    torch.manual_seed(0)
    sampled = target.generate(
        prompt, max_new_tokens=12, do_sample=True, num_return_sequences=4, assistant_model=drafter, top_k=0
    )
    assert sampled.shape == (4, 17) and len({tuple(r.tolist()) for r in sampled}) > 1
    assert int(sampled.max()) < VOCAB
