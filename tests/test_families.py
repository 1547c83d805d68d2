"""The family matrix: every target family a published DFlash drafter serves, built tiny from transformers' own config
classes, decodes losslessly (greedy identity in float32, batch 1 and a ragged left-padded batch), samples exactly
(chi-square), and takes the fast path where it serves the family or is refused by it with the family named.

Sliding windows are shorter than the generation (the window binds: checked) and the linear-attention targets have
linear layers before and after a full-attention one, so every kind of cache rollback runs.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hf_dflash import DFlashConfig
from hf_dflash.hub import published_drafters
from hf_dflash.modeling import dflash_fast_path_blockers
from hf_dflash.modeling.dflash_capture import decoder_layers
from hf_dflash.modeling.dflash_decoding import _cache_argument
from hf_dflash.modeling.dflash_engine import DFlashEngine
from hf_dflash.modeling.dflash_fast_path import release_fast_path
from hf_dflash.modeling.dflash_fast_path_blockers import FAST_PATH_FAMILIES
from hf_dflash.modeling.dflash_linear_state import HYBRID_FAMILIES, hybrid_blocker
from tests.conftest import VOCAB, random_prompt, tiny_drafter
from tests.test_batched import PAD, left_pad
from tests.test_fast_path import blocker_of, oracle_drafts
from tests.test_runtime_state import committed_rows, record_proposals
from tests.test_sampling import TEMPERATURE, TOP_K, chi_square_p_value, processed_probs

WINDOW = 6  # shorter than every generation below
SHAPE = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=1024,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# Qwen3-Next / Qwen3.5 layout in small: Gated DeltaNet layers around full-attention ones.
LINEAR = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)
SLIDING_AND_FULL = ["sliding_attention", "full_attention"] * 2
# Gemma 3's SigLIP vision tower in small (text-only prompts never run it)
SIGLIP = dict(
    hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4
)
VISION = dict(
    depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
    temporal_patch_size=1, num_position_embeddings=16,
)

# name -> (model_type of the config, its arguments, whether the model is a vision-language wrapper)
FAMILIES = {
    "llama": ("llama", {}, False),
    "qwen3": ("qwen3", {}, False),
    "qwen3_moe": ("qwen3_moe", MOE, False),
    # gpt-oss: MoE, attention sinks, sliding layers alternating with full ones
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=150000.0, factor=1.0, original_max_position_embeddings=1024
            ),
        ),
        False,
    ),
    "qwen3_next": ("qwen3_next", dict(MOE, **LINEAR, shared_expert_intermediate_size=32, decoder_sparse_step=1), False),
    "qwen3_5_text": ("qwen3_5_text", LINEAR, False),
    "qwen3_5": ("qwen3_5", dict(text_config=LINEAR, vision_config=VISION), True),
    "qwen3_5_moe": (
        "qwen3_5_moe",
        dict(text_config=dict(MOE, **LINEAR, shared_expert_intermediate_size=32), vision_config=VISION),
        True,
    ),
    # Mistral-style: `sliding_window` on every layer, no `layer_types`
    "mistral": ("mistral", dict(sliding_window=WINDOW), False),
    # Families users train drafters for, no published drafter. Each in the layout of its checkpoints where that
    # layout is what could break the engine: windows, per-layer RoPE, NoPE layers, softcapping, scaled embeddings.
    "qwen2": ("qwen2", {}, False),
    # Qwen2's own sliding layers (from `max_window_layers` on, when `use_sliding_window`)
    "qwen2_windowed": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2), False),
    # Gemma 3: sliding layers with their own RoPE base beside full ones, scaled embeddings, q/k norms
    "gemma3_text": ("gemma3_text", dict(sliding_window=WINDOW, layer_types=SLIDING_AND_FULL), False),
    "gemma3": (
        "gemma3",
        dict(text_config=dict(sliding_window=WINDOW, layer_types=SLIDING_AND_FULL), vision_config=SIGLIP),
        True,
    ),
    # Gemma 2: sliding and full layers, attention and final logit softcapping; loaded with eager attention, the only
    # one that applies the attention softcapping (transformers 5.17 loads it with sdpa, which drops it)
    "gemma2": (
        "gemma2", dict(sliding_window=WINDOW, layer_types=SLIDING_AND_FULL, attn_implementation="eager"), False
    ),
    "gemma": ("gemma", {}, False),
    "olmo2": ("olmo2", {}, False),
    "olmo3": ("olmo3", dict(sliding_window=WINDOW, layer_types=SLIDING_AND_FULL), False),
    # Granite: scaled embeddings, residuals, attention and logits
    "granite": (
        "granite",
        dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0),
        False,
    ),
    # SmolLM3: every fourth layer without RoPE (NoPE), as in its checkpoints (its default pad_token_id, like GLM-4's,
    # lies past the tiny vocabulary)
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 1, 1, 0], pad_token_id=None), False),
    # Cohere: parallel attention and MLP, LayerNorm, scaled logits; Cohere2: sliding layers and NoPE full ones
    "cohere": ("cohere", {}, False),
    "cohere2": ("cohere2", dict(sliding_window=WINDOW, layer_types=SLIDING_AND_FULL), False),
    "stablelm": ("stablelm", {}, False),  # partial RoPE (a quarter of each head), LayerNorm
    # StarCoder2: Mistral-style window, biases, LayerNorm
    "starcoder2": ("starcoder2", dict(sliding_window=WINDOW), False),
    "glm4": ("glm4", dict(pad_token_id=None), False),  # partial RoPE (half of each head), four norms a layer
    "glm": ("glm", dict(pad_token_id=None), False),  # GLM-4's first release: partial RoPE, two norms a layer
    "helium": ("helium", {}, False),
    "olmo": ("olmo", {}, False),  # LayerNorm without weights
    # EXAONE 4: three sliding layers with RoPE, then a full one without (NoPE), as its checkpoints' "LLLG" pattern
    "exaone4": ("exaone4", dict(sliding_window=WINDOW), False),
    "ernie4_5": ("ernie4_5", {}, False),  # interleaved RoPE, tied embeddings
    "seed_oss": ("seed_oss", {}, False),  # biases on queries, keys and values
    "arcee": ("arcee", {}, False),  # ReLU-squared MLP without a gate
    # Apertus: Llama 3 RoPE scaling as its checkpoints (original length shrunk), xIELU MLP, q/k norms
    "apertus": (
        "apertus",
        dict(rope_parameters=dict(
            rope_type="llama3", rope_theta=12000000.0, factor=8.0, original_max_position_embeddings=256,
            low_freq_factor=1.0, high_freq_factor=4.0,
        )),
        False,
    ),
    # Ministral: sliding layers beside full ones
    "ministral": ("ministral", dict(sliding_window=WINDOW, layer_types=SLIDING_AND_FULL), False),
    "phi": ("phi", {}, False),  # partial RoPE, parallel attention and MLP, LayerNorm, biases
    "nemotron": ("nemotron", {}, False),  # partial RoPE, LayerNorm with a 1 + weight, ReLU-squared MLP
    # MoE families (on a CPU, as here, any experts implementation is served)
    "qwen2_moe": ("qwen2_moe", dict(MOE, shared_expert_intermediate_size=32), False),  # gated shared expert
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2), False),  # q/k norms over all heads
    # GraniteMoE: Granite's scaled embeddings, residuals, attention and logits
    "granitemoe": (
        "granitemoe",
        dict(
            num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0, residual_multiplier=0.5,
            attention_multiplier=0.2, logits_scaling=2.0,
        ),
        False,
    ),
    # ERNIE 4.5 MoE: a dense first layer, shared experts
    "ernie4_5_moe": (
        "ernie4_5_moe", dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1), False
    ),
    # GLM-4.5 (glm4_moe) and dots.llm1 (dots1): a dense first layer, a shared expert, grouped routing
    "glm4_moe": (
        "glm4_moe",
        dict(
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, use_qk_norm=True,
        ),
        False,
    ),
    "dots1": (
        "dots1",
        dict(
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1,
        ),
        False,
    ),
}
WINDOWED = (
    "gpt_oss", "mistral", "qwen2_windowed", "gemma3_text", "gemma3", "gemma2", "olmo3", "cohere2", "starcoder2",
    "exaone4", "ministral",
)
# What the fast path serves (on a CPU without a graph, as here): every family above; gpt-oss and Gemma 2 run with
# eager attention only (sdpa drops gpt-oss's sinks and Gemma 2's softcapping: gpt-oss and, from transformers 5.25,
# Gemma 2 refuse to load with it), and the hybrid families (tests/test_hybrid_fast_path.py covers their rollback in
# depth) run here under sdpa.
HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe")
EAGER_ONLY = ("gpt_oss", "gemma2")
FAST = tuple(FAMILIES)
FAST_ATTENTION = [(family, "eager") for family in FAST if family not in HYBRID] + [
    (family, "sdpa") for family in FAST if family not in EAGER_ONLY
]

# The weight scale at which a tiny random target of the family depends strongly on its context, for the tests whose
# teeth need it (a window one off, a cache rolled back wrong, must change the output): ten times the default, except
# for Gemma, whose embeddings are scaled by sqrt(hidden_size) already and which at ten times decodes one token over
# and over, whatever the window.
GEMMA = ("gemma3_text", "gemma3", "gemma2")


def context_scale(family: str) -> float:
    return 0.02 if family in GEMMA else 0.2


def family_target(name: str, seed: int = 0, vocab_size: int = VOCAB, **overrides) -> torch.nn.Module:
    """A tiny random float32 target of family `name`, of the class its published checkpoints load as."""
    model_type, arguments, wrapped = FAMILIES[name]
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type!r} models")
    torch.manual_seed(seed)
    if wrapped:
        text = {**SHAPE, "vocab_size": vocab_size, **arguments["text_config"], **overrides}
        config = AutoConfig.for_model(model_type, text_config=text, vision_config=arguments["vision_config"])
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(config)
    else:
        config = AutoConfig.for_model(model_type, **{**SHAPE, "vocab_size": vocab_size, **arguments, **overrides})
        model = AutoModelForCausalLM.from_config(config)
    return model.float().eval()


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models are bound by per-op overhead: one thread each (see conftest.one_thread)."""


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_identity_alone(family, seed):
    target = family_target(family, seed=seed)
    drafter = tiny_drafter(target, seed=seed + 10, block_size=4 + seed)
    prompt = random_prompt(3 + 4 * seed, seed=seed)
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    # A random drafter is rejected almost always; the oracle's drafts are accepted up to each planted mistake. Without
    # eos there, so that no sequence ends before its acceptance lengths can show that (a tiny target may say eos early).
    eager = dict(assistant_model=drafter, dflash_fast_path=False)  # the matrix's transformers-cache column
    assert torch.equal(target.generate(prompt, max_new_tokens=20, do_sample=False, **eager), plain)
    endless = target.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    with oracle_drafts(endless, wrong_every=3 + seed):
        out = target.generate(
            prompt, max_new_tokens=20, do_sample=False, return_dict_in_generate=True, eos_token_id=None, **eager
        )
    assert torch.equal(out.sequences, endless)
    assert max(out.acceptance_lengths[0]) > 1 and min(out.acceptance_lengths[0]) < drafter.config.block_size


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_ragged_batch(family):
    target = family_target(family, seed=3)
    drafter = tiny_drafter(target, block_size=5)
    batch = left_pad([random_prompt(n, seed=n) for n in (4, 9, 2)])
    plain = target.generate(**batch, max_new_tokens=22, do_sample=False, pad_token_id=PAD)
    with oracle_drafts(plain, wrong_every=3):
        out = target.generate(
            **batch, max_new_tokens=22, do_sample=False, pad_token_id=PAD, assistant_model=drafter,
            return_dict_in_generate=True, dflash_fast_path=False,  # the matrix's transformers-cache column
        )
    assert torch.equal(out.sequences, plain)
    assert len({tuple(lengths) for lengths in out.acceptance_lengths}) > 1  # sequences accepted different counts


