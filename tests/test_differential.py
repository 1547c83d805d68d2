"""Differential test: over many random seeds, greedy DFlash output equals plain greedy generate, token for token.

Each seed picks a target family and shape (width, depth, GQA ratio), a drafter (layers, block size 2..16), a batch
of left-padded prompts (lengths from 1 up), a length budget (sometimes exactly the drafter's context allocation),
an eos that stops some sequences mid-way, and how good the drafts are: the random drafter's own (rarely accepted)
or an oracle that proposes the reference continuation with mistakes at seeded places (long, ragged acceptance).
float32 on CPU. HF_DFLASH_SOAK=1 runs 300 seeds instead of 40.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

import pytest
import torch

from tests.conftest import SOAK, random_prompt, tiny_drafter, tiny_target
from tests.test_batched import PAD, left_pad
from tests.test_fast_path import oracle_drafts

pytestmark = pytest.mark.usefixtures("one_thread")

SEEDS = range(300 if SOAK else 40)


@dataclass
class Case:
    family: str
    target_shape: dict
    drafter_layers: int
    target_layer_ids: list[int]
    block_size: int
    prompt_lengths: list[int]
    max_new_tokens: int
    at_allocation_limit: bool
    use_eos: bool
    wrong_every: int | None  # None: the drafter's own drafts

    @classmethod
    def draw(cls, seed: int) -> "Case":
        rng = random.Random(seed)
        heads = rng.choice([2, 4, 8])
        head_dim = rng.choice([8, 16])
        depth = rng.randint(2, 6)
        return cls(
            family=rng.choice(["llama", "qwen3"]),
            target_shape=dict(
                hidden_size=heads * head_dim,
                intermediate_size=rng.choice([32, 96]),
                num_hidden_layers=depth,
                num_attention_heads=heads,
                num_key_value_heads=heads // rng.choice([d for d in (1, 2, 4) if heads % d == 0]),  # GQA 1..4
            ),
            drafter_layers=rng.randint(1, 3),
            target_layer_ids=sorted(rng.sample(range(depth), rng.randint(1, min(depth, 4)))),
            block_size=rng.randint(2, 16),
            prompt_lengths=[rng.choice([1, rng.randint(2, 24)]) for _ in range(rng.choice([1, 1, 2, 3, 4]))],
            max_new_tokens=rng.randint(1, 40),
            at_allocation_limit=rng.random() < 0.3,
            use_eos=rng.random() < 0.4,
            wrong_every=rng.choice([None, 2, 3, 5, 1000]),
        )


@pytest.mark.parametrize("seed", SEEDS)
def test_dflash_equals_plain_greedy(seed):
    case = Case.draw(seed)
    target = tiny_target(case.family, seed=seed, **case.target_shape)
    drafter = tiny_drafter(
        target, seed=seed + 1, num_layers=case.drafter_layers, block_size=case.block_size,
        target_layer_ids=case.target_layer_ids,
    )
    prompts = [random_prompt(n, seed=seed * 10 + i) for i, n in enumerate(case.prompt_lengths)]
    batch = left_pad(prompts)
    width = batch["input_ids"].shape[1]
    kwargs = dict(max_new_tokens=case.max_new_tokens, do_sample=False, pad_token_id=PAD)
    if case.at_allocation_limit:  # the longest run the drafter's context allocation allows, and not a slot more
        limit = width + case.max_new_tokens + case.block_size
        drafter.config.max_position_embeddings = limit - 1
        with pytest.raises(ValueError, match=f"max_position_embeddings={limit - 1}.*lower max_new_tokens"):
            target.generate(**batch, **kwargs, assistant_model=drafter)
        drafter.config.max_position_embeddings = limit
    if case.use_eos:  # a token the first sequence emits mid-way ends it (and maybe others) early
        free_run = target.generate(**batch, **kwargs)
        # (the free run may itself stop early, on the target's default eos)
        kwargs["eos_token_id"] = int(free_run[0, min(width + case.max_new_tokens // 2, free_run.shape[1] - 1)])

    plain = target.generate(**batch, **kwargs)
    oracle = contextlib.nullcontext() if case.wrong_every is None else oracle_drafts(plain, case.wrong_every)
    with oracle:
        out = target.generate(**batch, **kwargs, assistant_model=drafter, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain), case
    for lengths in out.acceptance_lengths:
        assert all(1 <= n <= case.block_size for n in lengths), case
