"""The drafter runtime's invariants: pages, proposer state, incremental context, and drafts equal to a from-scratch
drafter forward over the whole context."""

from __future__ import annotations

import pytest
import torch

from hf_dflash import PAGE_SIZE, DFlashCandidateGenerator, DflashProposerState, PagedDrafterCache
from hf_dflash.modeling.dflash_paged_cache import PagedCacheView
from tests.conftest import MASK_ID, random_prompt, tiny_drafter, tiny_target
from tests.test_greedy_identity import oracle_drafts


def new_state(capacity: int = 64, width: int = 8) -> DflashProposerState:
    return DflashProposerState(ctx_hidden_acc=torch.zeros(capacity, width))


def test_pages_are_never_shared_and_come_back():
    cache = PagedDrafterCache(num_layers=2, num_pages=6, num_key_value_heads=1, head_dim=4, dtype=torch.float32, device="cpu")
    a, b = new_state(), new_state()
    cache.reserve(a, 17)  # two pages
    cache.reserve(b, 40)  # three pages
    cache.reserve(a, 20)  # still two
    assert len(a.block_table) == 2 and len(b.block_table) == 3
    assert not set(a.block_table) & set(b.block_table)
    assert torch.equal(a.block_table_dev, torch.tensor(a.block_table))
    with pytest.raises(RuntimeError, match="exhausted"):
        cache.reserve(a, 4 * PAGE_SIZE)
    cache.release(b)
    assert b.block_table == [] and len(cache.free_pages) == 4
    cache.reserve(a, 4 * PAGE_SIZE)
    assert len(set(a.block_table)) == 4