@pytest.mark.parametrize(
    "family, fast",
    [(family, False) for family in FAMILIES if family not in WINDOWED]
    + [(family, True) for family in FAMILIES if family not in WINDOWED and family not in HYBRID],
)
def test_returned_cache_continues_as_plain(family, fast):
    """The cache returned for one sequence holds the tokens plain decoding would have read: its length is plain's
    (from transformers 5.25 a Gated DeltaNet layer counts its tokens, and in hybrids layer 0 is one) and generate
    continues from it with plain's tokens (qwen3_5 places its rotary positions from that length). Over transformers'
    cache the call returns that cache, rolled back; over the pool the engine copies a sequence's keys/values into
    generate's empty one."""
    target = family_target(family, seed=2)
    drafter = tiny_drafter(target, block_size=4)
    prompt = random_prompt(6, seed=2)
    plain = target.generate(prompt, max_new_tokens=26, do_sample=False, return_dict_in_generate=True)
    argument = _cache_argument(target)
    with oracle_drafts(plain.sequences, wrong_every=3):  # every verify rejects a draft: the layers roll back
        out = target.generate(
            prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter, return_dict_in_generate=True,
            dflash_fast_path=fast,
        )
    assert min(out.acceptance_lengths[0]) < drafter.config.block_size
    cache = getattr(out, argument)
    assert cache.get_seq_length() == prompt.shape[1] + 20 - 1  # the last token is not read yet
    more = target.generate(out.sequences, max_new_tokens=6, do_sample=False, **{argument: cache})
    assert torch.equal(more, plain.sequences)


