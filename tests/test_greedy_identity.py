"""Greedy DFlash output equals plain greedy generate, token for token (float32, CPU), whatever the drafter."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer

from hf_dflash import DFlashGenerateOutput
from hf_dflash.modeling.dflash_draft_vocabulary import DraftVocabularyHead
from hf_dflash.modeling.dflash_engine import DFlashEngine
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from tests.conftest import hook_count, left_padded, random_prompt, tiny_drafter, tiny_target
from tests.test_fast_path import oracle_drafts


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_drafter_is_lossless(family, seed):
    target = tiny_target(family, seed=seed)
    drafter = tiny_drafter(target, seed=seed + 10, block_size=2 + 3 * seed)
    prompt = random_prompt(3 + 5 * seed, seed=seed)
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False)
    dflash = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter)
    assert torch.equal(plain, dflash)


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
@pytest.mark.parametrize("wrong_every", [2, 3, 5, 1000])
def test_accepting_drafts_is_lossless(wrong_every, fast):
    target = tiny_target("qwen3", seed=3)
    drafter = tiny_drafter(target, block_size=6)
    prompt = random_prompt(9, seed=3)
    plain = target.generate(prompt, max_new_tokens=40, do_sample=False)
    with oracle_drafts(plain, wrong_every):
        out = target.generate(
            prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter, return_dict_in_generate=True,
            dflash_fast_path=fast,
        )
    assert torch.equal(plain, out.sequences)
    (lengths,) = out.acceptance_lengths
    assert max(lengths) > 1, "the oracle's drafts were never accepted"
    assert all(1 <= n <= 6 for n in lengths)
    # acceptance lengths count every committed token after the first (which the prefill produced)
    assert sum(lengths) >= plain.shape[1] - prompt.shape[1] - 1
    if wrong_every == 1000:  # only the last draft of the 40 can be off: nearly every block is accepted whole
        assert sum(n == 6 for n in lengths) >= len(lengths) - 2


def test_max_length_and_max_new_tokens_hold(llama_pair):
    target, drafter = llama_pair
    prompt = random_prompt(5)
    for kwargs in ({"max_new_tokens": 1}, {"max_new_tokens": 2}, {"max_new_tokens": 13}, {"max_length": 11}):
        plain = target.generate(prompt, do_sample=False, **kwargs)
        reference = target.generate(prompt, do_sample=False, max_new_tokens=40)
        with oracle_drafts(reference, wrong_every=1000):
            dflash = target.generate(prompt, do_sample=False, assistant_model=drafter, **kwargs)
        assert torch.equal(plain, dflash), kwargs


def test_eos_stops_where_plain_generate_stops():
    target = tiny_target("llama", seed=4)
    drafter = tiny_drafter(target, block_size=5)
    prompt = random_prompt(6, seed=4)
    free_run = target.generate(prompt, max_new_tokens=30, do_sample=False)
    new_tokens = free_run[0, prompt.shape[1] :].tolist()
    # a token the target emits once, mid-way: no other token of its block is eos, so a stop that looked anywhere but
    # at each committed token in turn (the block's last, say) would run past it
    at = next(i for i in range(2, len(new_tokens)) if new_tokens.count(new_tokens[i]) == 1 and i % 5)
    eos = new_tokens[at]
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert plain.shape[1] == prompt.shape[1] + at + 1
    with oracle_drafts(free_run, wrong_every=1000):  # eos arrives inside an accepted block
        dflash = target.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos, assistant_model=drafter)
    assert torch.equal(plain, dflash)


class StopAfter(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_custom_stopping_criteria(llama_pair):
    target, drafter = llama_pair
    prompt = random_prompt(4)
    criteria = StoppingCriteriaList([StopAfter(17)])
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False, stopping_criteria=criteria)
    reference = target.generate(prompt, max_new_tokens=30, do_sample=False)
    with oracle_drafts(reference, wrong_every=1000):
        dflash = target.generate(
            prompt, max_new_tokens=30, do_sample=False, stopping_criteria=criteria, assistant_model=drafter
        )
    assert plain.shape[1] == 17
    assert torch.equal(plain, dflash)


class RecordingTokenizer:
    """Just enough tokenizer for TextStreamer: decodes ids to a readable string."""

    def decode(self, ids, **kwargs):
        return "".join(f"<{int(i)}>" for i in ids)


def test_text_streamer_sees_the_same_text(llama_pair, capsys):
    target, drafter = llama_pair
    prompt = random_prompt(4)
    reference = target.generate(prompt, max_new_tokens=20, do_sample=False)
    target.generate(prompt, max_new_tokens=20, do_sample=False, streamer=TextStreamer(RecordingTokenizer()))
    plain_text = capsys.readouterr().out
    with oracle_drafts(reference, wrong_every=3):
        target.generate(
            prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter, streamer=TextStreamer(RecordingTokenizer())
        )
    assert capsys.readouterr().out == plain_text
    assert plain_text.count("<") == reference.shape[1]


def test_return_dict_matches_plain_generate(qwen3_pair):
    target, drafter = qwen3_pair
    prompt = random_prompt(5)
    kwargs = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True)
    plain = target.generate(prompt, **kwargs)
    with oracle_drafts(plain.sequences, wrong_every=4):
        dflash = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert isinstance(dflash, DFlashGenerateOutput)
    assert torch.equal(plain.sequences, dflash.sequences)
    assert len(dflash.scores) == len(plain.scores) == 12
    for mine, theirs in zip(dflash.logits, plain.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert sum(dflash.acceptance_lengths[0]) == 11  # every token after the prefill's first


def test_repetition_penalty_processor_is_applied_per_row():
    target = tiny_target("llama", seed=5)
    drafter = tiny_drafter(target, block_size=4)
    prompt = random_prompt(6, seed=5)
    kwargs = dict(max_new_tokens=25, do_sample=False, repetition_penalty=1.8)
    plain = target.generate(prompt, **kwargs)
    assert not torch.equal(plain, target.generate(prompt, max_new_tokens=25, do_sample=False))
    with oracle_drafts(plain, wrong_every=4):
        dflash = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert torch.equal(plain, dflash)


def test_hooks_are_removed_after_generate_even_on_error(llama_pair):
    target, drafter = llama_pair
    before = hook_count(target)
    target.generate(random_prompt(4), max_new_tokens=8, do_sample=False, assistant_model=drafter)
    assert hook_count(target) == before

    class Boom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if input_ids.shape[1] > 8:
                raise KeyboardInterrupt("user pressed ctrl-c")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with pytest.raises(KeyboardInterrupt):
        target.generate(
            random_prompt(4), max_new_tokens=20, do_sample=False, assistant_model=drafter,
            stopping_criteria=StoppingCriteriaList([Boom()]),
        )
    assert hook_count(target) == before
    # and the next call is still right
    plain = target.generate(random_prompt(6, seed=9), max_new_tokens=10, do_sample=False)
    again = target.generate(random_prompt(6, seed=9), max_new_tokens=10, do_sample=False, assistant_model=drafter)
    assert torch.equal(plain, again)


def test_prompt_of_one_token(llama_pair):
    target, drafter = llama_pair
    prompt = random_prompt(1)
    plain = target.generate(prompt, max_new_tokens=15, do_sample=False)
    with oracle_drafts(plain, wrong_every=3):
        assert torch.equal(plain, target.generate(prompt, max_new_tokens=15, do_sample=False, assistant_model=drafter))


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_verifying_fewer_rows_changes_nothing_but_the_cost(rows, fast):
    target = tiny_target("qwen3", seed=8)
    drafter = tiny_drafter(target, block_size=6)
    prompt = random_prompt(5, seed=8)
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    with oracle_drafts(plain, wrong_every=1000):
        out = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                              return_dict_in_generate=True, dflash_verify_rows=rows, dflash_fast_path=fast)
    assert torch.equal(plain, out.sequences)
    assert max(out.acceptance_lengths[0]) == rows


def test_verify_rows_outside_the_block_is_refused(llama_pair):
    target, drafter = llama_pair
    with pytest.raises(ValueError, match="dflash_verify_rows"):
        target.generate(random_prompt(3), max_new_tokens=4, assistant_model=drafter, dflash_verify_rows=99)


@contextlib.contextmanager
def captured_drafts():
    """Record the drafts of every step, (b, B - 1) each, as the engine's propose made them."""
    drafts = []
    original = DFlashEngine.propose

    def propose(self, rows, *args):
        proposed = original(self, rows, *args)
        drafts.append(rows.drafts.clone())
        return proposed

    DFlashEngine.propose = propose
    try:
        yield drafts
    finally:
        DFlashEngine.propose = original


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_draft_vocabulary_keeps_greedy_output_and_every_draft_inside_it(batch, fast):
    target = tiny_target("qwen3", seed=4)
    drafter = tiny_drafter(target, block_size=5)
    ids, mask = left_padded(batch, 9, [0, 3, 6][:batch], seed=4)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    # Half of the tokens greedy produces and other tokens (some drafts can be accepted, many cannot); then another.
    produced = plain[:, ids.shape[1] :].unique()
    for vocabulary in (torch.cat([produced[::2], torch.arange(100, 160)]).unique(), torch.arange(0, 256, 3)):
        drafter.set_draft_vocabulary(vocabulary)
        with captured_drafts() as drafts:
            out = target.generate(
                ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                assistant_model=drafter, dflash_fast_path=fast,
            )
        assert torch.equal(out, plain)
        assert drafts and torch.isin(torch.cat(drafts).flatten(), vocabulary).all()
        if fast:  # a new vocabulary gives a new step: the held one's head holds the old vocabulary's rows
            assert drafter._dflash_engine[1].proposer.draft_vocabulary is drafter.draft_vocabulary
    release_fast_path(drafter)


