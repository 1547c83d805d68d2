"""The fast path's attention without key/value expansion (dflash_attention.py) and the contiguous reads of a generate
call's rows in the engine (`contiguous_rows`, dflash_engine.py): same values as transformers' sdpa and as a gather,
same tokens as plain greedy generate, and the user's model left as it was."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations import sdpa_attention

from hf_dflash.bench import step_cost
from hf_dflash.modeling import dflash_attention
from hf_dflash.modeling.dflash_attention import (
    GROUPED_SDPA, fused_kernel_takes_grouped_heads, grouped_attention, grouped_sdpa_attention,
)
from hf_dflash.modeling.dflash_decoding import _cache_argument
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from hf_dflash.modeling.dflash_engine import PagedTargetCache
from hf_dflash.modeling.dflash_paged_cache import PAGE_SIZE, PagedDrafterCache, page_slots
from tests.conftest import left_padded, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


class Heads(torch.nn.Module):
    """What an attention function reads from its module: the query heads per key/value head."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.fixture
def grouped_calls():
    """The calls the fast path's forwards make to the grouped attention: (module class, heads, kv heads, masked)."""
    calls = []

    def counting(module, query, key, value, attention_mask, **kwargs):
        calls.append((type(module).__name__, query.shape[1], key.shape[1], attention_mask is not None))
        return grouped_sdpa_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(GROUPED_SDPA, counting)
    yield calls
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)


@pytest.fixture
def repeat_kv_calls(monkeypatch):
    """How often transformers' sdpa copied key/value heads (`repeat_kv`)."""
    calls = []
    original = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.fixture(params=["fold", "enable_gqa"])
def grouped_path(request, monkeypatch):
    """Each way the grouped attention can read grouped heads. On CPU torch's dispatcher is not asked (the fold is
    taken); `enable_gqa` makes the call as it is made where a fused CUDA kernel takes grouped heads, and records the
    sdpa calls so a test can check which one ran."""
    sdpa_calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, *args, **kwargs):
        if sys._getframe(1).f_globals is vars(dflash_attention):  # the grouped attention's own calls only
            sdpa_calls.append((kwargs.get("enable_gqa", False), query.shape[1], key.shape[1]))
        return sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    if request.param == "enable_gqa":
        monkeypatch.setattr(dflash_attention, "fused_kernel_takes_grouped_heads", lambda *args: True)
    return request.param, sdpa_calls


def test_torchs_dispatcher_is_asked_on_cuda_only():
    query, key = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 6, 8)
    assert not fused_kernel_takes_grouped_heads(query, key, key, torch.zeros(1, 1, 3, 6), 0.0, None)


@pytest.mark.parametrize("groups", [2, 4])
@pytest.mark.parametrize("mask_kind", ["rows", "one_row", "per_head", "additive"])
def test_grouped_attention_equals_transformers_sdpa(groups, mask_kind, repeat_kv_calls, grouped_path):
    torch.manual_seed(0)
    b, g, q, slots, d = 3, 2, 5, 37, 8
    h = g * groups
    query, key, value = torch.randn(b, h, q, d), torch.randn(b, g, slots, d), torch.randn(b, g, slots, d)
    columns = torch.arange(slots)
    visible = (columns >= torch.tensor([0, 4, 9])[:, None, None]) & (columns <= 20 + torch.arange(q)[None, :, None])
    mask = {
        "rows": visible[:, None],  # (b, 1, q, L), the verify's
        "one_row": visible[:, None, :1],  # (b, 1, 1, L), the drafter's
        "per_head": visible[:, None].expand(b, h, q, slots) & (torch.rand(b, h, q, slots) > 0.2) | (columns == 20),
        "additive": torch.where(visible, 0.0, torch.finfo(torch.float32).min)[:, None],
    }[mask_kind]
    module = Heads(groups)
    expected, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert len(repeat_kv_calls) == 2  # transformers' own path copies the key and value heads (so this test can fail)
    out, weights = grouped_sdpa_attention(module, query, key, value, mask, scaling=0.3)
    assert weights is None and out.shape == (b, q, h, d) and out.is_contiguous()
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    assert len(repeat_kv_calls) == 2  # and the grouped one did not
    path, sdpa_calls = grouped_path
    # the grouped call went the way it was meant to: grouped heads, or the query folded onto the key/value heads
    assert sdpa_calls[-1] == ((True, h, g) if path == "enable_gqa" else (False, g, g))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("heads", [4, 8])