def test_slots_map_through_the_block_table_and_keep_their_values():
    cache = PagedDrafterCache(num_layers=1, num_pages=4, num_key_value_heads=2, head_dim=3, dtype=torch.float32, device="cpu")
    a, b = new_state(), new_state()
    cache.reserve(b, 5)  # b takes page 0, so a's slots are not the identity
    cache.reserve(a, 20)
    slots = cache.slot_mapping(a, 14, 20)
    expected = [a.block_table[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(14, 20)]
    assert slots.tolist() == expected
    key, value = torch.randn(6, 2, 3), torch.randn(6, 2, 3)
    cache.write(0, slots, key, value)
    read_key, read_value = cache.read(0, slots[None])
    assert torch.equal(read_key[0].transpose(0, 1), key) and torch.equal(read_value[0].transpose(0, 1), value)


def test_a_short_sequence_pads_its_readable_slots_with_its_own_slot_0():
    """In a batch of unequal contexts the shorter one's read slots are padded (the mask hides the padding) with a
    slot of its own, not one of another sequence's pages."""
    cache = PagedDrafterCache(num_layers=1, num_pages=8, num_key_value_heads=1, head_dim=4, dtype=torch.float32, device="cpu")
    long, short = new_state(), new_state()
    cache.reserve(long, 3 * PAGE_SIZE)  # pages 0..2, so the short sequence's first page is 3
    long.ctx_committed, short.ctx_committed = 2 * PAGE_SIZE, 1
    view = PagedCacheView(cache, [long, short], block_size=4, window=None)
    n = short.ctx_count_drafter
    assert short.block_table[0] == 3
    assert view.read_slots[1, :n].tolist() == cache.slot_mapping(short, 0, n).tolist()
    assert view.read_slots[1, n:].tolist() == [3 * PAGE_SIZE] * (view.read_slots.shape[1] - n)
    assert not view.full_mask[1, 0, 0, n:].any()


def test_accumulator_holds_the_rows_since_the_last_propose_and_refuses_to_overflow():
    state = new_state(capacity=10)
    state.append_context(torch.ones(8, 8))
    assert state.ctx_len == 8
    with pytest.raises(ValueError, match="holds 10 rows"):
        state.append_context(torch.ones(3, 8))
    assert state.ctx_len == 8  # nothing written on refusal
    state.ctx_committed = 8  # a propose turned them into keys/values: the accumulator is free again
    state.append_context(torch.full((3, 8), 2.0))
    assert state.ctx_len == 11 and torch.equal(state.ctx_hidden_acc[:3], torch.full((3, 8), 2.0))


@pytest.mark.parametrize("family, wrong_every", [("llama", 3), ("qwen3", 2), ("qwen3", 1000)])
def test_drafts_equal_a_from_scratch_forward_over_the_whole_context(family, wrong_every):
    """Every propose of a real generate equals the drafter run from scratch on the committed sequence: the
    context rows, their positions and the incremental key/value precompute are all right."""
    target = tiny_target(family, seed=7)
    drafter = tiny_drafter(target, num_layers=3, block_size=5)
    prompt = random_prompt(7, seed=7)
    reference_ids = target.generate(prompt, max_new_tokens=30, do_sample=False)
    recorded = []
    original = DFlashCandidateGenerator.get_candidates

    def recording(self, input_ids, **kwargs):
        candidates, logits = original(self, input_ids, **kwargs)
        recorded.append((input_ids.clone(), logits.clone(), [(s.ctx_len, s.ctx_committed) for s in self.states]))
        return candidates, logits

    DFlashCandidateGenerator.get_candidates = recording
    try:
        with oracle_drafts(reference_ids, wrong_every):
            # the eager loop's proposals (the engine's are checked against them in test_fast_path.py)
            target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=drafter, dflash_fast_path=False)
    finally:
        DFlashCandidateGenerator.get_candidates = original
    assert len(recorded) > 3

    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    ids = drafter.config.target_layer_ids
    block = drafter.config.block_size
    for anchors, logits, ((ctx_len, ctx_committed),) in recorded:
        # the output is lossless, so the committed sequence at this propose is the reference's first ctx_len + 1
        # tokens: the context, then the anchor
        input_ids = reference_ids[:, : ctx_len + 1]
        assert torch.equal(anchors[:, -1], input_ids[:, -1])
        anchor_pos = ctx_len
        assert ctx_committed == ctx_len
        with torch.no_grad():
            hidden = target(input_ids[:, :anchor_pos], output_hidden_states=True).hidden_states
            context = torch.cat([hidden[i + 1] for i in ids], dim=-1)
            block_ids = torch.cat([input_ids[:, -1:], torch.full((1, block - 1), MASK_ID)], dim=1)
            out = drafter(
                noise_embeds=embed(block_ids), context_hidden_states=context,
                position_ids=torch.arange(anchor_pos + block)[None],
            ).last_hidden_state
            expected = lm_head(out[:, 1:])
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fast_path", [False, True])
def test_context_buffers_hold_a_prompt_or_a_block_not_max_length(fast_path):
    """The capture scratch holds one forward's rows (the padded prompt, then a block) and each accumulator the rows
    one verify adds (a block; none on the fast path, whose step writes them to the pages itself), however many tokens
    the call may generate: a row is num_context_features values (40 KB for Qwen3-8B's drafter), so max_length rows
    per sequence cost gigabytes. The prompts are longer than a block and of different lengths, and the output stays
    plain greedy's."""
    from hf_dflash.modeling.dflash_fast_path import release_fast_path
    from tests.conftest import left_padded

    target = tiny_target("qwen3", seed=9)
    drafter = tiny_drafter(target, seed=10, block_size=4)
    ids, mask = left_padded(2, 10, [0, 3], seed=9)
    seen = set()  # (scratch rows, accumulator rows of every state) whenever context rows arrive
    original_prefill = DFlashCandidateGenerator.commit_prefill
    original_update = DFlashCandidateGenerator.update_candidate_strategy

    def record(generator):
        seen.add((generator.scratch.shape[1], tuple(s.ctx_hidden_acc.shape[0] for s in generator.states)))

    def commit_prefill(self, prompt_mask):
        record(self)
        original_prefill(self, prompt_mask)

    def update_candidate_strategy(self, *args):
        record(self)
        original_update(self, *args)

    DFlashCandidateGenerator.commit_prefill = commit_prefill
    DFlashCandidateGenerator.update_candidate_strategy = update_candidate_strategy
    try:
        kwargs = dict(attention_mask=mask, max_new_tokens=200, do_sample=False, pad_token_id=0)
        out = target.generate(ids, assistant_model=drafter, dflash_fast_path=fast_path, **kwargs)
    finally:
        DFlashCandidateGenerator.commit_prefill = original_prefill
        DFlashCandidateGenerator.update_candidate_strategy = original_update
    assert torch.equal(out, target.generate(ids, **kwargs))
    if fast_path:  # the engine captures a verify's rows into its own (rows, block) buffer and a prompt's per chunk
        engine = drafter._dflash_engine[1]
        assert not seen and engine.verify_rows.shape[:2] == (2, 4) and engine.generator.scratch.shape[1] == 0
        release_fast_path(drafter)
        return
    assert (10, (4, 4)) in seen  # the prefill: a padded prompt of 10 rows
    assert (4, (4, 4)) in seen  # each verify: a block
    assert all(scratch <= 10 and accumulators == (4,) * len(accumulators) for scratch, accumulators in seen), seen


def test_propose_refuses_a_stale_context():
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    generator = DFlashCandidateGenerator(drafter, target, batch_size=1, max_length=32, max_rows=8)
    prompt = random_prompt(6)
    with generator.capture:
        generator.capture_rows(6)
        target(prompt)
    generator.commit_prefill(torch.ones_like(prompt))
    state = generator.states[0]
    assert state.context_ready and state.ctx_len == state.ctx_committed == 6  # the prompt's keys/values are written
    candidates, logits = generator.get_candidates(torch.cat([prompt, torch.tensor([[3]])], dim=1))
    assert candidates.shape == (1, 7 + 3) and logits.shape == (1, 3, target.config.vocab_size)
    assert state.ctx_committed == 6 and state.ctx_count_drafter == 6 + 4 and not state.context_ready
    with pytest.raises(RuntimeError, match="stale"):
        generator.get_candidates(candidates)
    generator.release()
    assert len(generator.cache.free_pages) == generator.cache.num_pages
