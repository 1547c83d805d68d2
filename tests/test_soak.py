"""The soak scenario (`hf-dflash bench soak`), reduced for CI: consecutive generate calls of every kind, some failing on
purpose.

No hook may stay on the target or drafter, no DFlash generator may outlive its call, sampled greedy calls must equal
plain generate, and resident memory must not grow once warm. HF_DFLASH_SOAK=1 runs 300 calls here; the full
1,000-call soak is `hf-dflash bench soak` (figures in benchmarks/reliability.md).
"""

from __future__ import annotations

import pytest

from hf_dflash.bench.soak import run_soak, small_pair
from tests.conftest import SOAK

pytestmark = pytest.mark.usefixtures("one_thread")


def test_consecutive_calls_leak_nothing():
    target, drafter = small_pair("cpu")
    result = run_soak(target, drafter, calls=300 if SOAK else 48, warmup=16, every=16)
    assert result["problems"] == []
    assert result["faults"] > 0 and result["checked_against_plain"] > 0 and result["sampled"] > 0
    # a leaked generator holds its buffers (~1 MB here); allocator noise stays well under this
    assert result["rss_growth_mb"] < 32, result["samples"]