@pytest.mark.parametrize(
    "family, batch, fast",
    [("gpt_oss", 1, False), ("mistral", 1, False), ("llama", 2, False), ("mistral", 1, True), ("llama", 2, True),
     ("qwen3_next", 1, True)],
)
def test_no_cache_is_returned_where_plain_generate_could_not_continue_from_it(family, batch, fast):
    """Sliding layers were made full-history layers with their front slots dropped (gpt-oss's would then not fit its
    full layers' masks); in a batch, finished sequences left the cache and rows some sequences rejected stay in it.
    The engine hands back only the keys/values of layers that attend over their whole history: not a sliding
    window's, nor a hybrid's Gated DeltaNet states."""
    target = family_target(family, seed=2)
    out = target.generate(
        random_prompt(6, seed=2).repeat(batch, 1), max_new_tokens=12, do_sample=False,
        assistant_model=tiny_drafter(target, block_size=4), return_dict_in_generate=True, dflash_fast_path=fast,
    )
    assert getattr(out, _cache_argument(target)) is None


def test_inputs_that_would_not_reach_the_target_are_refused():
    """A multimodal wrapper's (Qwen3.5's) inputs beyond the text are refused, not decoded past as if absent; a
    text-only prompt's token-type mask (every token text) is served."""
    target = family_target("qwen3_5")
    drafter = tiny_drafter(target, block_size=4)
    prompt = random_prompt(6)
    plain = target.generate(prompt, max_new_tokens=6, do_sample=False)
    text_only = torch.zeros_like(prompt)
    ours = target.generate(
        prompt, max_new_tokens=6, do_sample=False, assistant_model=drafter, mm_token_type_ids=text_only
    )
    assert torch.equal(ours, plain)
    image_tokens = text_only.clone()
    image_tokens[0, 2] = 1
    refused = r"\['mm_token_type_ids'\] would not reach the target.*drop them, or the drafter"
    with pytest.raises(ValueError, match=refused):
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter, mm_token_type_ids=image_tokens)


