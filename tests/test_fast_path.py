"""The fast path (dflash_fast_path.py: a generate call's rows on the engine), run on the CPU without a graph: the same
buffers and the same step function a CUDA graph records, so its logic is checked here and only the capture is left to
the GPU tests (tests/test_fast_path_gpu.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers.testing_utils import CaptureLogger

from hf_dflash.modeling import dflash_decoding, dflash_fast_path, dflash_fast_path_blockers
from hf_dflash.modeling.dflash_proposer import DFlashProposer
from hf_dflash.modeling.dflash_engine import DFlashEngine, bucket_size
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from hf_dflash.modeling.dflash_fast_path_blockers import takes_fast_path
from tests.conftest import left_padded, random_prompt, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


class OracleHead(torch.nn.Module):
    """Stands in for the lm_head inside the engine's step: its argmax is the reference continuation of each sequence
    (read from the engine's own device state and its rows' sequences), wrong at every `wrong_every`-th column, so
    acceptance varies from 1 to B and differs between sequences."""

    def __init__(self, engine: DFlashEngine, reference: torch.LongTensor, wrong_every: int, vocab: int | None = None):
        super().__init__()
        self.engine, self.reference, self.wrong_every = engine, reference, wrong_every
        self.vocab = vocab or engine.vocab_size
        self.weight = engine.proposer.lm_head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows, drafts = hidden.shape[:2]
        keys = [sequence.key for sequence in self.engine.sequences]
        sequences = torch.tensor(keys + [0] * (rows - len(keys)))  # idle rows of a padded step read sequence 0
        # padded column of the token at position anchor + k, k = 1..B-1
        columns = self.engine.padding[:rows, None] + self.engine.anchor_pos[:rows, None] + 1 + torch.arange(drafts)
        clipped = columns.clamp(max=self.reference.shape[1] - 1)
        tokens = self.reference[sequences].gather(1, clipped)
        wrong = ((columns + sequences[:, None]) % self.wrong_every == 0) | (columns != clipped)
        tokens = torch.where(wrong, (tokens + 1) % 200, tokens)
        return torch.nn.functional.one_hot(tokens, self.vocab).float()


@contextlib.contextmanager
def oracle_drafts(reference: torch.LongTensor, wrong_every: int, vocab: int | None = None):
    """The fast path's drafts (the engine's `propose`, at full-width steps and at chosen widths alike) come from
    `OracleHead`."""
    original = DFlashEngine.propose

    def propose(self, rows, *args):
        real_head = self.proposer.lm_head
        self.proposer.lm_head = OracleHead(self, reference, wrong_every, vocab)
        try:
            return original(self, rows, *args)
        finally:
            self.proposer.lm_head = real_head

    DFlashEngine.propose = propose
    try:
        yield
    finally:
        DFlashEngine.propose = original


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("wrong_every", [3, 1000])
def test_the_fast_path_equals_plain_greedy_with_varied_acceptance(family, wrong_every):
    target = tiny_target(family)
    drafter = tiny_drafter(target, block_size=5)
    ids, mask = left_padded(3, 10, [0, 4, 7])
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    with oracle_drafts(reference, wrong_every, target.config.vocab_size):
        out = target.generate(
            ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0, assistant_model=drafter,
            dflash_fast_path=True, return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences, reference)
    taus = [sum(lengths) / len(lengths) for lengths in out.acceptance_lengths]
    if wrong_every == 1000:
        assert min(taus) > 4  # almost every draft accepted
    else:
        assert max(max(lengths) for lengths in out.acceptance_lengths) > 1
    release_fast_path(drafter)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("prefill_chunk", [None, 5])
def test_the_drafts_are_the_same_wherever_the_targets_keys_and_values_live(family, prefill_chunk):
    """The drafter proposes the same drafts, step after step, whether the target keeps its keys/values in the engine's
    pool or in transformers' cache (`dflash_fast_path=False`): the context the target's forwards capture is the same
    (prefilled left-aligned without padding into the pool, or padded as plain generate does into transformers'
    cache), also once the first sequence has ended and the others moved up to its rows (their drafter keys/values and
    their transformers cache rows move with them). Into the pool the call's prompts (12, 7 and 10 tokens) are
    prefilled together: in one forward, or in chunks of `prefill_chunk` positions where the rows' prompts end in
    different chunks; the positions a shorter prompt's padding ran at are written again before any step reads them."""
    target = tiny_target(family, seed=3)
    drafter = tiny_drafter(target, seed=4, num_layers=2, block_size=6)
    ids, mask = left_padded(3, 12, [0, 5, 2], seed=2)
    shapes = []
    handle = target.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    free_run = target.generate(
        ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    eos = int(free_run[0, 12 + 3])  # the first sequence ends with its fourth new token, the others run on
    assert not (free_run[1:, 12:] == eos).any()
    draft_logits = {}
    original_init = DFlashProposer.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        head, calls = self.lm_head, draft_logits.setdefault(len(draft_logits), [])

        def record(hidden):
            logits = head(hidden)
            if hidden.shape[1] > 1:  # drafts, not a prefill
                calls.append(logits.detach().clone())
            return logits

        self.lm_head = record
        self.lm_head.weight = head.weight

    DFlashProposer.__init__ = recording_init
    try:
        outputs = []
        for fast in (False, True):
            if fast and prefill_chunk is not None:  # the engine the call will find held on the drafter
                dflash_fast_path.engine_for(target, drafter, 3, 12 + 24).prefill_chunk = prefill_chunk
            shapes.clear()  # the fast call's forwards are left
            outputs.append(target.generate(
                ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=eos,
                assistant_model=drafter, dflash_fast_path=fast,
            ))
    finally:
        DFlashProposer.__init__ = original_init
        handle.remove()
        release_fast_path(drafter)
    assert torch.equal(outputs[0], outputs[1])
    assert shapes[:3] == ([(3, 12), (3, 6), (3, 6)] if prefill_chunk is None else [(3, 5), (3, 5), (3, 2)])
    cached, engine = draft_logits[0], draft_logits[1]  # over transformers' cache, over the pool
    # Both drop a finished sequence from the batch at once (the engine runs at 2 rows once 2 sequences run): every
    # step's rows are the same sequences in both, the last one moved into the place of the one that ended.
    assert len(cached) == len(engine) and [logits.shape[0] for logits in cached] == [logits.shape[0] for logits in engine]
    assert sum(logits.shape[0] == 2 for logits in cached) > 3, "the first sequence should end steps before the others"
    for cached_step, engine_step in zip(cached, engine):
        order = [[torch.allclose(e, g, atol=1e-5, rtol=1e-5) for g in engine_step].index(True) for e in cached_step]
        assert sorted(order) == list(range(len(cached_step)))
        torch.testing.assert_close(engine_step[order], cached_step, atol=1e-5, rtol=1e-5)


def test_the_fast_path_stops_at_eos_and_max_length_like_plain_generate():
    target = tiny_target("llama", seed=5)
    drafter = tiny_drafter(target, block_size=4)
    ids, mask = left_padded(3, 8, [0, 2, 5], seed=5)
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    eos = int(reference[1, 8 + 6])  # a token row 1 emits early: rows end at different steps
    for kwargs in (dict(max_new_tokens=40, eos_token_id=eos), dict(max_new_tokens=13), dict(max_new_tokens=1)):
        plain = target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, **kwargs)
        with oracle_drafts(reference, 5, target.config.vocab_size):
            fast = target.generate(
                ids, attention_mask=mask, do_sample=False, pad_token_id=0, assistant_model=drafter,
                dflash_fast_path=True, **kwargs,
            )
        assert torch.equal(fast, plain), kwargs
    release_fast_path(drafter)


