"""The fast path's compiled drafter pass (dflash_engine.py, `_prepare_drafter`), run on the CPU: it drafts what the
eager pass drafts, `dflash_compile` switches it, a failed compile warns once and leaves the eager pass, and a compiled
trace reads the sdpa dispatcher's answers that the eager pass left (dflash_attention.py), as it must on a GPU.

One test compiles with inductor, as the fast path does on a GPU (CPU code from the C compiler: tens of seconds); the
others compile with dynamo's "eager" backend, which checks the same trace (one graph, no break) in a second."""

from __future__ import annotations

import pytest
import torch
from transformers.testing_utils import CaptureLogger

from hf_dflash.modeling import dflash_attention, dflash_engine
from hf_dflash.modeling.dflash_attention import grouped_attention
from hf_dflash.bench.step_cost import hold
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from tests.conftest import left_padded, random_prompt, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def traced_only(monkeypatch):
    """torch.compile uses dynamo's "eager" backend: the fast path's own trace (its options: fullgraph, fixed shapes),
    without code generation. Records each function handed to it."""
    compiled = []
    compile = torch.compile

    def compile_traced(fn, **options):
        compiled.append(fn)
        return compile(fn, **{**options, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", compile_traced)
    return compiled


def fast_generate(target, drafter, ids, mask, **kwargs):
    return target.generate(
        ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, assistant_model=drafter,
        dflash_fast_path=True, return_dict_in_generate=True, **kwargs,
    )


def test_the_inductor_compiled_drafter_pass_drafts_what_the_eager_pass_drafts():
    target = tiny_target("qwen3", seed=3)
    drafter = tiny_drafter(target, seed=4, num_layers=2, block_size=6)
    ids, mask = left_padded(1, 12, [0], seed=2)  # one row, one shape to compile (batches: the tests below)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    eager = fast_generate(target, drafter, ids, mask, dflash_compile=False)
    compiled = fast_generate(target, drafter, ids, mask, dflash_compile=True)
    assert torch.equal(eager.sequences, plain) and torch.equal(compiled.sequences, plain)
    assert compiled.acceptance_lengths == eager.acceptance_lengths
    step = drafter._dflash_engine[1]
    assert step.compile_error is None
    compiled_pass = step.drafter_passes[1]
    assert compiled_pass != step.draft  # the step ran inductor's code
    # From the call's sequence held in its engine, both passes write the same context and draft from it: float32
    # logits agree to rounding (inductor fuses and reorders reductions), and every draft is the same token.
    rows = hold(drafter, compiled.sequences, torch.ones_like(compiled.sequences)).rows
    with torch.no_grad(), grouped_attention(drafter):
        _, eager_logits = step.draft(rows)
        _, compiled_logits = compiled_pass(rows)
    torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(compiled_logits.argmax(-1), eager_logits.argmax(-1))
    release_fast_path(drafter)


def test_dflash_compile_switches_the_drafter_pass(traced_only):
    target = tiny_target("llama", seed=5)
    drafter = tiny_drafter(target, seed=6, block_size=4)
    ids, mask = left_padded(2, 9, [0, 3], seed=5)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    # the default compiles only where the step is recorded as a CUDA graph: not on a CPU
    assert torch.equal(fast_generate(target, drafter, ids, mask).sequences, plain)
    step = drafter._dflash_engine[1]
    assert not traced_only and not step.drafter_passes
    assert torch.equal(fast_generate(target, drafter, ids, mask, dflash_compile=True).sequences, plain)
    # compiled for the rows the step ran at (both sequences run to the end), before its first step there
    assert drafter._dflash_engine[1] is step and traced_only == [step.draft]
    assert sorted(step.drafter_passes) == [2] and step.draft not in step.drafter_passes.values()
    # a call that keeps the drafter eager drops the compiled pass; a later compiling call compiles it again
    assert torch.equal(fast_generate(target, drafter, ids, mask, dflash_compile=False).sequences, plain)
    assert not step.drafter_passes
    assert torch.equal(fast_generate(target, drafter, ids, mask, dflash_compile=True).sequences, plain)
    assert len(traced_only) == 2 and step.draft not in step.drafter_passes.values()
    release_fast_path(drafter)


def test_a_failed_compile_warns_once_and_the_step_runs_the_eager_drafter(monkeypatch):
    attempts = []

    def failing_compile(fn):
        def compiled(rows):
            attempts.append(fn)
            raise RuntimeError("no C compiler on this machine\nsecond line of the report")

        return compiled

    monkeypatch.setattr(dflash_engine, "compile_drafter_pass", failing_compile)
    target = tiny_target("qwen3", seed=7)
    drafter = tiny_drafter(target, seed=8, block_size=5)
    ids, mask = left_padded(1, 10, [0], seed=7)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    logger = dflash_engine.logger
    with CaptureLogger(logger) as captured:
        out = fast_generate(target, drafter, ids, mask, dflash_compile=True)
        again = fast_generate(target, drafter, ids, mask, dflash_compile=True)
    assert torch.equal(out.sequences, plain) and torch.equal(again.sequences, plain)
    assert captured.out.count("compiling the drafter's pass failed") == 1
    assert "(RuntimeError: no C compiler on this machine)" in captured.out
    assert "dflash_compile=False" in captured.out
    step = drafter._dflash_engine[1]
    assert step.compile_error == "RuntimeError: no C compiler on this machine"
    assert not step.drafter_passes
    assert len(attempts) == 1  # the held engine does not try again
    release_fast_path(drafter)


def test_a_compiled_trace_reads_the_dispatchers_answers_that_the_eager_pass_left(traced_only, monkeypatch):
    """On a GPU the grouped attention asks torch's sdpa dispatcher, whose integer answer torch.compile cannot trace.
    Here the dispatcher is asked on the CPU too (its answers kept from a fresh table), as it is on CUDA."""
    monkeypatch.setattr(dflash_attention, "FUSED_CHOICES", {})
    monkeypatch.setattr(dflash_attention, "fused_kernel_takes_grouped_heads", dflash_attention.dispatcher_takes_grouped_heads)
    target = tiny_target("qwen3", seed=9)
    drafter = tiny_drafter(target, seed=10, block_size=4)
    ids, mask = left_padded(2, 11, [0, 6], seed=9)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    out = fast_generate(target, drafter, ids, mask, dflash_compile=True)
    assert torch.equal(out.sequences, plain)
    step = drafter._dflash_engine[1]
    assert step.compile_error is None and step.draft not in step.drafter_passes.values()
    assert dflash_attention.FUSED_CHOICES  # the eager pass asked, the trace read the answer
    # Without the eager pass first, the trace meets the dispatcher itself and stops: that is why it runs first.
    monkeypatch.setattr(dflash_attention, "FUSED_CHOICES", {})
    rows = hold(drafter, out.sequences, torch.nn.functional.pad(mask, (0, 20), value=1)).rows
    unprimed = dflash_engine.compile_drafter_pass(step.draft)
    with torch.no_grad(), grouped_attention(drafter), pytest.raises(Exception, match="non-Tensor"):
        unprimed(rows)
    release_fast_path(drafter)


@pytest.mark.parametrize("case", ["sliding_drafter", "eager_attention", "rejection_sampling", "point_mass_top_k"])
def test_the_compiled_pass_is_one_graph_for_each_kind_of_step(traced_only, case):
    """The drafter's sliding masks, eager attention (boolean masks) and sampled calls trace as one graph too; with the
    "eager" backend the compiled pass computes exactly what the eager one does, so even a sampled call's tokens (same
    seed) are those of the uncompiled step."""
    target = tiny_target("llama", seed=11, **({"attn_implementation": "eager"} if case == "eager_attention" else {}))
    layout = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3) if case == "sliding_drafter" else {}
    drafter = tiny_drafter(target, seed=12, block_size=4, **layout)
    if case == "eager_attention":
        drafter.config._attn_implementation = "eager"
    sampling = {
        "rejection_sampling": dict(do_sample=True, temperature=0.8),
        "point_mass_top_k": dict(do_sample=True, top_k=20, dflash_sampling="point_mass"),
    }.get(case, dict(do_sample=False))
    ids, mask = left_padded(2, 10, [0, 4], seed=11)
    outputs = []
    for compile_drafter in (False, True):
        torch.manual_seed(0)
        outputs.append(target.generate(
            ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0, assistant_model=drafter,
            dflash_fast_path=True, dflash_compile=compile_drafter, **sampling,
        ))
    step = drafter._dflash_engine[1]
    assert step.compile_error is None and traced_only and set(traced_only) == {step.draft}
    assert step.draft not in step.drafter_passes.values()
    assert torch.equal(outputs[1], outputs[0])
    if not sampling["do_sample"]:
        plain = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert torch.equal(outputs[1], plain)
    release_fast_path(drafter)


def test_a_process_compiles_more_drafter_shapes_than_dynamos_default_limit(traced_only):
    """dynamo keeps 8 compiled versions of a function by default and, with fullgraph, raises past them; a long-lived
    process meets more row counts and spans than that, and each one still compiles."""
    target = tiny_target("qwen3", seed=13, hidden_size=48, num_attention_heads=4)  # shapes no other test compiles
    drafter = tiny_drafter(target, seed=14, block_size=4)
    shapes = set()
    run_rows = dflash_engine.DFlashEngine._run_rows

    def record(self, n, span, scoring, part=None):
        shapes.add((n, span))
        run_rows(self, n, span, scoring, part)

    dflash_engine.DFlashEngine._run_rows = record
    try:
        for batch, length in ((1, 6), (2, 6), (3, 6), (4, 6), (5, 6), (6, 6), (7, 6), (8, 6), (3, 300)):
            ids = random_prompt(length, seed=batch, batch=batch)
            target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                            pad_token_id=0, assistant_model=drafter, dflash_fast_path=True, dflash_compile=True)
            step = drafter._dflash_engine[1]
            assert step.compile_error is None and step.draft not in step.drafter_passes.values()
    finally:
        dflash_engine.DFlashEngine._run_rows = run_rows
    assert len(shapes) > 8
    release_fast_path(drafter)


def test_a_draft_vocabulary_compiles_into_the_drafter_pass_as_one_graph(traced_only):
    target = tiny_target("qwen3", seed=7)
    drafter = tiny_drafter(target, seed=8, block_size=4)
    drafter.set_draft_vocabulary(torch.arange(1, 256, 2))
    ids, mask = left_padded(2, 9, [0, 3], seed=7)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(fast_generate(target, drafter, ids, mask, dflash_compile=True).sequences, plain)
    step = drafter._dflash_engine[1]
    assert step.compile_error is None and traced_only and step.draft not in step.drafter_passes.values()
    release_fast_path(drafter)