@pytest.mark.parametrize("family", WINDOWED)
def test_the_window_binds(family):
    """The windowed families' outputs above depend on the window: the same weights without it decode otherwise."""
    prompt = random_prompt(4, seed=0)
    scale = context_scale(family)
    windowed = family_target(family, seed=0, initializer_range=scale).generate(
        prompt, max_new_tokens=20, do_sample=False
    )
    unwindowed = family_target(family, seed=0, initializer_range=scale, sliding_window=10_000).generate(
        prompt, max_new_tokens=20, do_sample=False
    )
    assert not torch.equal(windowed, unwindowed)


@pytest.mark.parametrize(
    "family, fast",
    [(family, False) for family in ("llama", "gpt_oss", "qwen3_next", "qwen3_5", "mistral")]
    + [
        (family, True)
        for family in ("gpt_oss", "mistral", "qwen3_moe", "qwen3_next", "qwen3_5", "gemma3_text", "gemma2", "exaone4")
    ],
)
def test_sampling_follows_the_target_distribution(family, fast):
    """Three sampled tokens after the prompt, with rejection sampling: the third often comes after a verify whose
    drafts were partly rejected, i.e. from the rolled-back transformers cache, or from slots the fast path's masks
    hide and the linear-attention states its step rolled back."""
    vocab, samples = 12, 2000
    # Weights at `context_scale`: a tiny random model then depends strongly on its context, so a cache rolled back
    # wrong changes the distribution of the third token (default-scale models barely look back).
    target = family_target(family, seed=21, vocab_size=vocab, initializer_range=context_scale(family))
    target.generation_config.eos_token_id = None  # every token of the small vocabulary is a sample, none ends it
    drafter = tiny_drafter(target, block_size=4, mask_token_id=vocab - 1)
    prompt = torch.tensor([[3, 7, 1, 4, 9, 2, 5]])  # longer than the window
    with torch.no_grad():  # exact probabilities of every (t1, t2, t3)
        first = processed_probs(target(prompt).logits[0, -1])  # (V,)
        pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # (V * V, 2)
        second = processed_probs(target(torch.cat([prompt.expand(vocab, -1), pairs[::vocab, :1]], 1)).logits[:, -1])
        third = processed_probs(target(torch.cat([prompt.expand(len(pairs), -1), pairs], 1)).logits[:, -1])
    joint = (first[:, None, None] * second[:, :, None] * third.view(vocab, vocab, vocab)).flatten()
    torch.manual_seed(0)
    out = target.generate(
        prompt.repeat(samples, 1), max_new_tokens=3, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
        assistant_model=drafter, return_dict_in_generate=True, pad_token_id=0, dflash_sampling="rejection",
        dflash_fast_path=fast,
    )
    assert any(lengths[0] < 3 for lengths in out.acceptance_lengths), "no verify step was partly rejected"
    assert any(lengths[0] > 1 for lengths in out.acceptance_lengths), "no draft was ever accepted"
    new = out.sequences[:, prompt.shape[1] :]
    counts = torch.bincount(new[:, 0] * vocab * vocab + new[:, 1] * vocab + new[:, 2], minlength=vocab**3).float()
    assert chi_square_p_value(counts, joint) > 1e-3
    # The test has teeth: the joint of a target whose cache kept one rejected row would differ this much.
    shifted = joint.view(vocab, vocab, vocab).roll(1, dims=2).flatten()
    assert chi_square_p_value(counts, 0.9 * joint + 0.1 * shifted) < 1e-3