def test_the_engine_is_reused_across_calls_and_rebuilt_for_a_new_shape():
    target = tiny_target("qwen3", seed=6)
    drafter = tiny_drafter(target, block_size=4)
    prompts = [random_prompt(n, seed=n) for n in (5, 9, 9)]
    held = []
    for ids in prompts:
        plain = target.generate(ids, max_new_tokens=12, do_sample=False)
        fast = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter, dflash_fast_path=True)
        assert torch.equal(fast, plain)
        held.append(drafter._dflash_engine[1])
    assert held[0] is held[1] is held[2]  # one length bucket, one set of buffers
    batch = random_prompt(6, seed=1, batch=2)
    target.generate(batch, max_new_tokens=4, do_sample=False, assistant_model=drafter, dflash_fast_path=True)
    assert drafter._dflash_engine[1] is not held[0]
    release_fast_path(drafter)
    assert drafter._dflash_engine is None


def test_insisting_on_the_fast_path_names_what_blocks_it():
    target = tiny_target("llama")
    target.set_attn_implementation("flex_attention")
    drafter = tiny_drafter(target)
    with pytest.raises(
        ValueError, match="dflash_fast_path=True, but .*'flex_attention' attention .*attn_implementation='sdpa'"
    ):
        target.generate(random_prompt(5), max_new_tokens=4, assistant_model=drafter, dflash_fast_path=True)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_the_engine_verifies_at_most_dflash_verify_rows_and_equals_plain_greedy(family):
    """A call's `dflash_verify_rows` caps the engine's steps (run eagerly at that width); the oracle's drafts are
    accepted up to the cap, never past it."""
    from tests.test_families import family_target  # it imports this file's oracle (through test_batched)

    target = family_target(family)
    drafter = tiny_drafter(target, block_size=6)
    ids, mask = left_padded(3, 8, [0, 3, 5])
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    with oracle_drafts(reference, 7, target.config.get_text_config().vocab_size):
        out = target.generate(
            ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, assistant_model=drafter,
            dflash_fast_path=True, dflash_verify_rows=3, return_dict_in_generate=True,
        )
    assert torch.equal(out.sequences, reference)
    lengths = [taken for row in out.acceptance_lengths for taken in row]
    assert max(lengths) == 3  # drafts were accepted, and no step verified more than 3 rows
    engine = drafter._dflash_engine[1]
    assert set(engine.width_steps) <= {1, 2, 3} and engine.width_steps[3] > 0
    release_fast_path(drafter)


