"""Streamers, stopping criteria and output_scores / output_logits around the one step (dflash_host_hooks.py).

Each hook is compared with plain generate on the fast path's static step (run on the CPU without a graph, as
`dflash_fast_path=True` does there) and with the target's keys/values in transformers' cache. Drafts come from an oracle that proposes plain generate's
continuation with every few drafts wrong, so a step commits anywhere from 1 to B tokens and a stop falls inside an
accepted block.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    PreTrainedTokenizerFast,
    StopStringCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
    TextStreamer,
)
from transformers.generation.streamers import BaseStreamer

from hf_dflash.bench.soak import InterruptingStreamer, RaiseAtLength
from hf_dflash.modeling.dflash_engine import DFlashEngine
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from tests.conftest import hook_count, random_prompt, tiny_drafter, tiny_target
from tests.test_fast_path import oracle_drafts

pytestmark = pytest.mark.usefixtures("one_thread")

LOOPS = ["fast", "transformers-cache"]
# Qwen3's generation_config.json sampling defaults, plus a repetition penalty (a processor that reads the prefix).
SAMPLED = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, repetition_penalty=1.3)


def dflash(loop: str, target, drafter, prompt, reference, **kwargs):
    """generate with the drafter on the chosen loop, its drafts from the oracle over `reference`."""
    with oracle_drafts(reference, 4, target.config.vocab_size):
        return target.generate(prompt, assistant_model=drafter, dflash_fast_path=loop == "fast", **kwargs)


@pytest.fixture
def pair():
    target = tiny_target("qwen3", seed=7)
    drafter = tiny_drafter(target, seed=8, block_size=5)
    yield target, drafter
    release_fast_path(drafter)


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(("put", value.tolist()))

    def end(self):
        self.calls.append(("end",))


@pytest.mark.parametrize("loop", LOOPS)
def test_streamer_sees_the_calls_plain_generate_makes(pair, loop):
    target, drafter = pair
    prompt = random_prompt(6, seed=1)
    plain_streamer, streamer = RecordingStreamer(), RecordingStreamer()
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False, streamer=plain_streamer)
    out = dflash(loop, target, drafter, prompt, plain, max_new_tokens=24, do_sample=False, streamer=streamer)
    assert torch.equal(out, plain)
    # the prompt first, then one call per token, then end() once
    assert plain_streamer.calls[0] == ("put", prompt.tolist()) and plain_streamer.calls[-1] == ("end",)
    assert len(plain_streamer.calls) == 1 + 24 + 1
    assert streamer.calls == plain_streamer.calls


def test_a_batch_with_a_text_streamer_fails_as_in_plain_generate(pair):
    target, drafter = pair
    prompt = random_prompt(6, seed=1, batch=2)

    class Decoder:
        def decode(self, ids, **kwargs):
            return " ".join(map(str, ids))

    with pytest.raises(ValueError, match="TextStreamer only supports batch size 1"):
        target.generate(prompt, max_new_tokens=4, do_sample=False, streamer=TextStreamer(Decoder()))
    with pytest.raises(ValueError, match="TextStreamer only supports batch size 1"):
        target.generate(
            prompt, max_new_tokens=4, do_sample=False, streamer=TextStreamer(Decoder()), assistant_model=drafter,
            dflash_fast_path=True,
        )


LETTERS = "abcdefghijklmnop"


def letter_tokenizer() -> PreTrainedTokenizerFast:
    """Token i (of the tiny targets' 256) is the two letters LETTERS[i // 16] + LETTERS[i % 16]; single letters follow,
    so any text of these letters encodes. Built offline: enough for StopStringCriteria."""
    vocab = {LETTERS[i // 16] + LETTERS[i % 16]: i for i in range(256)}
    vocab.update({letter: 256 + j for j, letter in enumerate(LETTERS)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a in LETTERS for b in LETTERS]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("loop", LOOPS)
def test_stop_string_ends_where_plain_generate_ends(pair, loop):
    target, drafter = pair
    prompt = random_prompt(5, seed=2)
    free_run = target.generate(prompt, max_new_tokens=30, do_sample=False)
    tokenizer = letter_tokenizer()
    new = free_run[0, prompt.shape[1] :].tolist()
    # a stop string across a token boundary, mid-way: the last letter of new token 9, the first of token 10
    stop = tokenizer.decode([new[9]])[-1] + tokenizer.decode([new[10]])[0]
    criteria = StoppingCriteriaList([StopStringCriteria(tokenizer, [stop])])
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False, stopping_criteria=criteria)
    assert plain.shape[1] < free_run.shape[1] and tokenizer.decode(plain[0, prompt.shape[1] :]).endswith(stop)
    out = dflash(
        loop, target, drafter, prompt, free_run, max_new_tokens=30, do_sample=False, stopping_criteria=criteria
    )
    assert torch.equal(out, plain)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("max_time, new_tokens", [(1e-9, 1), (1e6, 20)])
def test_max_time_stops_where_plain_generate_stops(pair, loop, max_time, new_tokens):
    target, drafter = pair
    prompt = random_prompt(5, seed=3)
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False, max_time=max_time)
    assert plain.shape[1] == prompt.shape[1] + new_tokens  # an elapsed limit stops after the first token
    out = dflash(loop, target, drafter, prompt, plain, max_new_tokens=20, do_sample=False, max_time=max_time)
    assert torch.equal(out, plain)


class RecordingCriterion(StoppingCriteria):
    """Records what each call sees; stops a sequence once it holds `stop_token` after `prompt_length`."""

    def __init__(self, prompt_length: int, stop_token: int | None = None):
        self.prompt_length, self.stop_token, self.calls = prompt_length, stop_token, []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append((input_ids.tolist(), None if scores is None else [s.clone() for s in scores]))
        if self.stop_token is None:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return (input_ids[:, self.prompt_length :] == self.stop_token).any(dim=1)


@pytest.mark.parametrize("loop", LOOPS)
def test_several_eos_ids_and_a_custom_criterion(pair, loop):
    target, drafter = pair
    prompt = random_prompt(7, seed=4)
    free_run = target.generate(prompt, max_new_tokens=30, do_sample=False)
    new = free_run[0, prompt.shape[1] :].tolist()
    eos = [new[14], new[8]]  # the second id comes first: the list, not its first id, ends the sequence
    plain_criterion, criterion = RecordingCriterion(prompt.shape[1]), RecordingCriterion(prompt.shape[1])
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    plain = target.generate(prompt, stopping_criteria=StoppingCriteriaList([plain_criterion]), **kwargs)
    assert plain.shape[1] <= prompt.shape[1] + 9
    out = dflash(loop, target, drafter, prompt, free_run, stopping_criteria=StoppingCriteriaList([criterion]), **kwargs)
    assert torch.equal(out, plain)
    # called once per token, on input_ids ending with it, and (without output_scores) scores=None
    assert criterion.calls == plain_criterion.calls
    assert [len(ids[0]) for ids, _ in criterion.calls] == list(range(prompt.shape[1] + 1, plain.shape[1] + 1))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_criterion_sees_the_scores_plain_generate_passes(pair, loop):
    target, drafter = pair
    prompt = random_prompt(5, seed=5)
    free_run = target.generate(prompt, max_new_tokens=16, do_sample=False)
    stop_token = int(free_run[0, prompt.shape[1] + 10])
    kwargs = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_scores=True)
    plain_criterion, criterion = (RecordingCriterion(prompt.shape[1], stop_token) for _ in range(2))
    plain = target.generate(prompt, stopping_criteria=StoppingCriteriaList([plain_criterion]), **kwargs)
    out = dflash(loop, target, drafter, prompt, free_run, stopping_criteria=StoppingCriteriaList([criterion]), **kwargs)
    assert torch.equal(out.sequences, plain.sequences)
    assert len(criterion.calls) == len(plain_criterion.calls) == plain.sequences.shape[1] - prompt.shape[1]
    for (ids, scores), (plain_ids, plain_scores) in zip(criterion.calls, plain_criterion.calls):
        assert ids == plain_ids and len(scores) == len(plain_scores)  # every token's scores so far, as a tuple
        torch.testing.assert_close(scores[-1], plain_scores[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_sampled_run_stops_at_the_criterions_token(pair, loop):
    """Under sampling, criteria only read what was committed: with the same seed, a run that stops at a token is the
    free run cut right after that token's first appearance, and a criterion that never stops changes nothing."""
    target, drafter = pair
    prompt = random_prompt(6, seed=6)
    kwargs = dict(max_new_tokens=40, pad_token_id=0, **SAMPLED)

    def run(criteria=None, seed=11):
        torch.manual_seed(seed)
        extra = {} if criteria is None else {"stopping_criteria": StoppingCriteriaList(criteria)}
        return target.generate(prompt, assistant_model=drafter, dflash_fast_path=loop == "fast", **kwargs, **extra)

    free_run = run()
    never = RecordingCriterion(prompt.shape[1])
    assert torch.equal(run([never]), free_run)
    assert len(never.calls) == free_run.shape[1] - prompt.shape[1]
    new = free_run[0, prompt.shape[1] :].tolist()
    stop_token = new[len(new) // 2]
    cut = prompt.shape[1] + new.index(stop_token) + 1
    assert torch.equal(run([RecordingCriterion(prompt.shape[1], stop_token)]), free_run[:, :cut])
    # a stop string across a token boundary, cut the same way
    tokenizer = letter_tokenizer()
    stop = tokenizer.decode([new[10]])[-1] + tokenizer.decode([new[11]])[0]
    before = prompt[0, -1:].tolist()  # two letters span at most two tokens: only the prompt's last one can take part
    assert stop not in tokenizer.decode(before)
    first = next(j for j in range(len(new)) if stop in tokenizer.decode(before + new[: j + 1]))
    assert torch.equal(run([StopStringCriteria(tokenizer, [stop])]), free_run[:, : prompt.shape[1] + first + 1])


def plain_scores_at_each_prefix(target, sequence: torch.LongTensor, prompt_length: int, **kwargs):
    """Plain generate's processed scores and raw logits for the next token after each prefix of `sequence` (1, T)
    from the prompt on: what plain generate returns at each position for exactly these tokens."""
    scores, logits = [], []
    for end in range(prompt_length, sequence.shape[1]):
        out = target.generate(
            sequence[:, :end], max_new_tokens=1, return_dict_in_generate=True, output_scores=True, output_logits=True,
            **kwargs,
        )
        scores.append(out.scores[0])
        logits.append(out.logits[0])
    return scores, logits


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_scores_and_logits_match_plain_generate(pair, loop, sampled):
    target, drafter = pair
    prompt = random_prompt(6, seed=7)
    settings = SAMPLED if sampled else dict(do_sample=False, repetition_penalty=1.3)
    kwargs = dict(max_new_tokens=14, return_dict_in_generate=True, output_scores=True, output_logits=True, **settings)
    # Sampled, the oracle's drafts follow plain's draws only until a correction differs from plain's token; the
    # first seed (of a fixed few) under which a step still commits several tokens is the one checked.
    for seed in range(3, 13 if sampled else 4):
        torch.manual_seed(seed)
        plain = target.generate(prompt, **kwargs)
        torch.manual_seed(seed)
        out = dflash(loop, target, drafter, prompt, plain.sequences, **kwargs)
        if max(out.acceptance_lengths[0]) > 1:
            break
    if not sampled:
        assert torch.equal(out.sequences, plain.sequences)
        for mine, theirs in zip(out.scores + out.logits, plain.scores + plain.logits):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert max(out.acceptance_lengths[0]) > 1  # a step committed several tokens, each with its own row
    new_tokens = out.sequences.shape[1] - prompt.shape[1]
    assert len(out.scores) == len(out.logits) == new_tokens == 14
    assert all(s.shape == (1, target.config.vocab_size) and s.dtype == torch.float32 for s in out.scores + out.logits)
    scores, logits = plain_scores_at_each_prefix(target, out.sequences, prompt.shape[1], **settings)
    for mine, theirs in zip(out.scores, scores):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(out.logits, logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    if sampled:  # the warpers did cut the distribution: these are the processed scores, not the logits
        assert all(torch.isinf(s).sum() >= target.config.vocab_size - 20 for s in out.scores)


def test_the_scores_buffers_exist_only_for_a_call_that_returns_them(pair):
    target, drafter = pair
    prompt = random_prompt(5, seed=8)
    vocab, block = target.config.vocab_size, drafter.config.block_size
    plain = target.generate(prompt, max_new_tokens=8, do_sample=False)
    fast = dict(assistant_model=drafter, dflash_fast_path=True, max_new_tokens=8, do_sample=False)
    out = target.generate(prompt, return_dict_in_generate=True, output_scores=True, **fast)
    step = drafter._dflash_engine[1]
    assert torch.equal(out.sequences, plain) and out.logits is None
    assert step.scores.shape == (1, block, vocab) and step.logits is None
    assert torch.equal(target.generate(prompt, **fast), plain)
    assert drafter._dflash_engine[1] is step and step.scores is None and step.logits is None


def test_every_hook_at_once_takes_the_fast_path(pair, monkeypatch):
    target, drafter = pair
    prompt = random_prompt(6, seed=9)
    steps = []
    run_step = DFlashEngine.run_step
    monkeypatch.setattr(DFlashEngine, "run_step", lambda self: steps.append(1) or run_step(self))
    kwargs = dict(
        max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True
    )
    plain_streamer, streamer = RecordingStreamer(), RecordingStreamer()
    criteria = [RecordingCriterion(prompt.shape[1]), RecordingCriterion(prompt.shape[1])]
    plain = target.generate(
        prompt, streamer=plain_streamer, stopping_criteria=StoppingCriteriaList([criteria[0]]), **kwargs
    )
    out = target.generate(
        prompt, streamer=streamer, stopping_criteria=StoppingCriteriaList([criteria[1]]), assistant_model=drafter,
        dflash_fast_path=True, **kwargs,
    )
    assert steps, "the call did not run the static step"
    assert torch.equal(out.sequences, plain.sequences) and streamer.calls == plain_streamer.calls
    assert [ids for ids, _ in criteria[1].calls] == [ids for ids, _ in criteria[0].calls]


@pytest.mark.parametrize("fault", ["stopping criterion raises", "ctrl-c in streamer.put"])
def test_a_hook_that_raises_leaves_the_fast_path_usable(pair, fault):
    """A hook runs between two steps of the held static step: when it raises, the target keeps no capture hook and
    the next fast-path call (which reuses the same step) is right."""
    target, drafter = pair
    hooks_before = hook_count(target)
    if fault == "stopping criterion raises":
        kwargs, error = {"stopping_criteria": StoppingCriteriaList([RaiseAtLength(14)])}, ValueError
    else:
        kwargs, error = {"streamer": InterruptingStreamer(calls=5)}, KeyboardInterrupt
    prompt = random_prompt(6, seed=10)
    with pytest.raises(error):
        target.generate(
            prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter, dflash_fast_path=True, **kwargs
        )
    step = drafter._dflash_engine[1]
    assert hook_count(target) == hooks_before
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    again = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter, dflash_fast_path=True)
    assert drafter._dflash_engine[1] is step and torch.equal(again, plain)
