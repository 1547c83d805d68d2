"""Every logits processor generate can build, on the DFlash path: served exactly (on the device or on the host) or
refused before any forward.

For each generate option: the processed scores of every verify row equal what plain generate's own processors give
on the same prefix (row j: the prefix followed by drafts[:j]); greedy output equals plain greedy generate, with the
target's keys/values in transformers' cache and in the engine's pool (processors that read the whole prefix called on
the host by both).
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation import SynthIDTextWatermarkingConfig, WatermarkingConfig

from hf_dflash.modeling import dflash_checks
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from hf_dflash.modeling.dflash_processors import StepProcessors
from tests.conftest import VOCAB, random_prompt, tiny_drafter, tiny_target
from tests.test_fast_path import oracle_drafts

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 2
PROMPT_LEN = 6
# generate options -> (whether the device serves them, whether they need a batch of 1)
OPTIONS = {
    "qwen3_chat_defaults": (dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95), True),
    "llama_instruct_defaults": (dict(do_sample=True, temperature=0.6, top_p=0.9), True),
    "min_p": (dict(do_sample=True, min_p=0.05), True),
    "typical_p": (dict(do_sample=True, typical_p=0.8), True),
    "epsilon": (dict(do_sample=True, epsilon_cutoff=3e-3), True),
    "eta": (dict(do_sample=True, eta_cutoff=3e-3), True),
    "top_h": (dict(do_sample=True, top_h=0.5), True),
    "repetition_penalty": (dict(repetition_penalty=1.8), True),
    "min_length": (dict(min_length=PROMPT_LEN + 3), True),
    "min_new_tokens": (dict(min_new_tokens=3), True),
    "suppress_tokens": (dict(suppress_tokens=[3, 4, 5]), True),
    "begin_suppress_tokens": (dict(begin_suppress_tokens=[3, 4]), True),
    "forced_bos": (dict(forced_bos_token_id=1), True),
    "forced_eos": (dict(forced_eos_token_id=EOS, max_new_tokens=4), True),
    "remove_invalid_values": (dict(remove_invalid_values=True), True),
    "renormalize_logits": (dict(renormalize_logits=True), True),
    "single_token_bad_words": (dict(bad_words_ids=[[5], [7]]), True),
    "single_token_sequence_bias": (dict(sequence_bias=[[[5], -3.0], [[9], 4.0]]), True),
    "bad_words": (dict(bad_words_ids=[[5], [7, 8]]), False),
    "sequence_bias": (dict(sequence_bias=[[[5], -3.0], [[7, 8], 4.0]]), False),
    "no_repeat_ngram": (dict(no_repeat_ngram_size=2), False),
    "exponential_decay": (dict(exponential_decay_length_penalty=(2, 1.5)), False),
    "watermarking": (dict(watermarking_config=WatermarkingConfig(bias=2.5)), False),
}
# Batch-bound processors (one row per sequence of the batch), served for a batch of 1 on the host.
SINGLE_SEQUENCE_OPTIONS = {
    "encoder_repetition_penalty": dict(encoder_repetition_penalty=1.5),
    "encoder_no_repeat_ngram": dict(encoder_no_repeat_ngram_size=2),
    "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=lambda batch_id, ids: list(range(0, VOCAB, 3))),
}


class BuiltProcessors(Exception):
    """Raised by the spy below once generate has built the call's processors: nothing else runs."""

    def __init__(self, processors):
        self.processors = processors


def processors_generate_builds(target, drafter, ids, mask, monkeypatch, **kwargs):
    """The LogitsProcessorList a DFlash generate call gets from generate, built fresh for each call."""

    def spy(logits_processor, batch_size):
        raise BuiltProcessors(logits_processor)

    with monkeypatch.context() as patch:
        patch.setattr(dflash_checks, "check_logits_processors", spy)
        with pytest.raises(BuiltProcessors) as built:
            target.generate(
                ids, attention_mask=mask, assistant_model=drafter, eos_token_id=EOS, pad_token_id=0,
                **{"max_new_tokens": 12, **kwargs},
            )
    return built.value.processors