def test_a_verify_forward_gives_the_same_logits_with_grouped_attention(family, heads, grouped_calls):
    """A left-padded batch's prompt in the engine's paged cache (row r's pages one after another), then 5 verify rows
    over all its slots under the fast path's mask: the logits (float32) with and without the grouped attention agree
    to rounding."""
    target = tiny_target(family, seed=5, num_attention_heads=heads, num_key_value_heads=2)
    text = target.config
    ids, real = left_padded(3, 11, [0, 3, 6], seed=1)
    batch, prompt_len = ids.shape
    num_slots, rows = 32, 5

    def cache() -> PagedTargetCache:
        pages = num_slots // PAGE_SIZE
        pool = PagedDrafterCache(text.num_hidden_layers, batch * pages, text.num_key_value_heads,
                                 text.hidden_size // heads, torch.float32, "cpu")
        tables = torch.arange(batch * pages).view(batch, pages)
        return PagedTargetCache(pool, tables, tables)

    slots = torch.arange(num_slots)
    columns = torch.arange(prompt_len)
    prompt_mask = (slots <= columns[:, None]) & (slots < prompt_len) & torch.nn.functional.pad(
        real.bool(), (0, num_slots - prompt_len)
    )[:, None, :] | (slots == columns[:, None])
    offsets = prompt_len - real.sum(dim=1)
    positions = real.sum(dim=1)[:, None] + torch.arange(rows)  # (b, rows)
    write = offsets[:, None] + positions
    verify_mask = (slots >= offsets[:, None, None]) & (slots <= write[:, :, None])  # (b, rows, L)
    block = torch.randint(1, 250, (batch, rows), generator=torch.Generator().manual_seed(2))
    argument = _cache_argument(target)
    logits = []
    for grouped in (False, True):
        static = cache()
        with torch.no_grad():
            static.write_slots = columns.expand(batch, -1)
            target(input_ids=ids, position_ids=(columns - offsets[:, None]).clamp(min=0),
                   attention_mask=prompt_mask[:, None], use_cache=True, **{argument: static})
            static.write_slots = write
            with grouped_attention(target) if grouped else contextlib.nullcontext():
                logits.append(
                    target(input_ids=block, position_ids=positions, attention_mask=verify_mask[:, None],
                           use_cache=True, **{argument: static}).logits
                )
    assert len(grouped_calls) == text.num_hidden_layers and all(masked for *_, masked in grouped_calls)
    assert {(h, g) for _, h, g, _ in grouped_calls} == {(heads, 2)}
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("heads", [4, 8])
def test_the_fast_path_attends_with_grouped_heads_and_equals_plain_greedy(family, heads, grouped_calls, grouped_path):
    target = tiny_target(family, seed=7, num_attention_heads=heads, num_key_value_heads=2)
    drafter = tiny_drafter(target, seed=8, block_size=4)
    ids, mask = left_padded(3, 10, [0, 4, 7], seed=3)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert not grouped_calls  # plain generate never sees the fast path's attention
    fast = target.generate(
        ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, assistant_model=drafter,
        dflash_fast_path=True,
    )
    release_fast_path(drafter)
    assert torch.equal(fast, plain)
    callers = {name for name, *_ in grouped_calls}
    assert callers == {"DFlashAttention", type(target.model.layers[0].self_attn).__name__}
    assert all(masked for *_, masked in grouped_calls)
    path, sdpa_calls = grouped_path  # every grouped call took the path meant
    assert len(sdpa_calls) == len(grouped_calls)
    assert set(sdpa_calls) == ({(True, heads, 2)} if path == "enable_gqa" else {(False, 2, 2)})
    assert target.config._attn_implementation == drafter.config._attn_implementation == "sdpa"


def test_the_1_token_baseline_runs_through_the_grouped_attention_inside_it(grouped_calls, monkeypatch):
    """`hf-dflash bench step-cost`'s target_1_token_grouped_ms: the 1-token baseline on a held step, inside
    `grouped_attention`, sends every target layer's attention through the grouped function and gives the same logits
    (float32) as under sdpa. (CUDA graphs are GPU-only: the replay runs the forward once here.)"""
    logits = []
    monkeypatch.setattr(step_cost, "graph_ms", lambda forward: logits.append(forward()) or 0.0)
    target = tiny_target("qwen3", seed=3, num_attention_heads=8, num_key_value_heads=2)
    drafter = tiny_drafter(target, block_size=4)
    ids, mask = left_padded(2, 9, [0, 3])
    out = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                          assistant_model=drafter, dflash_fast_path=True)
    held = step_cost.hold(drafter, out, torch.nn.functional.pad(mask, (0, 10), value=1))
    grouped_calls.clear()  # the call's own forwards
    assert step_cost.target_1_token_ms(held) == 0.0 and not grouped_calls
    with grouped_attention(target):
        assert step_cost.target_1_token_ms(held) == 0.0
    release_fast_path(drafter)
    assert grouped_calls == [("Qwen3Attention", 8, 2, True)] * target.config.num_hidden_layers
    assert logits[0].shape == (2, 1, target.config.vocab_size)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_the_users_models_are_left_as_they_were_when_a_step_fails():
    target = tiny_target("qwen3", seed=2)
    drafter = tiny_drafter(target, block_size=4)
    ids, mask = left_padded(2, 9, [0, 2])
    before = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)

    def fail_in_the_verify(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] == drafter.config.block_size:
            raise RuntimeError("a failing verify")

    hook = target.model.layers[-1].register_forward_pre_hook(fail_in_the_verify, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="a failing verify"):
            target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                            assistant_model=drafter, dflash_fast_path=True)
    finally:
        hook.remove()
        release_fast_path(drafter)
    for model in (target, drafter):
        assert {module.config._attn_implementation for module in model.modules() if hasattr(module, "config")} == {
            "sdpa"
        }
    after = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(after, before)