def test_an_untested_target_family_is_not_served_by_the_fast_path():
    from transformers import Phi3Config, Phi3ForCausalLM

    target = Phi3ForCausalLM(Phi3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=None,  # its default lies past the tiny vocabulary
    )).eval()
    drafter = tiny_drafter(target)
    ids = random_prompt(6)
    forwards = []
    handle = target.register_forward_pre_hook(lambda *args: forwards.append(1))
    with pytest.raises(ValueError, match="the fast path is tested with llama, .* targets, not 'phi3'"):
        target.generate(ids, max_new_tokens=4, assistant_model=drafter, dflash_fast_path=True)
    handle.remove()
    assert not forwards, "the refusal came after a forward"
    plain = target.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=drafter), plain)


def test_right_padding_is_refused_before_any_forward():
    """Plain generate reads a right-padded row's next token at a pad and numbers its new tokens from the pad's position
    (tests/test_fast_path_masks.py shows its tokens differ from the compacted row's); neither DFlash loop reproduces
    that, so generate refuses it, naming the fix."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    ids = random_prompt(6, batch=2)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    for fast in (None, False, True):
        with pytest.raises(ValueError, match="a row of the attention mask ends in padding.*pad prompts on the left"):
            target.generate(ids, attention_mask=mask, max_new_tokens=4, assistant_model=drafter, dflash_fast_path=fast)


# What the models' generation_config.json files set: Qwen3 (-8B, -4B, ...) and Llama-3.1-Instruct.
CHAT_DEFAULTS = {
    "qwen3": dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95),
    "llama": dict(do_sample=True, temperature=0.6, top_p=0.9),
}


@pytest.mark.parametrize("family", sorted(CHAT_DEFAULTS))
def test_a_chat_models_default_call_is_served_by_the_fast_path(family, monkeypatch):
    """A plain generate call on a chat model samples under its generation_config; on a GPU it takes the fast path.
    The decision is taken as on a GPU (the step then runs without a graph here)."""
    target = tiny_target(family)
    target.generation_config.update(**CHAT_DEFAULTS[family])
    drafter = tiny_drafter(target)
    blockers, replays = [], []
    decide = dflash_decoding.takes_fast_path
    monkeypatch.setattr(
        dflash_decoding, "takes_fast_path",
        lambda insist, blocker, device: blockers.append(blocker) or decide(insist, blocker, torch.device("cuda")),
    )
    run_step = DFlashEngine.run_step
    monkeypatch.setattr(DFlashEngine, "run_step", lambda self: replays.append(1) or run_step(self))
    out = target.generate(random_prompt(6, batch=2), max_new_tokens=12, assistant_model=drafter, pad_token_id=0)
    release_fast_path(drafter)
    assert blockers == [None]
    assert replays and out.shape == (2, 18)


def test_a_gpu_call_off_the_fast_path_says_why_once():
    logger = dflash_fast_path_blockers.logger
    cuda = torch.device("cuda")
    with CaptureLogger(logger) as captured:
        assert not takes_fast_path(None, "a made-up reason (test of the warning)", cuda)
        assert not takes_fast_path(None, "a made-up reason (test of the warning)", cuda)
        assert not takes_fast_path(False, "a made-up reason (test of the warning)", cuda)  # chosen: silent
        assert not takes_fast_path(None, "a made-up reason (test of the warning, on a CPU)", torch.device("cpu"))
    assert captured.out.count("keeps the target's keys/values in transformers' cache") == 1
    assert "because a made-up reason (test of the warning)" in captured.out
    cpu = torch.device("cpu")
    assert takes_fast_path(None, None, cuda) and takes_fast_path(None, None, cpu) and takes_fast_path(True, None, cpu)
    with pytest.raises(ValueError, match="dflash_fast_path=True, but the fast path cannot serve this call: why"):
        takes_fast_path(True, "why", cuda)


def blocker_of(target, drafter):
    return dflash_fast_path_blockers.fast_path_blocker(target, drafter, torch.ones(1, 4, dtype=torch.long))


def write_tiny_llama_gguf(path, vocab: int = 256, hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2):
    """A float32 Llama checkpoint in GGUF, the way llama.cpp names its tensors (random weights)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}".encode() for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([1] * vocab)
    generator = np.random.default_rng(0)
    kv = kv_heads * hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv, hidden),
            f"blk.{i}.attn_v.weight": (kv, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_gate.weight": (2 * hidden, hidden), f"blk.{i}.ffn_up.weight": (2 * hidden, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, 2 * hidden),
        })
    for name, shape in shapes.items():
        writer.add_tensor(name, (generator.standard_normal(shape) * 0.1).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_target_loaded_from_gguf_takes_the_fast_path(tmp_path):
    """transformers marks a GGUF checkpoint quantized (hf_quantizer, quantization_config) although it loads it as
    dense float weights: the fast path serves it, with plain generate's tokens."""
    from transformers import AutoModelForCausalLM

    write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    target = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    assert target.hf_quantizer is not None and target.config.quantization_config is not None
    drafter = tiny_drafter(target)
    assert blocker_of(target, drafter) is None
    ids = random_prompt(6, seed=3)
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    fast = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter, dflash_fast_path=True)
    assert torch.equal(fast, plain)
    release_fast_path(drafter)
    # GGUF weights kept in their packed blocks (integer tensors) are not dense
    target.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(
        torch.zeros(64, 32, dtype=torch.uint8), requires_grad=False
    )
    assert "quantized (gguf)" in blocker_of(target, drafter)


