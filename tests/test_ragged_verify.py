"""The ragged verify (modeling/dflash_step.py's `packed`, modeling/dflash_attention.py's `PackedQueries`): each
sequence of a step verifies its own number of rows, packed into one row of the target's forward.

Packed against padded: on tiny targets of the families whose layouts could break packing (sliding windows, MoE
routing, NoPE and partial-RoPE layers, scaled logits), the packed forward's logits and captured rows equal those of
the padded block row for row, and nothing is computed past a sequence's width. Where the engine cannot pack, it
says why and verifies one width. On SmolLM2 with the shipped drafter, requests under drawn per-sequence widths
equal plain greedy, and ragged steps ran. A generate call's rows (its policy not `whole_batch`) each verify their
own width too: left-padded rows equal plain greedy, and sampled rows follow the target's distribution.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationConfig

from hf_dflash.modeling import DFlashDraftModel
from hf_dflash.modeling.dflash_attention import SPAN_CALL_COST, PackedQueries, cuts
from hf_dflash.modeling.dflash_continuous import DFlashContinuousBatchingManager
from hf_dflash.modeling.dflash_engine import DFlashEngine, RowScoring
from hf_dflash.modeling.dflash_fast_path import engine_for, release_fast_path
from hf_dflash.modeling.dflash_policy import VerifyCost, VerifyPolicy
from hf_dflash.modeling.dflash_row_sampling import SamplingSettings
from tests.conftest import random_prompt, tiny_drafter, tiny_target
from tests.test_continuous_batching import pair, plain_greedy, run_schedule
from tests.test_engine_policy import oracle
from tests.test_sampling import (
    SAMPLED, SMALL_VOCAB, assert_tuples_follow, pair_probabilities, sample_with_greedy_drafts,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PACKED_FAMILIES = ["llama", "qwen3", "qwen3_moe", "mistral", "gemma3_text", "cohere2", "exaone4", "smollm3", "glm4",
                   "granite"]


def test_packing_places_each_sequences_rows_and_unpacking_pads_with_zeros():
    layout = PackedQueries.of([2, 4, 1], torch.device("cpu"))
    padded = torch.arange(12).view(3, 4)
    assert layout.pack(padded).tolist() == [[0, 1, 4, 5, 6, 7, 8]]
    assert layout.unpack(layout.pack(padded)).tolist() == [[0, 1, 0, 0], [4, 5, 6, 7], [8, 0, 0, 0]]
    assert layout.width == 4 and layout.widths.tolist() == [2, 4, 1]


@pytest.mark.parametrize("spans", [1, 3], ids=["one-span", "cut-at-every-width"])
@pytest.mark.parametrize("family", PACKED_FAMILIES)
@torch.no_grad()
def test_a_packed_verify_computes_what_the_padded_one_does_for_each_sequences_rows(family, spans):
    """Attention over the whole padded block, or cut into spans of columns (`cuts`, here at every width: long key
    spans), gives each sequence's rows what the padded verify does."""
    target, drafter = pair(family)
    block = drafter.config.block_size
    engine = DFlashEngine(target, drafter, max_batch_size=3, adaptive=False, onednn_linears=False)
    for key, length in enumerate((5, 17, 40)):  # three sequences, each at its own position
        engine.admit(key, random_prompt(length, seed=key)[0].tolist(), 30, SamplingSettings())
    with engine.proposer.capture:
        rows = engine._rows(3, engine._step_span(), RowScoring(sampled=False, penalized=False))
        engine.propose(rows)
        input_ids = torch.cat([rows.anchor_ids, rows.drafts], dim=1)  # (3, B)
        positions = rows.anchor_pos[:, None] + engine.block_offsets
        engine.proposer.capture.destination = rows.verify_rows[:, :block]
        padded = engine._verify_in_pool(rows, input_ids, positions)
        padded_rows = rows.verify_rows.clone()
        rows.verify_rows.fill_(7.0)  # what a row past a sequence's width keeps
        widths = [2, block, 3]
        layout = PackedQueries.of(widths, input_ids.device, key_positions=0 if spans == 1 else 10**6)
        assert [span.first for span in layout.spans] == ([0] if spans == 1 else [0, 2, 3])
        inputs = []
        handle = target.register_forward_pre_hook(lambda _, args, kwargs: inputs.append(kwargs["input_ids"].shape),
                                                  with_kwargs=True)
        try:
            engine.proposer.capture.destination = rows.verify_rows[:, :block]
            packed = engine._verify_in_pool(rows, input_ids, positions, layout)
        finally:
            handle.remove()
    assert inputs == [torch.Size([1, sum(widths)])]  # one forward of the verified rows, no padding
    for i, width in enumerate(widths):
        torch.testing.assert_close(packed[i, :width], padded[i, :width], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rows.verify_rows[i, :width], padded_rows[i, :width], rtol=1e-5, atol=1e-5)
        assert not packed[i, width:].any() and (rows.verify_rows[i, width:] == 7.0).all()