def left_padded_batch(batch: int) -> tuple[torch.LongTensor, torch.Tensor]:
    ids = random_prompt(PROMPT_LEN, seed=4, batch=batch)
    ids[ids == EOS] = 11
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :2], mask[1, :2] = 0, 0
    return ids, mask


def check_rows_equal_plain_processors(monkeypatch, kwargs, batch, on_device):
    target = tiny_target("llama", seed=2)
    drafter = tiny_drafter(target)
    ids, mask = left_padded_batch(batch)
    ours = StepProcessors(processors_generate_builds(target, drafter, ids, mask, monkeypatch, **kwargs))
    theirs = processors_generate_builds(target, drafter, ids, mask, monkeypatch, **kwargs)
    assert (not ours.host_only) == on_device, ours.host_only
    generator = torch.Generator().manual_seed(0)
    # Logits with repeats in the top entries, so penalties and cut-offs change what survives.
    first = torch.randn(batch, VOCAB, generator=generator) * 3
    assert torch.equal(ours.first_token_scores(ids, first), theirs(ids, first.clone()))
    first_tokens = first.argmax(dim=-1, keepdim=True)
    prefix = torch.cat([ids, first_tokens], dim=1)  # (b, P + 1): the prompt and the prefill's token
    presence = ours.prompt_presence(ids, VOCAB)
    if presence is not None:
        presence[torch.arange(batch), first_tokens[:, 0]] = True
    rows = 5
    drafts = torch.randint(0, VOCAB - 1, (batch, rows - 1), generator=generator)
    drafts[:, 2] = prefix[:, -2]  # a draft that repeats the prefix, one that repeats an earlier draft
    drafts[:, 3] = drafts[:, 0]
    logits = torch.randn(batch, rows, VOCAB, generator=generator) * 3
    lengths = torch.full((batch,), prefix.shape[1])
    got = ours(logits, lengths, presence, drafts, [prefix[i : i + 1] for i in range(batch)])
    for j in range(rows):
        expected = theirs(torch.cat([prefix, drafts[:, :j]], dim=1), logits[:, j].clone())
        assert torch.equal(got[:, j], expected), f"row {j}"


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_verify_rows_are_processed_as_plain_generate_processes_them(name, monkeypatch):
    kwargs, on_device = OPTIONS[name]
    check_rows_equal_plain_processors(monkeypatch, kwargs, batch=2, on_device=on_device)


@pytest.mark.parametrize("name", sorted(SINGLE_SEQUENCE_OPTIONS))
def test_batch_bound_processors_are_served_for_one_sequence(name, monkeypatch):
    check_rows_equal_plain_processors(monkeypatch, SINGLE_SEQUENCE_OPTIONS[name], batch=1, on_device=False)


GREEDY = {name: kwargs for name, (kwargs, _) in OPTIONS.items() if not kwargs.get("do_sample")}


@pytest.mark.parametrize("name", sorted(GREEDY))
def test_greedy_output_with_each_processor_equals_plain_generate(name):
    kwargs = GREEDY[name]
    target = tiny_target("qwen3", seed=8)
    drafter = tiny_drafter(target, block_size=4)
    ids, mask = left_padded_batch(2)
    call = dict(attention_mask=mask, do_sample=False, eos_token_id=EOS, pad_token_id=0, **{"max_new_tokens": 16, **kwargs})
    plain = target.generate(ids, **call)
    for fast in (False, True):  # a processor left on the host is called there by either loop
        dflash = target.generate(ids, assistant_model=drafter, dflash_fast_path=fast, **call)
        assert torch.equal(dflash, plain), f"fast path {fast}"
    release_fast_path(drafter)


@pytest.mark.parametrize("name", sorted(SINGLE_SEQUENCE_OPTIONS))
def test_greedy_output_with_each_batch_bound_processor_equals_plain_generate(name):
    target = tiny_target("qwen3", seed=8)
    drafter = tiny_drafter(target, block_size=4)
    ids, mask = left_padded_batch(1)
    call = dict(do_sample=False, eos_token_id=EOS, pad_token_id=0, max_new_tokens=16, **SINGLE_SEQUENCE_OPTIONS[name])
    plain = target.generate(ids, **call)
    for fast in (False, True):
        assert torch.equal(target.generate(ids, assistant_model=drafter, dflash_fast_path=fast, **call), plain), fast
    release_fast_path(drafter)


