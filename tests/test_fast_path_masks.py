"""Attention masks that are not left padding, on the fast path (the engine, on the CPU without a graph).

The engine drops each row's padding and prefills its real tokens at positions 0..n-1. Plain generate numbers a row's
real tokens cumsum(mask) - 1 and hides its padding from every query, so where every row ends in a real token (left
padding, holes between real tokens, both) each token sees what it sees in the compacted row: there the engine must
give plain generate's tokens, processors that read the padded row included. Where a row ends in padding, or the
target's sliding windows or linear-attention layers see the padding's columns, plain generate's tokens are not the
compacted row's. DFlash does not reproduce a row that ends in padding or holes under sliding windows, so
generate refuses those masks before any forward (`dflash_checks.padding_problem`); a hybrid target's holes keep its
keys/values and states in transformers' cache, with the padding's columns (`fast_path_blocker`). A padded row of one
gets no cache back from the pool: plain generate's would hold the padding's slots.
"""

from __future__ import annotations

import pytest
import torch

from hf_dflash.modeling import dflash_fast_path_blockers
from hf_dflash.modeling.dflash_decoding import _cache_argument
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from tests.conftest import random_prompt, tiny_drafter
from tests.test_fast_path import oracle_drafts
from tests.test_families import context_scale, family_target

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTH = 10
# layout -> the zero columns of each row: holes between real tokens of rows of different real lengths, holes after
# left padding, a batch of one, and right padding (rows that end in padding)
LAYOUTS = {
    "holes": {0: [3, 4], 1: [6], 2: [1, 2, 5, 7]},
    "left_padding_and_holes": {0: [0, 1, 5], 1: [], 2: [0, 4, 6, 7]},
    "one_row_with_holes": {0: [2, 3, 6]},
    "right_padding": {0: [], 1: [7, 8, 9], 2: [4, 5, 6, 7, 8, 9]},
}
HOLEY = ("holes", "left_padding_and_holes", "one_row_with_holes")
RIGHT = "a row of the attention mask ends in padding, which plain generate reads at a pad"
WINDOWS = "padding between a row's real tokens, which the target's sliding windows count as columns"
LINEAR = "the target's linear-attention layers decay their state across padding that follows real tokens"


def masked(layout: str, seed: int = 0) -> tuple[torch.LongTensor, torch.Tensor]:
    """A random prompt (rows, LENGTH) with `LAYOUTS[layout]`'s columns masked out (their ids stay random: plain
    generate's processors read them)."""
    zeros = LAYOUTS[layout]
    ids = random_prompt(LENGTH, seed=seed, batch=len(zeros))
    mask = torch.ones_like(ids)
    for row, columns in zeros.items():
        mask[row, columns] = 0
    return ids, mask


def compacted(ids: torch.LongTensor, mask: torch.Tensor) -> tuple[torch.LongTensor, torch.Tensor]:
    """The same rows with their real tokens moved right, after left padding: what the engine prefills."""
    rows = [row[kept.bool()] for row, kept in zip(ids, mask)]
    moved = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        moved[i, LENGTH - len(row):] = row
    return moved, (torch.arange(LENGTH) >= LENGTH - mask.sum(dim=1, keepdim=True)).long()


def blocker(target, drafter, mask):
    return dflash_fast_path_blockers.fast_path_blocker(target, drafter, mask)


@pytest.mark.parametrize(
    "family, layout, outcome",
    [("llama", "holes", "served"), ("llama", "left_padding_and_holes", "served"), ("llama", "right_padding", RIGHT),
     ("gemma3_text", "holes", WINDOWS), ("qwen3_next", "holes", LINEAR), ("qwen3_next", "right_padding", RIGHT)],
)
def test_a_mask_is_served_exactly_where_plain_generate_reads_the_compacted_rows(family, layout, outcome):
    """The rules against plain generate itself: the fast path serves a mask exactly where plain generate's tokens are
    those of the same real tokens left-padded (the engine's compacted rows); elsewhere a hybrid's holes take the eager
    loop (`fast_path_blocker`), and generate refuses what no loop reproduces before any forward. A target whose tokens
    depend strongly on their context, so that a position or a window off changes them."""
    target = family_target(family, seed=3, initializer_range=context_scale(family))
    drafter = tiny_drafter(target)
    ids, mask = masked(layout, seed=3)
    moved, moved_mask = compacted(ids, mask)
    settings = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    plain = target.generate(ids, attention_mask=mask, **settings)[:, LENGTH:]
    left = target.generate(moved, attention_mask=moved_mask, **settings)[:, LENGTH:]
    assert torch.equal(plain, left) == (outcome == "served")
    assert blocker(target, drafter, moved_mask) is None  # left padding is served on every target
    if outcome in (RIGHT, WINDOWS):
        forwards = []
        handle = target.register_forward_pre_hook(lambda *args: forwards.append(1))
        with pytest.raises(ValueError, match=outcome):
            target.generate(ids, attention_mask=mask, **settings, assistant_model=drafter)
        handle.remove()
        assert not forwards, "the refusal came after a forward"
    else:
        found = blocker(target, drafter, mask)
        assert found is None if outcome == "served" else outcome in found