def test_the_fast_path_families_are_the_tested_ones():
    tested = {family_target(family).config.get_text_config().model_type for family in FAST}
    assert set(FAST_PATH_FAMILIES) == tested


def fast_path_generate(target, drafter, batch: dict, reference: torch.LongTensor, wrong_every: int):
    """The fast path's greedy run on `batch` with the drafts right up to every `wrong_every`-th column of `reference`
    (acceptance then varies from 1 to B, differently per sequence)."""
    with oracle_drafts(reference, wrong_every, target.config.get_text_config().vocab_size):
        out = target.generate(
            **batch, max_new_tokens=reference.shape[1] - batch["input_ids"].shape[1], do_sample=False,
            pad_token_id=PAD, assistant_model=drafter, dflash_fast_path=True, return_dict_in_generate=True,
        )
    release_fast_path(drafter)
    return out


@pytest.mark.parametrize("family, attention", FAST_ATTENTION)
def test_fast_path_equals_plain_greedy(family, attention):
    """Batch 1 and a ragged left-padded batch of 3, prompts and generations longer than the window (the window binds,
    test_the_window_binds), with acceptance varying per sequence, under eager and sdpa attention."""
    target = family_target(family, seed=4)
    target.set_attn_implementation(attention)
    drafter = tiny_drafter(target, block_size=4)
    for batch in (left_pad([random_prompt(9, seed=4)]), left_pad([random_prompt(n, seed=n) for n in (4, 9, 2)])):
        plain = target.generate(**batch, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
        out = fast_path_generate(target, drafter, batch, plain, wrong_every=3)
        assert torch.equal(out.sequences, plain)
        assert max(max(lengths) for lengths in out.acceptance_lengths) > 1
        assert min(min(lengths) for lengths in out.acceptance_lengths) < drafter.config.block_size
    assert len({tuple(lengths) for lengths in out.acceptance_lengths}) > 1  # the batch's sequences accepted differently


@pytest.mark.parametrize("family", WINDOWED)
def test_fast_path_window_is_not_off_by_one(family):
    """The tests above have teeth on the window's edge: the fast path with a window one longer (query at p seeing
    p - W .. p) decodes otherwise, and so does one a position shorter."""
    target = family_target(family, seed=4, initializer_range=context_scale(family))
    drafter = tiny_drafter(target, block_size=4)
    batch = left_pad([random_prompt(n, seed=n) for n in (4, 9, 2)])
    plain = target.generate(**batch, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    assert torch.equal(fast_path_generate(target, drafter, batch, plain, wrong_every=3).sequences, plain)
    original_init = DFlashEngine.__init__
    for shift in (1, -1):

        def shifted_init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            self.target_window += shift

        DFlashEngine.__init__ = shifted_init
        try:
            out = fast_path_generate(target, drafter, batch, plain, wrong_every=3)
        finally:
            DFlashEngine.__init__ = original_init
        assert not torch.equal(out.sequences, plain)


def test_fast_path_refuses_a_window_the_model_does_not_apply():
    """Llama's masks ignore a `sliding_window` set on its config (only transformers' cache would drop keys past it):
    the fast path, which windows through its masks, refuses rather than guess."""
    target = family_target("llama")
    target.config.sliding_window = WINDOW
    drafter = tiny_drafter(target, block_size=4)
    with pytest.raises(ValueError, match=f"fast path.*llama target's config sets sliding_window={WINDOW} without"):
        target.generate(
            random_prompt(5), max_new_tokens=12, do_sample=False, assistant_model=drafter, dflash_fast_path=True
        )


@pytest.mark.parametrize("family, dropped", [
    # gpt-oss passes its sinks to the attention function as `s_aux` (it refuses to load with sdpa)
    ("gpt_oss", "the target has attention sinks"),
    # Gemma 2 passes its attention logit softcapping as `softcap` (transformers 5.17 loads it with sdpa, 5.25 refuses)
    ("gemma2", "the target softcaps its attention logits"),
])
def test_fast_path_refuses_sdpa_where_it_drops_what_eager_attention_applies(family, dropped):
    """Eager attention applies gpt-oss's sinks and Gemma 2's softcapping; transformers' sdpa function ignores them, so
    a config switched to sdpa after loading is refused, naming the fix."""
    target = family_target(family)
    drafter = tiny_drafter(target, block_size=4)
    assert blocker_of(target, drafter) is None
    target.config._attn_implementation = "sdpa"
    assert blocker_of(target, drafter) == (
        f"{dropped}, which 'sdpa' attention drops (load it with attn_implementation='eager')"
    )


@pytest.mark.parametrize(
    "family",
    ["qwen3_moe", "gpt_oss", "qwen3_next", "qwen2_moe", "olmoe", "granitemoe", "ernie4_5_moe", "glm4_moe", "dots1"],
)
def test_moe_experts_in_a_cuda_graph(family, monkeypatch):
    """On CUDA, MoE targets, hybrid ones included, take the fast path only with an experts implementation that stays
    on the device: eager (host-side `nonzero` per layer) is refused, batched_mm served, grouped_mm served in bfloat16
    on compute capability 9.x/10.x only, one rule for every family. On a CPU (no graph) every one is served, as the
    tests above show. CI has no GPU: the rule is asked of a CUDA device by hand."""
    target = family_target(family)
    cuda = torch.device("cuda")
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    blocker = dflash_fast_path_blockers._experts_blocker
    target.set_experts_implementation("eager")
    assert "experts run 'eager', which finds the routed experts on the host" in blocker(target, cuda)
    assert blocker(target, torch.device("cpu")) is None
    target.set_experts_implementation("batched_mm")
    assert blocker(target, cuda) is None
    target.set_experts_implementation("grouped_mm")
    assert "grouped_mm, which for torch.float32 weights on compute capability 9.0" in blocker(target, cuda)
    target.to(torch.bfloat16)
    assert blocker(target, cuda) is None
    if family in HYBRID_FAMILIES:  # nor does the hybrids' own check refuse these experts
        assert hybrid_blocker(target) is None
    capability[0] = (8, 0)
    assert "compute capability 8.0 copies its group sizes to the host" in blocker(target, cuda)
    assert blocker(family_target("llama"), cuda) is None


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "gemma3"])
def test_multimodal_wrapper_serves_its_text_model(family):
    """A ...ForConditionalGeneration target: the drafter's layers, embedding and lm_head are the text model's."""
    target = family_target(family)
    text_model = target.model.language_model
    assert decoder_layers(target) is text_model.layers
    assert target.get_input_embeddings() is text_model.embed_tokens
    assert target.get_output_embeddings() is target.lm_head