def test_attention_is_cut_where_the_padding_saved_pays_for_another_call():
    assert cuts([1] * 7 + [16], 512) == [1, 16]  # seven one-row sequences beside a full block: two calls
    assert cuts([2, 2, 2, 2, 3, 3, 3, 3], 512) == [3]  # four padded rows save less than a call costs
    assert cuts([1, 2, 4], 0) == [4] and cuts([5], 10**6) == [5]
    # over 2 x SPAN_CALL_COST positions every cut saves more than its call costs; over an eighth of it, none does
    assert cuts([1, 2, 4], 2 * SPAN_CALL_COST) == [1, 2, 4]
    assert cuts([1, 2, 4], SPAN_CALL_COST // 8) == [4]


def test_where_the_engine_cannot_pack_it_says_why_and_verifies_one_width():
    target, drafter = pair("llama")
    assert DFlashEngine(target, drafter, max_batch_size=2).ragged_verify  # a CPU's default policy packs
    static = DFlashEngine(target, drafter, max_batch_size=2, static_shapes=True, adaptive=True)
    assert not static.ragged_verify and "static shapes" in static.ragged_blocker
    uniform = DFlashEngine(target, drafter, max_batch_size=2,
                           adaptive=VerifyPolicy(whole_batch=True, per_sequence=False))
    assert uniform.ragged_blocker is None and not uniform.ragged_verify
    hybrid = DFlashEngine(*pair("qwen3_5_text"), max_batch_size=2)
    assert not hybrid.ragged_verify and "linear-attention" in hybrid.ragged_blocker
    eager = DFlashEngine(*pair("gemma2"), max_batch_size=2)  # loaded with eager attention
    assert not eager.ragged_verify and "not sdpa" in eager.ragged_blocker


class DrawnRowWidths(VerifyPolicy):
    """Drafting every step, each sequence's rows drawn (seeded) from 1 to its cap; a manager's policy
    (`whole_batch`) or a generate call's."""

    def __init__(self, seed: int, whole_batch: bool = True):
        super().__init__(VerifyCost(fixed=(1.0, 0.2, 0.1)), whole_batch=whole_batch)
        self.draw = random.Random(seed)
        self.ragged_steps = 0

    def should_draft(self, live) -> bool:
        return True

    def row_widths(self, live, confidence, caps) -> list[int]:
        return [self.draw.randint(1, cap) for cap in caps]

    def record(self, live, rows, *rest) -> None:
        self.ragged_steps += not isinstance(rows, int)
        super().record(live, rows, *rest)


def test_smollm2_requests_under_drawn_per_sequence_widths_equal_plain_greedy():
    from hf_dflash.bundled_models import load_smollm2
    from hf_dflash.generate_cli import DEFAULT_DRAFTER

    target, tokenizer = load_smollm2()
    drafter = DFlashDraftModel.from_pretrained(DEFAULT_DRAFTER, dtype=torch.float32).eval()
    texts = ("Write a Python function that returns the factorial of n.", "What is the capital of France?",
             "Give me three tips for sleeping better.")
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                       add_generation_prompt=True))["input_ids"] for text in texts]
    config = GenerationConfig(do_sample=False, max_new_tokens=24, eos_token_id=tokenizer.eos_token_id)
    manager = DFlashContinuousBatchingManager(target, drafter, config, max_batch_size=3, adaptive=DrawnRowWidths(0))
    arrivals = {0: [dict(input_ids=prompts[0], request_id="r0"), dict(input_ids=prompts[1], request_id="r1")],
                2: [dict(input_ids=prompts[2], request_id="r2")]}
    outputs, _, _ = run_schedule(manager, arrivals, {})
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"][-1].generated_tokens == plain_greedy(target, prompt, 24, tokenizer.eos_token_id)
    engine = manager.engine
    assert engine.ragged_steps > 3 and engine.accepted_drafts > 0, (engine.ragged_steps, engine.accepted_drafts)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_moe"])