def test_a_draft_vocabulary_without_the_targets_tokens_accepts_no_draft_and_changes_no_token():
    target = tiny_target("llama", seed=5)
    drafter = tiny_drafter(target, block_size=4)
    prompt = random_prompt(6, seed=5)
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False)
    with oracle_drafts(plain, wrong_every=1000):  # the full-vocabulary baseline, with drafts that mostly land
        full = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter,
                               return_dict_in_generate=True, dflash_fast_path=False)
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[plain.unique()] = False
    drafter.set_draft_vocabulary(outside.nonzero()[:, 0])  # no token the target will pick
    out = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter,
                          return_dict_in_generate=True, dflash_fast_path=False)
    assert torch.equal(out.sequences, plain) and torch.equal(full.sequences, plain)
    assert set(out.acceptance_lengths[0]) == {1} and max(full.acceptance_lengths[0]) > 1


@pytest.mark.parametrize("bias", [False, True])
def test_the_draft_vocabulary_head_equals_the_full_head_on_its_tokens_sliced_or_masked(bias):
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(16, 40, bias=bias)
    token_ids = torch.tensor([0, 3, 4, 17, 39])
    hidden = torch.randn(2, 3, 16)
    full = lm_head(hidden)

    class WrappedHead(torch.nn.Linear):  # not a plain Linear: its rows are not copied, its logits are masked
        pass

    wrapped = WrappedHead(16, 40, bias=bias)
    wrapped.load_state_dict(lm_head.state_dict())
    for head, sliced in ((lm_head, True), (wrapped, False)):
        draft_head = DraftVocabularyHead(head, token_ids, 40, torch.device("cpu"))
        assert (draft_head.kept is not None) == sliced
        logits = draft_head(hidden)
        assert logits.shape == full.shape
        torch.testing.assert_close(logits[..., token_ids], full[..., token_ids])
        outside = torch.ones(40, dtype=torch.bool)
        outside[token_ids] = False
        assert torch.isneginf(logits[..., outside]).all()