@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_layers_keep_about_a_window(family):
    """In transformers' cache (dflash_fast_path=False) a sliding layer keeps full history only while some sequence
    can still see it: after 40 tokens it holds about W + B slots, a full-attention layer all of them."""
    target = family_target(family, seed=5)
    drafter = tiny_drafter(target, block_size=4)
    prompt = random_prompt(5, seed=5)
    cache = DynamicCache(config=target.config)  # passed in, as generate does not return it for a sliding target
    target.generate(
        prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter, dflash_fast_path=False,
        **{_cache_argument(target): cache},
    )
    text = target.config.get_text_config()
    kinds = getattr(text, "layer_types", None) or ["sliding_attention"] * len(cache.layers)  # Mistral-style
    for kind, layer in zip(kinds, cache.layers):
        slots = layer.keys.shape[2]
        if kind == "sliding_attention":
            assert slots <= WINDOW + drafter.config.block_size
        else:
            assert slots >= prompt.shape[1] + 40 - drafter.config.block_size


def reference_draft_logits(target, drafter, context: torch.Tensor, anchor: int) -> torch.Tensor:
    """The published drafters' attention restated plainly (z-lab's reference, vLLM): context rows at positions
    0..c-1, the block at c..c+B-1; a full layer's rows see everything, a sliding layer's row at position p sees
    positions p - W + 1 .. p only. context (c, k*H) -> draft logits (B - 1, V)."""
    block = drafter.config.block_size
    rows = context.shape[0] + block
    query = torch.arange(context.shape[0], rows)[:, None]
    behind = query - torch.arange(rows)[None, :]  # (B, c + B)
    sliding = (behind >= 0) & (behind < drafter.config.sliding_window)
    block_ids = torch.tensor([[anchor] + [drafter.config.mask_token_id] * (block - 1)])
    hidden = drafter(
        noise_embeds=target.get_input_embeddings()(block_ids),
        context_hidden_states=context[None],
        position_ids=torch.arange(rows)[None],
        attention_mask={"full_attention": None, "sliding_attention": sliding[None, None]},
    ).last_hidden_state
    return target.get_output_embeddings()(hidden[0, 1:])


