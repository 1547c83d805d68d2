"""The drafter runtime's invariants: the page pools' free list and slot mapping, the buffers a generate call holds,
and drafts equal to a from-scratch drafter forward over the whole committed context, wherever the target keeps its
keys/values (the engine's pool or transformers' cache)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from hf_dflash import PAGE_SIZE, PagedDrafterCache
from hf_dflash.modeling.dflash_capture import TargetHiddenCapture
from hf_dflash.modeling.dflash_engine import DFlashEngine
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from hf_dflash.modeling.dflash_paged_cache import page_slots
from tests.conftest import left_padded, scratch_draft_logits, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------------
# What the engine's step proposes, and what a drafter run from scratch proposes
# --------------------------------------------------------------------------------------------------


@dataclass
class Drafted:
    """One sequence's row of one `DFlashEngine.propose`: the engine's key for it, its anchor (position and token)
    and the draft logits (B - 1, V) the step computed for it."""

    key: object
    anchor_pos: int
    anchor_id: int
    logits: torch.Tensor


def record_proposals(
    monkeypatch: pytest.MonkeyPatch, drafts: Callable[[DFlashEngine, list[Drafted]], torch.Tensor] | None = None
) -> list[list[Drafted]]:
    """Wrap `DFlashEngine.propose` (every step's drafter pass, whichever home the target's keys/values have): each
    call appends the running rows' `Drafted` to the returned list. `drafts(engine, rows)` (n, B - 1), when given,
    replaces the drafts the target then verifies (the logits recorded stay the drafter's own), so that a test sets
    how many drafts each step accepts."""
    recorded: list[list[Drafted]] = []
    original = DFlashEngine.propose

    def propose(self, rows, *args):
        proposal, logits = original(self, rows, *args)
        step = [
            Drafted(sequence.key, int(position), int(anchor), row_logits.detach().clone())
            for sequence, position, anchor, row_logits in zip(
                self.sequences, rows.anchor_pos.tolist(), rows.anchor_ids[:, 0].tolist(), logits
            )
        ]
        recorded.append(step)
        if drafts is not None:
            rows.drafts[: len(step)].copy_(drafts(self, step))
        return proposal, logits

    monkeypatch.setattr(DFlashEngine, "propose", propose)
    return recorded


@torch.no_grad()
def committed_context(target: torch.nn.Module, drafter: torch.nn.Module, tokens: torch.LongTensor) -> torch.Tensor:
    """The drafter's context rows (c, k * H_target) of the committed tokens (c,): the target's hidden states at the
    drafter's `target_layer_ids`, from one plain forward over them at positions 0..c-1."""
    hidden = target(tokens[None], output_hidden_states=True).hidden_states
    return torch.cat([hidden[i + 1][0] for i in drafter.config.target_layer_ids], dim=-1)


def committed_rows(
    recorded: list[list[Drafted]], reference: torch.LongTensor, pads: list[int], target: torch.nn.Module,
    drafter: torch.nn.Module,
) -> Iterator[tuple[Drafted, torch.Tensor]]:
    """Each recorded row of a lossless call with its context rows from scratch (`committed_context`), after checking
    that its anchor is the reference's token there. reference (b, L): plain generate's output, row = the sequence's
    key, `pads[key]` padding in front; the committed sequence at a propose is its real tokens up to the anchor."""
    for row in (row for step in recorded for row in step):
        tokens = reference[row.key, pads[row.key] : pads[row.key] + row.anchor_pos + 1]
        assert row.anchor_id == int(tokens[-1])
        yield row, committed_context(target, drafter, tokens[:-1])


def oracle(reference: torch.LongTensor, pads: list[int], wrong_every: int):
    """`record_proposals`' `drafts`: each sequence's reference continuation (reference (b, L), plain generate's,
    row = the sequence's key, `pads[key]` padding in front), wrong at every `wrong_every`-th column, so that steps
    accept from none to all of their drafts, differently per sequence."""

    def drafts(engine: DFlashEngine, step: list[Drafted]) -> torch.Tensor:
        out = []
        for row in step:
            columns = pads[row.key] + row.anchor_pos + 1 + torch.arange(engine.block_size - 1)
            clipped = columns.clamp(max=reference.shape[1] - 1)
            tokens = reference[row.key, clipped]
            wrong = ((columns + row.key) % wrong_every == 0) | (columns != clipped)
            out.append(torch.where(wrong, (tokens + 1) % 200, tokens))
        return torch.stack(out)

    return drafts


@pytest.mark.parametrize("fast_path", [True, False], ids=["pool", "transformers-cache"])
@pytest.mark.parametrize("family, wrong_every", [("llama", 3), ("qwen3", 2), ("qwen3", 1000)])
def test_drafts_equal_a_from_scratch_forward_over_the_whole_context(family, wrong_every, fast_path, monkeypatch):
    """Every propose of a real generate equals the drafter run from scratch on the committed sequence: the context
    rows (captured by the prefill, padded or not, and by each verify, whichever rows it accepted), their positions and
    the context keys/values written step by step into the drafter's pages are all right, wherever the target keeps
    its keys/values. A ragged left-padded batch whose drafts are right up to planted mistakes: steps accept from none
    to all drafts, differently per sequence. The call leaves both of the engine's pools whole."""
    target = tiny_target(family, seed=7)
    drafter = tiny_drafter(target, num_layers=3, block_size=5)
    pads = [0, 3]
    ids, mask = left_padded(2, 9, pads, seed=7)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    reference = target.generate(ids, **kwargs)
    recorded = record_proposals(monkeypatch, oracle(reference, pads, wrong_every))
    out = target.generate(
        ids, assistant_model=drafter, dflash_fast_path=fast_path, return_dict_in_generate=True, **kwargs
    )
    engine = drafter._dflash_engine[1]
    assert engine.target_pool.holds_keys == fast_path  # the call ran in the home asked for
    assert torch.equal(out.sequences, reference)
    assert not engine.sequences and engine.pool_usage()["drafter_pages_used"] == 0
    assert engine.pool_usage()["target_pages_used"] == 0
    release_fast_path(drafter)
    lengths = [n for row in out.acceptance_lengths for n in row]
    assert max(lengths) > 1 and (wrong_every == 1000 or min(lengths) < drafter.config.block_size)
    checked = [row for step in recorded for row in step]
    assert len(recorded) > 3 and {row.key for row in checked} == {0, 1}
    for row, context in committed_rows(recorded, reference, pads, target, drafter):
        expected = scratch_draft_logits(target, drafter, context, row.anchor_id)
        torch.testing.assert_close(row.logits, expected, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# Pages
# --------------------------------------------------------------------------------------------------


def test_pages_are_never_shared_and_come_back():
    cache = PagedDrafterCache(num_layers=2, num_pages=6, num_key_value_heads=1, head_dim=4, dtype=torch.float32,
                              device="cpu")
    a = cache.take(2)
    b = cache.take(3)
    assert a == [0, 1] and b == [2, 3, 4]  # low ids first
    assert not set(a) & set(b) and cache.free_pages == [5]
    with pytest.raises(RuntimeError, match="exhausted"):
        cache.take(2)
    assert cache.free_pages == [5]  # nothing taken on refusal
    cache.give_back(b)
    assert sorted(cache.free_pages) == [2, 3, 4, 5]
    with pytest.raises(RuntimeError, match="not free"):
        cache.take_pages([1, 2])  # page 1 is a's
    assert sorted(cache.free_pages) == [2, 3, 4, 5]
    c = cache.take_pages([3, 4])  # a row that owns a fixed stretch takes its own pages
    assert c == [3, 4] and sorted(cache.free_pages) == [2, 5]
    d = cache.take(2)
    assert sorted(a + c + d) == list(range(6)) and not cache.free_pages
    for pages in (a, c, d):
        cache.give_back(pages)
    assert sorted(cache.free_pages) == list(range(6))


def test_slots_map_through_the_block_table_and_keep_their_values():
    cache = PagedDrafterCache(num_layers=1, num_pages=4, num_key_value_heads=2, head_dim=3, dtype=torch.float32,
                              device="cpu")
    cache.take(1)  # another sequence holds page 0, so this one's slots are not the identity
    pages = cache.take(2)
    tables = torch.tensor([pages[::-1]])  # (1, 2): logical page 0 -> physical page 2, 1 -> 1
    positions = torch.arange(14, 20)[None]  # crosses the page boundary
    slots = page_slots(tables, positions)
    expected = [tables[0, p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(14, 20)]
    assert slots[0].tolist() == expected
    key, value = torch.randn(1, 2, 6, 3), torch.randn(1, 2, 6, 3)  # (b, g, n, d), as attention lays them out
    cache.write_rows(0, slots, key, value)
    read_key, read_value = cache.read(0, slots)
    assert torch.equal(read_key, key) and torch.equal(read_value, value)
    # whole pages read back in logical order: positions 14..19 of the sequence at columns 14..19
    page_key, page_value = cache.read_pages(0, tables)
    assert torch.equal(page_key[:, :, 14:20], key) and torch.equal(page_value[:, :, 14:20], value)


# --------------------------------------------------------------------------------------------------
# Buffers
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fast_path", [True, False], ids=["pool", "transformers-cache"])
def test_context_buffers_hold_a_prompt_or_a_block_not_max_length(fast_path, monkeypatch):
    """Captured target rows land in buffers of one forward's rows (the prompt, then a block per verify), and the
    engine keeps a block's worth per row between steps, however many tokens the call may generate: a row is
    num_context_features values (40 KB for Qwen3-8B's drafter), so max_length rows per sequence would cost
    gigabytes. The prompts are longer than a block and of different lengths, and the output stays plain greedy's."""
    target = tiny_target("qwen3", seed=9)
    drafter = tiny_drafter(target, seed=10, block_size=4)
    ids, mask = left_padded(2, 10, [0, 3], seed=9)
    seen = set()  # (sequences, rows) of every buffer a target forward's captured rows were written to
    original_hook = TargetHiddenCapture._hook

    def hook(self, column):
        copy_rows = original_hook(self, column)

        def recording(module, args, output):
            if self.destination is not None:
                seen.add(tuple(self.destination.shape[:2]))
            return copy_rows(module, args, output)

        return recording

    monkeypatch.setattr(TargetHiddenCapture, "_hook", hook)
    kwargs = dict(attention_mask=mask, max_new_tokens=200, do_sample=False, pad_token_id=0)
    out = target.generate(ids, assistant_model=drafter, dflash_fast_path=fast_path, **kwargs)
    engine = drafter._dflash_engine[1]
    release_fast_path(drafter)
    assert torch.equal(out, target.generate(ids, **kwargs))
    features = drafter.config.num_context_features
    assert engine.verify_rows.shape == (2, 4, features)  # what the engine keeps between steps: one block per row
    assert (2, 10) in seen  # the prefill: the prompts (padded to 10 in transformers' cache, the longest is 10)
    assert (2, 4) in seen  # each verify: a block
    assert all(rows <= 10 for _, rows in seen), seen
