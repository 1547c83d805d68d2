"""The fast path on hybrid targets (Gated DeltaNet layers between full-attention ones: Qwen3-Next, Qwen3.5 text and
multimodal, Qwen3.5-MoE), run on the CPU without a graph: the step a CUDA graph records, with the linear layers'
states in fixed buffers and rolled back inside the step (dflash_linear_state.py).

The targets use weights at ten times the default scale: a tiny random model at the default scale barely depends on
its context, and a linear state advanced one row too far did not change its greedy output (checked on purpose); at
this scale it does, in every family here.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from hf_dflash.modeling.dflash_decoding import _cache_argument
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from hf_dflash.modeling.dflash_capture import decoder_layers
from hf_dflash.modeling.dflash_engine import DFlashEngine, PagedHybridCache
from hf_dflash.modeling.dflash_linear_state import linear_attention_modules, linear_state_buffers
from hf_dflash.modeling.dflash_paged_cache import PAGE_SIZE, PagedDrafterCache
from tests.conftest import random_prompt, tiny_drafter
from tests.test_batched import PAD, left_pad
from tests.test_families import family_target
from tests.test_fast_path import oracle_drafts

HYBRID = ["qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe"]
SCALE = dict(initializer_range=0.2)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models are bound by per-op overhead: one thread each (see conftest.one_thread)."""


def vocab_of(target: torch.nn.Module) -> int:
    return target.config.get_text_config().vocab_size


@pytest.mark.parametrize("family", HYBRID)
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_identity_alone(family, seed):
    """Batch 1: a random drafter (rejected almost always: every step rolls the block back to its anchor), then an
    oracle whose drafts are right up to planted mistakes (partial acceptance at varying rows)."""
    target = family_target(family, seed=seed, **SCALE)
    drafter = tiny_drafter(target, seed=seed + 10, block_size=4 + seed)
    prompt = random_prompt(3 + 4 * seed, seed=seed)
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    fast = target.generate(
        prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter, dflash_fast_path=True,
        return_dict_in_generate=True,
    )
    assert torch.equal(fast.sequences, plain)
    assert min(fast.acceptance_lengths[0]) == 1  # a step that accepted no draft
    with oracle_drafts(plain, 3 + seed, vocab_of(target)):
        out = target.generate(
            prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter, dflash_fast_path=True,
            return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences, plain)
    assert max(out.acceptance_lengths[0]) > 1 and min(out.acceptance_lengths[0]) < drafter.config.block_size
    release_fast_path(drafter)