@pytest.mark.parametrize("fast", [False, True], ids=["transformers-cache", "pool"])
def test_drafter_sliding_window_matches_the_reference(fast, monkeypatch):
    """A drafter with a sliding layer whose window binds (3 < context + block) drafts, in the engine's step, exactly
    the logits of the reference semantics over the committed context, step after step in a ragged batch, wherever the
    target keeps its keys/values; the same weights unwindowed would draft otherwise."""
    target = family_target("qwen3", seed=6)
    layout = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    drafter = tiny_drafter(target, seed=7, num_layers=2, block_size=4, **layout)
    unwindowed = tiny_drafter(target, seed=7, num_layers=2, block_size=4, **dict(layout, sliding_window=100))
    batch = left_pad([random_prompt(n, seed=n) for n in (7, 3)])
    pads = (batch["attention_mask"] == 0).sum(dim=1).tolist()
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    plain = target.generate(**batch, **kwargs)
    recorded = record_proposals(monkeypatch)
    out = target.generate(**batch, assistant_model=drafter, dflash_fast_path=fast, **kwargs)
    release_fast_path(drafter)
    assert torch.equal(out, plain)
    rows = [row for step in recorded for row in step]
    assert len(recorded) > 3 and {row.key for row in rows} == {0, 1}
    for row, context in committed_rows(recorded, plain, pads, target, drafter):
        with torch.no_grad():
            expected = reference_draft_logits(target, drafter, context, row.anchor_id)
            torch.testing.assert_close(row.logits, expected, rtol=1e-4, atol=1e-4)
            if row.anchor_pos > 3:  # the context reaches past the window
                assert not torch.allclose(reference_draft_logits(target, unwindowed, context, row.anchor_id),
                                          expected, atol=1e-3)