@pytest.mark.parametrize("processor", ["no_repeat_ngram", "bad_words"])
def test_host_processors_judge_accepted_drafts_on_the_engine(processor):
    """Processors that read the whole prefix, on the engine's step, where drafts are accepted: the drafter proposes the
    processed greedy output itself (wrong at every third position), so steps commit several tokens and each verified
    row is judged with its own prefix. The processor changes plain generate's output here (the bad word is a pair of
    tokens plain greedy emits), so an engine that skipped it, or called it with another row's prefix, would part from
    the reference."""
    target = tiny_target("qwen3", seed=8)
    drafter = tiny_drafter(target, block_size=5)
    ids, mask = left_padded_batch(2)
    call = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=24)
    plain = target.generate(ids, **call)
    kwargs = dict(no_repeat_ngram_size=2) if processor == "no_repeat_ngram" else dict(
        bad_words_ids=[plain[0, PROMPT_LEN + 4 : PROMPT_LEN + 6].tolist()]
    )
    reference = target.generate(ids, **call, **kwargs)
    assert not torch.equal(reference, plain), "the processor must change the output"
    with oracle_drafts(reference, wrong_every=3, vocab=target.config.vocab_size):
        out = target.generate(
            ids, **call, **kwargs, assistant_model=drafter, dflash_fast_path=True, return_dict_in_generate=True
        )
    assert torch.equal(out.sequences, reference)
    assert max(max(lengths) for lengths in out.acceptance_lengths) > 2
    release_fast_path(drafter)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(guidance_scale=1.5), "guidance_scale .classifier-free guidance. is not supported"),
        (
            dict(watermarking_config=SynthIDTextWatermarkingConfig(ngram_len=3, keys=[3, 7, 11, 19])),
            "SynthID text watermarking is not supported",
        ),
    ],
)
def test_processors_that_keep_state_between_calls_are_refused_before_any_forward(kwargs, match):
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    forwards = []
    handle = target.register_forward_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            target.generate(random_prompt(5), max_new_tokens=4, assistant_model=drafter, **kwargs)
    finally:
        handle.remove()
    assert forwards == []


def test_a_batch_bound_processor_is_refused_for_a_batch():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="PrefixConstrainedLogitsProcessor .* batch of 1"):
        target.generate(
            random_prompt(5, batch=2), max_new_tokens=4, assistant_model=drafter,
            prefix_allowed_tokens_fn=lambda batch_id, ids: [1, 2, 3],
        )


@pytest.mark.parametrize("gate", [dict(min_new_tokens=5), dict(min_length=PROMPT_LEN + 5)])
def test_a_length_gate_decides_where_the_output_ends(gate):
    """The greedy test above passes its length gates whether or not they act (a random target seldom emits eos that
    early). Here a sequence bias makes eos win every row where it is allowed, so the gate alone decides where the
    output ends: five new tokens, then eos, which a verify row (not the prefill) emits. A gate off by one row in
    either loop ends it elsewhere."""
    target = tiny_target("qwen3", seed=8)
    drafter = tiny_drafter(target, block_size=4)
    ids, mask = left_padded_batch(2)
    call = dict(attention_mask=mask, do_sample=False, eos_token_id=EOS, pad_token_id=0, max_new_tokens=12,
                sequence_bias=[[[EOS], 50.0]], **gate)
    plain = target.generate(ids, **call)
    assert [row.index(EOS) for row in plain[:, PROMPT_LEN:].tolist()] == [5, 5]
    for fast in (False, True):
        dflash = target.generate(ids, assistant_model=drafter, dflash_fast_path=fast, **call)
        assert torch.equal(dflash, plain), f"fast path {fast}"
    release_fast_path(drafter)