def test_a_bitsandbytes_target_takes_the_pool_and_other_quantizers_transformers_cache(tmp_path):
    """bitsandbytes' layers compute each verify row on its own (tests/test_quantized.py checks the tokens with either
    home of the target's keys/values), so the engine's pool serves them, its steps never recorded as a graph; a
    quantizer we have not tested keeps transformers' cache, with its name."""
    from tests.test_quantized import quantized_target

    target = quantized_target(tmp_path, "llama", "nf4")
    drafter = tiny_drafter(target)
    assert blocker_of(target, drafter) is None
    assert dflash_fast_path_blockers.bitsandbytes_quantized(target)
    dense = tiny_target("llama")
    assert not dflash_fast_path_blockers.bitsandbytes_quantized(dense)
    dense.config.quantization_config = {"quant_method": "awq"}
    assert blocker_of(dense, tiny_drafter(dense)) == (
        "the target is quantized (awq); the paged cache is tested with bitsandbytes' quantized layers only"
    )


def test_finished_sequences_leave_the_engines_batch(monkeypatch):
    """Sequences that end early (their own eos, at different steps) leave the engine's rows the step they end: the
    step runs at fewer rows as they finish and every sequence still equals plain greedy generate; a second call on
    the held engine is exact too, and each call gives every page back."""
    target = tiny_target("qwen3", seed=9)
    drafter = tiny_drafter(target, block_size=4)
    ids, mask = left_padded(8, 9, [0, 3, 1, 5, 0, 2, 4, 6], seed=9)
    reference = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    # an eos each row meets at a different point of its own continuation (or never)
    eos = int(reference[5, 9 + 3])
    batches = []
    run_step = DFlashEngine.run_step
    monkeypatch.setattr(DFlashEngine, "run_step", lambda self: batches.append(len(self.sequences)) or run_step(self))
    plain = target.generate(
        ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=eos
    )
    with oracle_drafts(reference, 3, target.config.vocab_size):
        fast = target.generate(
            ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=eos,
            assistant_model=drafter, dflash_fast_path=True,
        )
    lengths = (plain != 0).sum(dim=1)
    assert len(set(lengths.tolist())) > 2, "the rows should end at different steps"
    assert torch.equal(fast, plain)
    assert batches[0] == 8 and min(batches) < 8 and batches == sorted(batches, reverse=True)
    engine = drafter._dflash_engine[1]
    assert not engine.sequences and engine.compute_free_capacity() == 1.0
    # a second call reuses the held engine, whose rows moved as sequences ended, and is still exact
    again = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0,
                            eos_token_id=eos, assistant_model=drafter, dflash_fast_path=True)
    assert torch.equal(again, plain)
    assert drafter._dflash_engine[1] is engine and engine.compute_free_capacity() == 1.0
    release_fast_path(drafter)


