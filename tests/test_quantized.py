"""bitsandbytes targets (4-bit nf4 / fp4, 8-bit) on CPU: capture reads the quantized layers, and greedy DFlash output
equals the same quantized target's own greedy generate, with drafts accepted, its keys/values in the engine's pool or
in transformers' cache."""

from __future__ import annotations

import logging

import bitsandbytes as bnb
import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from hf_dflash import DFlashProposer
from tests.conftest import random_prompt, tiny_drafter, tiny_target
from tests.test_batched import PAD, left_pad
from tests.test_fast_path import oracle_drafts

# 8-bit matmuls log a cast warning per call on CPU.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

QUANTIZATIONS = {
    "nf4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "fp4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float32),
    # LLM.int8's outlier columns (llm_int8_threshold, default 6.0) are chosen over all rows of a forward, so a verify
    # can round differently from a one-row decode step; without them every row is quantized on its own.
    "int8": BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0),
}


def quantized_target(tmp_path, family: str, quantization: str) -> torch.nn.Module:
    # Hidden 64 and intermediate 128 are multiples of bitsandbytes' 4-bit block of 64.
    tiny_target(family, seed=31).save_pretrained(tmp_path)
    config = QUANTIZATIONS[quantization]
    return AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, device_map="cpu").eval()


@pytest.mark.parametrize("fast_path", [False, True], ids=["transformers-cache", "pool"])
@pytest.mark.parametrize(
    "family, quantization, drafter_dtype",
    [("llama", "nf4", torch.bfloat16), ("qwen3", "fp4", torch.float32), ("llama", "int8", torch.bfloat16)],
)
def test_quantized_target_is_lossless(tmp_path, family, quantization, drafter_dtype, fast_path):
    target = quantized_target(tmp_path, family, quantization)
    assert isinstance(target.model.layers[0].mlp.up_proj, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
    drafter = tiny_drafter(target, block_size=5).to(drafter_dtype)
    batch = left_pad([random_prompt(n, seed=n) for n in (4, 9)])
    plain = target.generate(**batch, max_new_tokens=16, do_sample=False, pad_token_id=PAD)
    with oracle_drafts(plain, wrong_every=3):
        out = target.generate(
            **batch, max_new_tokens=16, do_sample=False, pad_token_id=PAD, assistant_model=drafter,
            return_dict_in_generate=True, dflash_fast_path=fast_path,
        )
    assert torch.equal(out.sequences, plain)
    assert max(max(lengths) for lengths in out.acceptance_lengths) > 1, "no draft was accepted"


def test_capture_reads_the_quantized_layers(tmp_path):
    target = quantized_target(tmp_path, "llama", "nf4")
    drafter = tiny_drafter(target)
    prompt = random_prompt(7, seed=5)
    proposer = DFlashProposer(drafter, target, batch_size=1, num_pages=4)
    captured = torch.empty(1, 7, drafter.config.num_context_features)
    proposer.capture.destination = captured
    with proposer.capture, torch.no_grad():
        target(prompt)
    with torch.no_grad():
        hidden = target(prompt, output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i + 1][0] for i in drafter.config.target_layer_ids], dim=-1)
    torch.testing.assert_close(captured[0], expected, rtol=0, atol=0)


@pytest.mark.parametrize("quantization, independent", [("nf4", True), ("int8", True), ("int8-outliers", False)])
def test_which_quantized_layers_compute_each_row_on_its_own(quantization, independent):
    """Exactness rests on this: a verify row's output must not depend on the other rows of the verify block. LLM.int8
    with its outlier threshold breaks it (an outlier in one row moves a column to float16 for every row): README
    caveat. The two forwards have the same shape, so the same matmul kernel runs: a 16-row forward against 16
    one-row forwards would also compare gemm with gemv rounding, which differs on some CPUs even without
    quantization."""
    torch.manual_seed(0)
    dense = torch.nn.Linear(128, 64, bias=False)
    if quantization == "nf4":
        layer = bnb.nn.Linear4bit(128, 64, bias=False, quant_type="nf4", compute_dtype=torch.float32)
        layer.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type="nf4")
    else:
        threshold = 6.0 if quantization == "int8-outliers" else 0.0
        layer = bnb.nn.Linear8bitLt(128, 64, bias=False, has_fp16_weights=False, threshold=threshold)
        layer.weight = bnb.nn.Int8Params(dense.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
    layer = layer.to("cpu").eval()
    rows = torch.randn(1, 16, 128)
    with_outlier = rows.clone()
    with_outlier[0, 3, 7] = 20.0  # an outlier in one row only
    others = [i for i in range(16) if i != 3]
    with torch.no_grad():
        unchanged = torch.equal(layer(rows)[:, others], layer(with_outlier)[:, others])
    assert unchanged == independent
