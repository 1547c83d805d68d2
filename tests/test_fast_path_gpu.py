"""The fast path on a GPU, where its step is recorded as a CUDA graph and replayed (skipped without one).

CI runs the same step without a graph on the CPU (test_fast_path.py, test_hybrid_fast_path.py); these run it as a
GPU runs it: `python3 -m pytest -q tests/test_fast_path_gpu.py` on a GPU machine (benchmarks/gpu/README.md).
In float32, on tiny random targets: the graph-replayed output equals plain greedy generate and the step over
transformers' cache, at
batch 1 and in left-padded batches of 3, over repeated calls that reuse the recorded graph, for Llama and Qwen3 and
the families whose layers the fast path masks per layer type: gpt-oss (sliding layers alternating with full ones,
attention sinks, eager attention, experts on batched_mm), Mistral-style (a window on every layer) and qwen3_moe
(batched_mm experts); every window (6) is shorter than prompt plus generation, so it binds. Hybrid targets
(qwen3_5 text and multimodal, qwen3_next with batched experts) equal plain greedy with transformers' PyTorch rule.
Under Qwen3's sampling defaults and a repetition penalty the step is graph-replayed and a seed reproduces its
output. Two MoE facts the fast path relies on: bfloat16 qwen3_moe and qwen3_next whose experts run grouped_mm
record as a graph and replay, and experts on 'eager' are refused with the reason.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_prompt, tiny_drafter, tiny_target
from tests.test_batched import PAD, left_pad
from tests.test_families import family_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

PADDINGS = ((1, [0]), (3, [0, 3, 6]), (3, [2, 0, 5]))


def build(family: str, dtype: torch.dtype = torch.float32, experts: str | None = None) -> torch.nn.Module:
    target = tiny_target(family) if family in ("llama", "qwen3") else family_target(family, seed=4)
    if experts is not None:
        target.set_experts_implementation(experts)
    return target.to("cuda", dtype)


def padded_batch(batch: int, pads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_prompt(12, seed=batch, batch=batch).cuda()
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return ids, mask


def graphed(drafter: torch.nn.Module) -> bool:
    held = getattr(drafter, "_dflash_engine", None)  # the engine the fast path keeps for its calls
    return held is not None and bool(held[1].graphs)


@pytest.mark.parametrize("family, experts", [("llama", None), ("qwen3", None), ("gpt_oss", "batched_mm"),
                                             ("mistral", None), ("qwen3_moe", "batched_mm")])
def test_graph_replayed_greedy_equals_plain_and_the_step_over_transformers_cache(family, experts):
    target = build(family, experts=experts)
    drafter = tiny_drafter(target, block_size=8).cuda()
    for batch, pads in PADDINGS:
        ids, mask = padded_batch(batch, pads)
        common = dict(attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=0)
        plain = target.generate(ids, **common)
        cached = target.generate(ids, assistant_model=drafter, dflash_fast_path=False, **common)
        fast = target.generate(ids, assistant_model=drafter, **common)
        assert graphed(drafter), (batch, pads)
        assert torch.equal(fast, plain) and torch.equal(cached, plain), (batch, pads)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_sampled_step_is_graph_replayed_and_a_seed_reproduces_it(family):
    target = build(family)
    drafter = tiny_drafter(target, block_size=8).cuda()
    ids = random_prompt(12, seed=7, batch=3).cuda()
    sampled = dict(max_new_tokens=48, do_sample=True, temperature=0.6, top_k=20, top_p=0.95, repetition_penalty=1.2)
    runs = []
    for seed in (5, 5):
        torch.manual_seed(seed)
        runs.append(target.generate(ids, assistant_model=drafter, pad_token_id=0, **sampled))
    assert graphed(drafter) and torch.equal(runs[0], runs[1])


def test_a_calls_policy_chooses_widths_between_recorded_parts():
    """`dflash_adaptive` on a GPU: the call's steps run as recorded parts at the widths its policy draws (1, 2, 4 and
    8 rows, and plain steps), the drafter's part compiled, greedy equal to plain generate; under rejection sampling a
    seed reproduces the run."""
    from tests.test_engine_policy import DrawnWidths

    target = build("qwen3")
    drafter = tiny_drafter(target, block_size=8).cuda()
    for batch, pads in PADDINGS:
        ids, mask = padded_batch(batch, pads)
        common = dict(attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=0)
        plain = target.generate(ids, **common)
        fast = target.generate(ids, assistant_model=drafter, dflash_adaptive=DrawnWidths(batch), **common)
        engine = drafter._dflash_engine[1]
        assert graphed(drafter) and {1, 2, 4, 8} <= set(engine.width_steps) and torch.equal(fast, plain)
        assert engine.compile_error is None and engine.drafter_passes  # the drafter's part recorded compiled
    sampled = dict(max_new_tokens=48, do_sample=True, temperature=0.8, pad_token_id=0, dflash_sampling="rejection")
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(target.generate(ids, attention_mask=mask, assistant_model=drafter, dflash_adaptive=DrawnWidths(9),
                                    **sampled))
    assert drafter._dflash_engine[1].draft_probs is not None and torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5", "qwen3_next"])
def test_hybrid_targets_equal_plain_greedy_with_the_step_graph_replayed(family):
    target = family_target(family, seed=3, initializer_range=0.2).cuda()
    if getattr(target.config.get_text_config(), "num_experts", 0):
        target.set_experts_implementation("batched_mm")  # graph-safe experts
    drafter = tiny_drafter(target, block_size=5).cuda()
    for batch in ({"input_ids": random_prompt(6, seed=1)}, left_pad([random_prompt(n, seed=n) for n in (4, 9, 2)])):
        batch = {key: value.cuda() for key, value in batch.items()}
        common = dict(max_new_tokens=24, do_sample=False, pad_token_id=PAD)
        plain = target.generate(**batch, **common)
        fast = target.generate(**batch, assistant_model=drafter, dflash_fast_path=True, **common)
        assert graphed(drafter) and torch.equal(fast, plain)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_bfloat16_grouped_mm_experts_record_and_replay(family):
    """The fast path takes bfloat16 experts on grouped_mm on a compute capability 9.x/10.x GPU: they must record as a
    graph (a host synchronization inside the capture would raise). bfloat16 tokens are not compared."""
    target = build(family, torch.bfloat16, experts="grouped_mm")
    drafter = tiny_drafter(target, block_size=8).to("cuda", torch.bfloat16)
    ids, mask = padded_batch(3, [0, 3, 6])
    target.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=0,
                    assistant_model=drafter, dflash_fast_path=True)
    assert graphed(drafter)


def test_eager_experts_are_refused_with_the_reason():
    target = build("qwen3_moe", experts="eager")
    drafter = tiny_drafter(target, block_size=8).cuda()
    with pytest.raises(ValueError, match="experts run 'eager'"):
        target.generate(random_prompt(12).cuda(), assistant_model=drafter, dflash_fast_path=True, max_new_tokens=4)