@pytest.mark.parametrize("family", HYBRID)
def test_greedy_identity_ragged_batch(family):
    """Three left-padded prompts of different lengths; the oracle's mistakes fall at different rows per sequence, so
    in one step some sequences accept no draft while others accept several."""
    target = family_target(family, seed=3, **SCALE)
    drafter = tiny_drafter(target, block_size=5)
    batch = left_pad([random_prompt(n, seed=n) for n in (4, 9, 2)])
    plain = target.generate(**batch, max_new_tokens=22, do_sample=False, pad_token_id=PAD)
    with oracle_drafts(plain, 3, vocab_of(target)):
        out = target.generate(
            **batch, max_new_tokens=22, do_sample=False, pad_token_id=PAD, assistant_model=drafter,
            dflash_fast_path=True, return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences, plain)
    first_steps = [lengths[0] for lengths in out.acceptance_lengths]
    assert min(first_steps) == 1 and max(first_steps) > 1  # one step: a row accepting none, a row accepting some
    release_fast_path(drafter)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_finished_rows_leave_the_batch(family, monkeypatch):
    """A sequence that meets eos early leaves the engine's rows and the last row moves into its place: its linear
    states and its keys/values move with it."""
    target = family_target(family, seed=5, **SCALE)
    drafter = tiny_drafter(target, block_size=4)
    batch = left_pad([random_prompt(n, seed=20 + n) for n in (6, 3, 8)])
    free = target.generate(**batch, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    prompt_len = batch["input_ids"].shape[1]
    eos = int(free[1, prompt_len + 4])  # sequence 1 stops after at most 5 tokens; the others may stop later
    plain = target.generate(**batch, max_new_tokens=24, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    assert (plain[:, prompt_len:] == eos).any(dim=1).sum() < 3, "pick a prompt where not every sequence stops"
    steps = []
    run_step = DFlashEngine.run_step
    monkeypatch.setattr(DFlashEngine, "run_step", lambda self: steps.append(len(self.sequences)) or run_step(self))
    with oracle_drafts(free, 3, vocab_of(target)):
        out = target.generate(
            **batch, max_new_tokens=24, do_sample=False, pad_token_id=PAD, eos_token_id=eos, assistant_model=drafter,
            dflash_fast_path=True, return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences, plain)
    assert min(steps) < 3 and steps[0] == 3, "no sequence left the batch"
    release_fast_path(drafter)


def paged_hybrid_cache(target: torch.nn.Module, batch: int, num_slots: int) -> PagedHybridCache:
    """The engine's cache for a hybrid target's `batch` rows of `num_slots` positions each, in a pool of their own
    (row r's pages one after another), with fresh linear-attention states."""
    text = target.config.get_text_config()
    linear = linear_attention_modules(target)
    pages = num_slots // PAGE_SIZE
    pool = PagedDrafterCache(
        num_layers=len(decoder_layers(target)), num_pages=batch * pages, num_key_value_heads=text.num_key_value_heads,
        head_dim=text.head_dim, dtype=torch.float32, device="cpu", keyless_layers=frozenset(linear),
    )
    conv, recurrent = linear_state_buffers(linear, batch, torch.float32, "cpu")
    tables = torch.arange(batch * pages).view(batch, pages)
    return PagedHybridCache(pool, tables, num_slots, conv, recurrent, list(linear.values()))


@torch.no_grad()
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
@pytest.mark.parametrize("block, taken", [(5, [0, 1, 4, 5]), (1, [0, 1])])
def test_commit_leaves_the_states_of_plain_decoding(family, block, taken):
    """After a verify of `block` rows and `commit(taken)`, each sequence's conv and recurrent states are those
    transformers' own cache holds after plain decoding of the prompt and the first taken rows (0, 1, B - 1 and B
    here). A one-row verify (a step that verifies the target's own token only) runs the layers' one-token paths, the
    recurrent rule and the conv's in-place update, which the cache turns into its deferred window. The tolerance
    covers a chunked forward against token-by-token decoding at this weight scale (about 3e-5); a state off by one row
    differs by orders of magnitude more."""
    target = family_target(family, seed=7, **SCALE)
    prompt_len, taken = 6, torch.tensor(taken)
    batch = len(taken)
    ids = random_prompt(prompt_len + block, seed=7, batch=batch)
    text = target.config.get_text_config()
    cache = paged_hybrid_cache(target, batch, num_slots=16)
    slots, argument = torch.arange(16), _cache_argument(target)  # the forward's name for its cache (5.24: cache)

    def forward(columns: torch.Tensor) -> None:
        cache.write_slots = columns.expand(batch, -1)
        causal = (slots[None, :] <= columns[:, None])[None, None].expand(batch, 1, -1, -1)  # (b, 1, q, L)
        target(
            input_ids=ids[:, columns], position_ids=columns.expand(batch, -1), use_cache=True, **{argument: cache},
            attention_mask={"full_attention": causal, "linear_attention": None},
        )

    with cache.prefilling():
        forward(torch.arange(prompt_len))
    with cache.deferring():
        forward(torch.arange(prompt_len, prompt_len + block))
    cache.commit(taken)
    for row, count in enumerate(taken.tolist()):
        reference = DynamicCache(config=target.config)
        target(input_ids=ids[row : row + 1, :prompt_len], use_cache=True, **{argument: reference})
        for column in range(prompt_len, prompt_len + count):  # one token at a time, as generate decodes
            target(input_ids=ids[row : row + 1, column : column + 1], use_cache=True, **{argument: reference})
        for layer in linear_attention_modules(target):
            states = reference.layers[layer]
            torch.testing.assert_close(cache.conv[layer][row], states.conv_states[0][0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(cache.recurrent[layer][row], states.recurrent_states[0][0], atol=1e-4, rtol=1e-4)