def published_target_family(target_name: str) -> str:
    """The family of a published drafter's target, by its Hub name."""
    name = target_name.lower()
    for marker, family in (
        ("llama", "llama"), ("gpt-oss", "gpt_oss"), ("coder-next", "qwen3_next"), ("coder-30b", "qwen3_moe"),
        ("-a3b", "qwen3_5_moe"), ("-a10b", "qwen3_5_moe"), ("qwen3.5", "qwen3_5"), ("qwen3.6", "qwen3_5"),
    ):
        if marker in name:
            return family
    return "qwen3"


@pytest.mark.parametrize("repo_id", sorted(published_drafters()))
def test_published_layout_runs_on_its_target_family(repo_id):
    """Each published drafter's layout (depth, layer_types, RoPE, attention bias, block size; widths shrunk and a
    window of 5 so that it binds) drafts for a tiny target of its target's family, losslessly."""
    entry = published_drafters()[repo_id]
    published = DFlashConfig(**entry.config)
    target = family_target(published_target_family(entry.target), seed=8)
    drafter = tiny_drafter(
        target, seed=9, num_layers=published.num_hidden_layers, block_size=published.block_size,
        layer_types=published.layer_types, sliding_window=5 if published.sliding_window else None,
        rope_parameters=published.rope_parameters, attention_bias=published.attention_bias,
    )
    prompt = random_prompt(6, seed=8)
    plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
    with oracle_drafts(plain, wrong_every=5):
        out = target.generate(
            prompt, max_new_tokens=16, do_sample=False, assistant_model=drafter, return_dict_in_generate=True
        )
    assert torch.equal(out.sequences, plain)
    assert drafter.config.layer_types == published.layer_types


def test_a_rope_that_changes_with_length_is_warned_about():
    """`dynamic` and `longrope` RoPE rotate a forward otherwise once it reaches a length, which a verify block reaches
    before plain decoding does: a call that can get there is warned about (the call still runs), one that stays a block
    short of it is not."""
    from types import SimpleNamespace

    from transformers.testing_utils import CaptureLogger

    from hf_dflash.modeling import dflash_checks

    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    target = family_target("llama", max_position_embeddings=64, rope_parameters=dynamic)
    drafter = tiny_drafter(target, block_size=4, max_position_embeddings=128)  # room past the target's 64
    prompt = random_prompt(8)
    with CaptureLogger(dflash_checks.logger) as captured:  # 52 + a block of 4 stays below 64
        target.generate(prompt, max_new_tokens=44, do_sample=False, assistant_model=drafter)
    assert "RoPE" not in captured.out
    with CaptureLogger(dflash_checks.logger) as captured:
        target.generate(prompt, max_new_tokens=56, do_sample=False, assistant_model=drafter)
    assert "dynamic RoPE changes its frequencies once a forward passes 64 positions" in captured.out
    assert "a max_length of at most 60 keeps them identical" in captured.out

    longrope = SimpleNamespace(
        rope_parameters={"rope_type": "longrope", "original_max_position_embeddings": 32}, max_position_embeddings=128
    )
    assert dflash_checks.rope_switch_problem(longrope, 10, 20, 16) is not None  # 20 + 16 passes 32
    assert dflash_checks.rope_switch_problem(longrope, 10, 16, 16) is None
    assert dflash_checks.rope_switch_problem(longrope, 40, 60, 16) is None  # the prompt took the long factors already
    per_layer_type = SimpleNamespace(
        rope_parameters={"full_attention": dynamic, "sliding_attention": {"rope_type": "default"}},
        max_position_embeddings=64,
    )
    assert "dynamic" in dflash_checks.rope_switch_problem(per_layer_type, 10, 60, 16)