def test_the_draft_vocabulary_head_is_copied_once_per_vocabulary_and_lm_head_weight():
    """Eager calls reuse the head's copy of the kept rows; a new vocabulary, or a changed lm_head weight, makes a new
    one, so drafts always come from the weights the target has now."""
    target = tiny_target("qwen3", seed=4)
    drafter = tiny_drafter(target, block_size=4)
    lm_head, cpu = target.get_output_embeddings(), torch.device("cpu")
    drafter.set_draft_vocabulary(torch.arange(0, 200, 2))
    first = DraftVocabularyHead.for_drafter(drafter, lm_head, cpu)
    assert DraftVocabularyHead.for_drafter(drafter, lm_head, cpu) is first
    with torch.no_grad():
        lm_head.weight.mul_(2.0)  # an in-place change of the target's weights
    second = DraftVocabularyHead.for_drafter(drafter, lm_head, cpu)
    assert second is not first and torch.equal(second.kept.weight, lm_head.weight[torch.arange(0, 200, 2)])
    drafter.set_draft_vocabulary(torch.arange(1, 200, 2))
    third = DraftVocabularyHead.for_drafter(drafter, lm_head, cpu)
    assert third is not second and torch.equal(third.token_ids, torch.arange(1, 200, 2))
    drafter.set_draft_vocabulary(None)
    assert DraftVocabularyHead.for_drafter(drafter, lm_head, cpu) is None and drafter._dflash_draft_head is None