@pytest.mark.parametrize("running, batch, expected", [(8, 8, 8), (5, 8, 8), (4, 8, 4), (3, 8, 4), (1, 8, 1), (6, 6, 6), (4, 6, 4)])
def test_bucket_sizes(running, batch, expected):
    assert bucket_size(running, batch) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [1.0, 0.7])
def test_the_drafters_rotary_embedding_is_the_rotate_half_formula_bit_for_bit(dtype, scaling):
    """The drafter rotates by a roll against a sign-carrying sin table (fewer kernels per step); its values are those
    of the textbook formula x * cos + [-x2, x1] * sin over cat(freqs, freqs) tables, exactly."""
    from hf_dflash.modeling.modeling_dflash import apply_rotary

    target = tiny_target("qwen3", seed=3)
    rotary = tiny_drafter(target, seed=4).rotary_emb
    rotary.attention_scaling = scaling
    positions = torch.randint(0, 5000, (2, 7), generator=torch.Generator().manual_seed(1))
    x = torch.randn(2, 3, 7, rotary.inv_freq.numel() * 2, generator=torch.Generator().manual_seed(2)).to(dtype)
    cos, signed_sin = rotary(x, positions)
    freqs = positions[..., None].float() * rotary.inv_freq
    table = torch.cat((freqs, freqs), dim=-1)
    ref_cos, ref_sin = (table.cos() * scaling).to(dtype)[:, None], (table.sin() * scaling).to(dtype)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    expected = x * ref_cos + torch.cat((-x2, x1), dim=-1) * ref_sin
    assert torch.equal(apply_rotary(x, cos, signed_sin), expected)
    assert not torch.equal(apply_rotary(x, cos, signed_sin.abs()), expected)  # the sign matters, so this can fail