def test_only_sdpa_attention_is_switched():
    """A model whose attention is not sdpa (eager here) keeps it inside `grouped_attention`; an sdpa one is switched
    for the duration only."""
    target = tiny_target("llama", seed=4, attn_implementation="eager")
    drafter = tiny_drafter(target, block_size=4)
    assert drafter.config._attn_implementation == "sdpa"
    with grouped_attention(target, drafter):
        assert target.config._attn_implementation == "eager"
        assert drafter.config._attn_implementation == GROUPED_SDPA
    assert target.config._attn_implementation == "eager" and drafter.config._attn_implementation == "sdpa"


def held_call(family: str, seed: int, lengths: list[int]) -> step_cost.HeldCall:
    """A fast-path call on a left-padded batch of prompts of `lengths` tokens, its sequences held in its engine."""
    target = tiny_target(family, seed=seed)
    drafter = tiny_drafter(target, block_size=4)
    ids, mask = left_padded(len(lengths), max(lengths), [max(lengths) - n for n in lengths])
    out = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                          assistant_model=drafter, dflash_fast_path=True)
    return step_cost.hold(drafter, out, torch.nn.functional.pad(mask, (0, 10), value=1))


def test_the_drafter_and_the_target_read_a_calls_rows_as_views_of_the_pools():
    """Each row of a generate call owns one stretch of every layer's pools: a layer's read shares the pool's memory
    and holds what the gather through the block tables reads."""
    held = held_call("llama", 6, [9, 7, 4])
    engine, rows = held.engine, held.rows
    n = rows.anchor_ids.shape[0]
    read_all = page_slots(rows.block_tables, rows.draft_key_positions.expand(n, -1))  # (n, S), the gather's slots
    for pool, view in ((engine.proposer.cache, rows.drafter_view), (engine.target_pool, rows.target_cache)):
        g, d = pool.key_pools[0].shape[1:]
        for layer in range(len(pool.key_pools)):
            if view is rows.target_cache:  # its writes go to the verify's slots; the anchors' own are harmless here
                view.write_slots = rows.anchor_pos[:, None]
            written = torch.randn(n, g, 1 if view is rows.target_cache else engine.block_size, d)
            key, value = view.update(written, -written, layer)
            assert key.untyped_storage().data_ptr() == pool.key_pools[layer].untyped_storage().data_ptr()
            assert value.untyped_storage().data_ptr() == pool.value_pools[layer].untyped_storage().data_ptr()
            tables = rows.block_tables if view is rows.drafter_view else engine.target_tables[:n]
            gathered_key, gathered_value = pool.read(layer, page_slots(tables, rows.key_positions.expand(n, -1)))
            assert torch.equal(key, gathered_key) and torch.equal(value, gathered_value)
            assert key.abs().sum() > 0  # the prompt's context is there, not an empty pool
    engine.retire_all()


def test_a_row_that_moves_takes_its_keys_and_values_into_its_new_stretch(monkeypatch):
    """When a sequence of a generate call ends, the last row moves into its place: the moving sequence's keys/values
    below its anchor (the rest the step writes before reading) are copied into that row's stretch of both pools, so
    the contiguous read of row r is still its sequence's. Rows that end together retire the last first, so none
    moves."""
    held = held_call("qwen3", 1, [9, 7, 4, 8])
    engine = held.engine
    slots = engine.pages_per_row * PAGE_SIZE
    pools = [*engine.target_pool.key_pools, *engine.target_pool.value_pools, *engine.drafter_pool.key_pools,
             *engine.drafter_pool.value_pools]

    def stretch(pool: torch.Tensor, row: int) -> torch.Tensor:
        start = engine.scratch_pages * PAGE_SIZE + row * slots
        return pool[start : start + slots]

    position = engine.sequences[3].position
    last = [stretch(pool, 3)[:position].clone() for pool in pools]
    assert not torch.equal(stretch(pools[0], 0)[:position], last[0])  # rows differ, so a wrong move could not pass
    engine.retire(0)
    assert [sequence.key for sequence in engine.sequences] == [3, 1, 2]
    for pool, held_keys in zip(pools, last):
        assert torch.equal(stretch(pool, 0)[:position], held_keys)
    moves = []
    move = engine._move_stretch
    monkeypatch.setattr(engine, "_move_stretch", lambda *args: moves.append(args[:2]) or move(*args))
    engine.retire_many([3, 2])  # rows 0 and 2: row 2 first, then row 1 moves into row 0
    assert moves == [(1, 0)] and [sequence.key for sequence in engine.sequences] == [1]
    engine.retire_all()
    assert engine.compute_free_capacity() == 1.0
