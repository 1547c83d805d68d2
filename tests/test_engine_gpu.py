"""The continuous-batching engine on a GPU (skipped without one): the same manager and schedules as
test_continuous_batching.py, with the target, the drafter and both page pools on CUDA.

CI runs the engine on the CPU; these run it as a GPU runs it: `python3 -m pytest -q tests/test_engine_gpu.py` on a
GPU machine (benchmarks/gpu/README.md). In float32, on tiny random Llama, Qwen3 and Qwen3.5 (hybrid) targets, with
the steps recorded as CUDA graphs (the default on a GPU) and run eagerly: staggered arrivals, a cancellation, eos
inside a block and requests waiting for pages all equal each request's own plain greedy generate on the same GPU, the
drafter ran, and both pools are whole afterwards; a seeded sampled run repeats with its steps graph-replayed.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_dflash.modeling.dflash_continuous import DFlashContinuousBatchingManager
from tests.conftest import random_prompt, tiny_drafter, tiny_target
from tests.test_families import family_target
from tests.test_continuous_batching import FIXED_PLANS, GREEDY, run_schedule, schedule

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine on CUDA needs a GPU")


@torch.no_grad()
def plain_greedy(target: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5_text"])
@pytest.mark.parametrize("max_tokens", [None, 96])  # 96: requests wait for pages while others run
@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_requests_equal_plain_greedy_on_the_gpu(family, max_tokens, graphs):
    target = (tiny_target(family) if family != "qwen3_5_text" else family_target(family, seed=3)).cuda()
    drafter = tiny_drafter(target).cuda()
    manager = DFlashContinuousBatchingManager(target, drafter, GREEDY, max_batch_size=3, max_tokens=max_tokens,
                                              static_shapes=graphs)
    arrivals, cancels, expected, _ = schedule(FIXED_PLANS, lambda prompt, new: plain_greedy(target, prompt, new))
    outputs, scheduler, _ = run_schedule(manager, arrivals, cancels)
    cancelled = {request_id for ids in cancels.values() for request_id in ids}
    for request_id, reference in expected.items():
        for output in outputs.get(request_id, []):
            assert output.error is None, output.error
            assert output.generated_tokens == reference[: len(output.generated_tokens)], request_id
        if request_id not in cancelled:
            assert outputs[request_id][-1].generated_tokens == reference, request_id
    assert manager.engine.anchor_ids.is_cuda and manager.engine.row_steps > 0
    assert bool(manager.engine.graphs) == graphs  # shapes seen twice were recorded and replayed
    usage = manager.engine.pool_usage()
    assert usage["target_pages_used"] == usage["drafter_pages_used"] == 0


def test_a_seeded_sampled_run_repeats_on_the_gpu():
    target = tiny_target("qwen3").cuda()
    drafter = tiny_drafter(target).cuda()
    sampled = GenerationConfig(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=24,
                               eos_token_id=-1, pad_token_id=0)
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (5, 13, 8)]
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        manager = DFlashContinuousBatchingManager(target, drafter, sampled, max_batch_size=4)
        arrivals = {0: [dict(input_ids=prompt, request_id=f"r{i}") for i, prompt in enumerate(prompts)]}
        outputs, _, _ = run_schedule(manager, arrivals, {})
        runs.append({key: got[-1].generated_tokens for key, got in outputs.items()})
        assert manager.engine.graphs  # the sampled steps were graph-replayed
    assert runs[0] == runs[1] and all(len(tokens) == 24 for tokens in runs[0].values())


def test_warmup_records_every_row_bucket_and_requests_then_replay_only():
    target = tiny_target("qwen3").cuda()
    drafter = tiny_drafter(target).cuda()
    manager = DFlashContinuousBatchingManager(target, drafter, GREEDY, max_batch_size=6)
    manager.warmup()
    engine = manager.engine
    recorded = set(engine.graphs)
    assert {rows for _, rows, _, _ in recorded} == {1, 2, 4, 6}  # every row bucket of 6 rows, recorded ahead
    prompts = [random_prompt(n, seed=n)[0].tolist() for n in (5, 13, 8, 21, 3)]
    arrivals = {0: [dict(input_ids=prompt, request_id=f"r{i}") for i, prompt in enumerate(prompts)]}
    outputs, _, _ = run_schedule(manager, arrivals, {})
    for i, prompt in enumerate(prompts):
        new = len(outputs[f"r{i}"][-1].generated_tokens)
        assert outputs[f"r{i}"][-1].generated_tokens == plain_greedy(target, prompt, new)
    assert set(engine.graphs) == recorded and engine.row_steps > 0  # the steps replayed what warmup recorded
    usage = engine.pool_usage()
    assert usage["target_pages_used"] == usage["drafter_pages_used"] == 0


@pytest.mark.parametrize("family", ["llama", "qwen3_5_text"])
def test_a_policy_chooses_each_width_between_recorded_parts_on_the_gpu(family):
    """The verify policy on a GPU: each step runs as recorded parts (the drafter's, then the verify at the chosen
    width's bucket, or a plain step), drawn widths of every bucket; each request equals its plain greedy."""
    from hf_dflash.modeling.dflash_engine import StepPart
    from tests.test_engine_policy import DrawnWidths

    target = (tiny_target(family) if family != "qwen3_5_text" else family_target(family, seed=3)).cuda()
    drafter = tiny_drafter(target).cuda()
    manager = DFlashContinuousBatchingManager(target, drafter, GREEDY, max_batch_size=3, adaptive=DrawnWidths(4))
    manager.warmup()
    engine = manager.engine
    recorded = set(engine.graphs)
    arrivals, cancels, expected, _ = schedule(FIXED_PLANS, lambda prompt, new: plain_greedy(target, prompt, new))
    outputs, _, _ = run_schedule(manager, arrivals, cancels)
    cancelled = {request_id for ids in cancels.values() for request_id in ids}
    for request_id, reference in expected.items():
        if request_id not in cancelled:
            assert outputs[request_id][-1].generated_tokens == reference, request_id
    block = drafter.config.block_size
    assert engine.use_graphs and {StepPart("draft", block), StepPart("plain", 1)} <= {shape[0] for shape in recorded}
    assert {1, 2, 4} <= set(engine.width_steps) and set(engine.graphs) == recorded  # replays only after warmup
    usage = engine.pool_usage()
    assert usage["target_pages_used"] == usage["drafter_pages_used"] == 0
