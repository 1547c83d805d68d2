"""The ragged verify (modeling/dflash_step.py's `packed`, modeling/dflash_attention.py's `PackedQueries`): each
sequence of a step verifies its own number of rows, packed into one row of the target's forward.

Packed against padded: on tiny targets of the families whose layouts could break packing (sliding windows, MoE
routing, NoPE and partial-RoPE layers, scaled logits), the packed forward's logits and captured rows equal those of
the padded block row for row, and nothing is computed past a sequence's width. Where the engine cannot pack, it
says why and verifies one width. On SmolLM2 with the shipped drafter, requests under drawn per-sequence widths
equal plain greedy, and ragged steps ran.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationConfig

from hf_dflash.modeling import DFlashDraftModel
from hf_dflash.modeling.dflash_attention import PackedQueries
from hf_dflash.modeling.dflash_continuous import DFlashContinuousBatchingManager
from hf_dflash.modeling.dflash_engine import DFlashEngine, RowScoring
from hf_dflash.modeling.dflash_policy import VerifyCost, VerifyPolicy
from hf_dflash.modeling.dflash_row_sampling import SamplingSettings
from tests.conftest import random_prompt
from tests.test_continuous_batching import pair, plain_greedy, run_schedule

pytestmark = pytest.mark.usefixtures("one_thread")

PACKED_FAMILIES = ["llama", "qwen3", "qwen3_moe", "mistral", "gemma3_text", "cohere2", "exaone4", "smollm3", "glm4",
                   "granite"]


def test_packing_places_each_sequences_rows_and_unpacking_pads_with_zeros():
    layout = PackedQueries.of([2, 4, 1], torch.device("cpu"))
    padded = torch.arange(12).view(3, 4)
    assert layout.pack(padded).tolist() == [[0, 1, 4, 5, 6, 7, 8]]
    assert layout.unpack(layout.pack(padded)).tolist() == [[0, 1, 0, 0], [4, 5, 6, 7], [8, 0, 0, 0]]
    assert layout.width == 4 and layout.widths.tolist() == [2, 4, 1]


@pytest.mark.parametrize("family", PACKED_FAMILIES)
@torch.no_grad()
def test_a_packed_verify_computes_what_the_padded_one_does_for_each_sequences_rows(family):
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
        layout = PackedQueries.of(widths, input_ids.device)
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
    """Drafting every step, each sequence's rows drawn (seeded) from 1 to its cap."""

    def __init__(self, seed: int):
        super().__init__(VerifyCost(fixed=(1.0, 0.2, 0.1)), whole_batch=True)
        self.draw = random.Random(seed)

    def should_draft(self, live) -> bool:
        return True

    def row_widths(self, live, confidence, caps) -> list[int]:
        return [self.draw.randint(1, cap) for cap in caps]


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
