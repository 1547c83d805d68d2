"""Attention masks with padding, on the fast path (the engine, on the CPU without a graph)."""

from __future__ import annotations

import pytest
import torch

from hf_dflash.modeling.dflash_decoding import _cache_argument
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from tests.conftest import random_prompt, tiny_drafter
from tests.test_families import family_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_left_padded_batch_of_one_hands_back_no_cache_the_padding_would_misplace(family):
    """Plain generate's cache holds a slot for each pad, as the eager loop's does, and generate continues from it;
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