@torch.no_grad()
def test_a_generate_calls_rows_each_verify_their_own_width_and_equal_plain_greedy(family):
    """A generate call's policy (not `whole_batch`) on the call's engine, its rows left-padded to one length: every
    row verifies its own drawn width, the drafts mostly right (an oracle), and the call's tokens equal plain
    greedy's."""
    target, _ = pair(family)
    drafter = tiny_drafter(target, block_size=8)
    input_ids = random_prompt(9, batch=3, seed=4)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = attention_mask[2, :2] = 0
    call = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=40, do_sample=False,
                pad_token_id=0)
    plain = target.generate(**call)
    references = {row: plain[row, input_ids.shape[1]:].tolist() for row in range(3)}
    engine = engine_for(target, drafter, 3, input_ids.shape[1] + 40)  # the engine the call will find held
    assert engine.ragged_blocker is None
    with oracle(engine, references, wrong_every=5):
        out = target.generate(**call, assistant_model=drafter, dflash_adaptive=DrawnRowWidths(0, whole_batch=False))
    assert drafter._dflash_engine[1] is engine
    assert torch.equal(out, plain)
    assert engine.ragged_steps > 3 and engine.accepted_drafts > 20, (engine.ragged_steps, engine.accepted_drafts)
    release_fast_path(drafter)


@pytest.mark.parametrize("rule", ["point_mass", "rejection"])
def test_a_generate_calls_sampled_rows_under_their_own_widths_follow_the_target_distribution(rule):
    """Rows of one call (the fast path's calls of SAMPLES / 5 rows) sampled under drawn per-row widths: each row's
    second token is judged on its own verify row, unpacked from the packed forward, and the pairs follow the
    target's exact distribution."""
    target = tiny_target("llama", seed=21, vocab_size=SMALL_VOCAB)
    drafter = tiny_drafter(target, block_size=4, mask_token_id=SMALL_VOCAB - 1)
    prompt = torch.tensor([[3, 7, 1, 4]])
    greedy = target.generate(prompt, max_new_tokens=6, do_sample=False)
    policy = DrawnRowWidths(0, whole_batch=False)
    torch.manual_seed(0)
    settings = {**SAMPLED, "dflash_adaptive": policy}
    outs = sample_with_greedy_drafts(target, drafter, prompt, greedy, rule, True, settings)
    assert policy.ragged_steps >= 5, policy.ragged_steps
    assert max(max(lengths) for out in outs for lengths in out.acceptance_lengths) > 1, "no draft was ever accepted"
    pairs = slice(prompt.shape[1], prompt.shape[1] + 2)
    samples = torch.cat([out.sequences[:, pairs] for out in outs])
    assert_tuples_follow(samples, pair_probabilities(target, prompt), greedy[0, pairs].tolist())
