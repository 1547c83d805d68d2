"""Tau of a drafter trained on the unquantized target, when the target is quantized by bitsandbytes (4-bit, 8-bit).

Each variant of SmolLM2-135M-Instruct (unquantized, nf4, fp4, int8) decodes the same HumanEval prompts greedily with
the drafter (`measure_tau`, batch 1), and each output is checked against that same variant's plain greedy generate.
Results go to benchmarks/results/<name>.json.

usage: python benchmarks/quantized_tau.py [--drafter DIR] [--prompts 4] [--max-new-tokens 64]
       [--variants none nf4 fp4 int8 int8-rowwise] [--device cpu|cuda] [--name NAME]

On CPU, bitsandbytes (>= 0.50) computes 4-bit layers in bfloat16 (on CPUs with AVX512-BF16, as here) and 8-bit layers
in int8 with float16 outlier columns. On a GPU, install the bitsandbytes wheel there first (`pip install --no-deps
bitsandbytes-*.whl`; numpy and packaging are its only other dependencies).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import bitsandbytes
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from hf_dflash import DFlashDraftModel, place_drafter
from hf_dflash.bench import run_environment
from hf_dflash.bundled_models import load_smollm2
from hf_dflash.generate_cli import DEFAULT_DRAFTER
from hf_dflash.training import load_prompts, measure_tau

RESULTS = Path(__file__).parent / "results"


def quantization(variant: str, compute_dtype: torch.dtype) -> BitsAndBytesConfig | None:
    if variant == "none":
        return None
    if variant == "int8":  # LLM.int8 as bitsandbytes ships it: outlier columns (|x| > 6) in float16
        return BitsAndBytesConfig(load_in_8bit=True)
    if variant == "int8-rowwise":  # no outlier columns: every row is quantized on its own
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=variant, bnb_4bit_compute_dtype=compute_dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    parser.add_argument("--prompts", type=int, default=4, help="first N HumanEval prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--variants", nargs="+", choices=["none", "nf4", "fp4", "int8", "int8-rowwise"], default=["none", "nf4", "int8"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # on CPU, every 8-bit matmul logs a float16 cast
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    prompts = load_prompts("humaneval")[: args.prompts]
    dense, tokenizer = load_smollm2(dtype=dtype)
    result = {
        **run_environment(args.device, bitsandbytes=bitsandbytes.__version__),
        "target": "smollm2",
        "drafter": Path(args.drafter).name,
        "dtype": str(dtype).replace("torch.", ""),
        "prompts": f"first {len(prompts)} HumanEval",
        "max_new_tokens": args.max_new_tokens,
        "runs": [],
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{args.name or 'quantized_tau_smollm2_' + args.device.split(':')[0]}.json"
    with tempfile.TemporaryDirectory(prefix="smollm2_") as folder:
        # bitsandbytes quantizes while from_pretrained loads, so the dense model goes through a folder.
        dense.save_pretrained(folder)
        del dense
        bar = tqdm(total=len(args.variants) * len(prompts), desc="prompts decoded")
        for variant in args.variants:
            target = AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype, quantization_config=quantization(variant, dtype), device_map=args.device
            ).eval()
            drafter = place_drafter(DFlashDraftModel.from_pretrained(args.drafter, dtype=dtype), target).eval()
            committed = steps = 0
            identical = []
            start = time.perf_counter()
            for prompt in prompts:
                report = measure_tau(target, drafter, [prompt], args.max_new_tokens, tokenizer)
                committed += round(report.mean_tau * report.verify_steps)
                steps += report.verify_steps
                identical.append(report.matches_greedy)
                bar.update()
            run = {
                "variant": variant,
                "tau": committed / steps,
                "verify_steps": steps,
                "identical_to_plain_greedy": all(identical),
                "identical_per_prompt": identical,
                "seconds": round(time.perf_counter() - start, 1),
                "weights_mb": round(target.get_memory_footprint() / 2**20, 1),
            }
            result["runs"].append(run)
            path.write_text(json.dumps(result, indent=1) + "\n")  # after every variant: a long run keeps its part
            bar.write(json.dumps(run))
            del target, drafter
        bar.close()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