@pytest.mark.parametrize("family, attention", [(f, a) for f in ("llama", "qwen3") for a in ("sdpa", "eager")])
@pytest.mark.parametrize("layout", HOLEY)
def test_the_fast_path_equals_plain_greedy_with_holes_in_the_mask(family, attention, layout):
    """Holes between a row's real tokens (after left padding, in a batch of one): the engine's tokens are plain
    generate's, with the oracle's drafts accepted (the engine ran its steps); the holes change plain generate's tokens
    (against the same ids unmasked), so an engine that read them would fail. A batch of one hands back no cache: plain
    generate's would hold a slot for each hole."""
    target = family_target(family, seed=5, initializer_range=context_scale(family))
    target.set_attn_implementation(attention)
    drafter = tiny_drafter(target, block_size=5)
    ids, mask = masked(layout, seed=5)
    settings = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    reference = target.generate(ids, attention_mask=mask, **settings)
    assert not torch.equal(reference, target.generate(ids, attention_mask=torch.ones_like(mask), **settings))
    with oracle_drafts(reference, 4, target.config.vocab_size):
        out = target.generate(
            ids, attention_mask=mask, **settings, assistant_model=drafter, dflash_fast_path=True,
            return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences, reference)
    assert max(max(lengths) for lengths in out.acceptance_lengths) > 1  # the oracle's drafts were accepted
    engine = drafter._dflash_engine[1]
    assert sum(engine.width_steps.values()) > 0 and engine.accepted_drafts > 0
    assert getattr(out, _cache_argument(target)) is None
    release_fast_path(drafter)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_left_padded_batch_of_one_hands_back_no_cache_the_padding_would_misplace(family):
    """Plain generate's cache holds a slot for each pad, and generate continues from it;
    the engine's rows hold the real tokens only, so a cache copied from them would have generate continue from the
    wrong column: the fast path hands back none for a padded row (an unpadded row's: tests/test_families.py)."""
    target = family_target(family, seed=2, initializer_range=0.2)
    drafter = tiny_drafter(target, block_size=4)
    ids, mask = random_prompt(8, seed=2), torch.ones(1, 8, dtype=torch.long)
    mask[0, :3] = 0
    settings = dict(do_sample=False, pad_token_id=0)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=16, **settings)
    for fast in (False, True):
        out = target.generate(
            ids, attention_mask=mask, max_new_tokens=10, **settings, assistant_model=drafter, dflash_fast_path=fast,
            return_dict_in_generate=True,
        )
        cache = getattr(out, _cache_argument(target))
        assert (cache is None) == fast
        if cache is not None:
            more = torch.cat([mask, torch.ones(1, 10, dtype=torch.long)], dim=1)
            continued = target.generate(
                out.sequences, attention_mask=more, max_new_tokens=6, **settings, **{_cache_argument(target): cache}
            )
            assert torch.equal(continued, plain)
    release_fast_path(drafter)


@pytest.mark.parametrize("setting", ["min_new_tokens", "no_repeat_ngram_size", "repetition_penalty"])
def test_processors_read_the_row_as_plain_generate_holds_it_with_holes(setting):
    """Processors that read the padded row: min_new_tokens counts its padding in the prompt's length, no-repeat
    n-grams and the repetition penalty read the ids under its holes. Each setting is built so that plain generate's
    tokens depend on that (checked), and the engine's equal them."""
    target = family_target("llama", seed=6, initializer_range=0.2)
    drafter = tiny_drafter(target, block_size=4)
    ids, mask = masked("holes", seed=6)
    row, holes = 2, LAYOUTS["holes"][2]  # its holes: columns 1, 2 and 5, 7
    settings = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    free = target.generate(ids, attention_mask=mask, **settings)
    if setting == "min_new_tokens":
        # eos: the first token the row says at index k >= 2 that it did not say before; plain generate allows it at
        # index k exactly when it counts the row's padding in the prompt's length
        new = free[row, LENGTH:].tolist()
        k = next(k for k in range(2, len(new)) if new[k] not in new[:k])
        settings.update(eos_token_id=new[k], min_new_tokens=k)
        wrong = dict(settings, min_new_tokens=k + len(holes))  # the length without the padding
    else:
        # the row's first two new tokens under its holes: plain generate counts them in the penalty's set, and the
        # bigram bans its second new token once it says the first again
        ids[row, holes[0]], ids[row, holes[1]] = free[row, LENGTH : LENGTH + 2].tolist()
        settings.update({setting: 2 if setting == "no_repeat_ngram_size" else 3.0})
        wrong = None
    reference = target.generate(ids, attention_mask=mask, **settings)
    if wrong is not None:
        assert reference[row, LENGTH + k] == settings["eos_token_id"]
        assert not torch.equal(reference, target.generate(ids, attention_mask=mask, **wrong))
    else:
        other = ids.clone()
        other[row, holes[:2]] = 0
        assert not torch.equal(reference, target.generate(other, attention_mask=mask, **settings))
    with oracle_drafts(reference, 4, target.config.vocab_size):
        out = target.generate(
            ids, attention_mask=mask, **settings, assistant_model=drafter, dflash_fast_path=True,
            return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences, reference)
    assert max(max(lengths) for lengths in out.acceptance_lengths) > 1
    release_fast_path(drafter)


def test_a_hybrids_holes_keep_transformers_cache_which_equals_plain_greedy():
    """Gated DeltaNet layers decay their state across padding that follows real tokens: a call that insists on the
    fast path is refused with that reason; by default the call keeps the target's keys/values and states in
    transformers' cache, with the padding's columns, and gives plain generate's tokens."""
    target = family_target("qwen3_next", seed=3, initializer_range=context_scale("qwen3_next"))
    drafter = tiny_drafter(target, block_size=4)
    ids, mask = masked("holes", seed=3)
    settings = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)
    with pytest.raises(ValueError, match=f"dflash_fast_path=True, but .*{LINEAR}"):
        target.generate(ids, attention_mask=mask, **settings, assistant_model=drafter, dflash_fast_path=True)
    plain = target.generate(ids, attention_mask=mask, **settings)
    assert torch.equal(target.generate(ids, attention_mask=mask, **settings, assistant_model=drafter), plain)
