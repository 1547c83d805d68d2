"""Tau of a drafter trained on the unquantized target when the target is quantized by bitsandbytes (4-bit, 8-bit).

Each variant of the target (unquantized, nf4, fp4, LLM.int8, row-wise int8) decodes the same prompts (by default the
first HumanEval ones) greedily with the drafter (batch 1), and each output is checked against that same variant's
plain greedy generate. Reported per variant: tau, verify steps, whether the outputs are identical, the weights' size
and the seconds the variant took. On a CPU, bitsandbytes (>= 0.50) computes 4-bit layers in bfloat16 and 8-bit
layers in int8 with float16 outlier columns; on a GPU, carry its wheel there (`pip install --no-deps
bitsandbytes-*.whl`).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from . import harness

VARIANTS = ("none", "nf4", "fp4", "int8", "int8-rowwise")


def quantization(variant: str, compute_dtype: torch.dtype) -> Any:
    from transformers import BitsAndBytesConfig

    if variant == "none":
        return None
    if variant == "int8":  # LLM.int8 as bitsandbytes ships it: outlier columns (|x| > 6) in float16
        return BitsAndBytesConfig(load_in_8bit=True)
    if variant == "int8-rowwise":  # no outlier columns: every row is quantized on its own
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=variant, bnb_4bit_compute_dtype=compute_dtype)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2", help="smollm2 (default), stories260k, or a path/id")
    parser.add_argument("--drafter", default=None, help="drafter directory (default: our SmolLM2 drafter)")
    parser.add_argument("--prompts", default="humaneval", help="humaneval (default), sharegpt:N or a .jsonl file")
    parser.add_argument("--limit", type=int, default=4, help="number of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["none", "nf4", "int8"])
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")


def check(args: argparse.Namespace) -> None:
    import importlib.util

    from ..cli_checks import (
        BadArgument, at_least, check_device, check_drafter, check_model, check_prompts, read_target,
    )

    at_least("--limit", args.limit, 1)
    check_prompts("--prompts", args.prompts)
    at_least("--max-new-tokens", args.max_new_tokens, 1)
    check_device("--device", args.device)
    check_model("--target", args.target)
    check_drafter("--drafter", args.drafter)
    if importlib.util.find_spec("bitsandbytes") is None:
        raise BadArgument("quantized targets need bitsandbytes: pip install 'hf-dflash[quant]'")
    four_bit = [variant for variant in args.variants if variant in ("nf4", "fp4")]
    if four_bit and (args.device or harness.default_device()) == "cpu":
        # bitsandbytes' 4-bit CPU kernels take only widths that are multiples of their block of 64
        text = read_target("--target", args.target).config.get_text_config()
        widths = {"hidden_size": text.hidden_size, "intermediate_size": getattr(text, "intermediate_size", None)}
        odd = {name: width for name, width in widths.items() if width is not None and width % 64}
        if odd:
            listed = ", ".join(f"{name} {width}" for name, width in odd.items())
            raise BadArgument(f"--variants {' '.join(four_bit)} on a CPU: bitsandbytes' 4-bit CPU kernels need widths "
                              f"that are multiples of 64, and {args.target} has {listed}; run on a GPU or pick int8")


def run(args: argparse.Namespace) -> int:
    import bitsandbytes
    from transformers import AutoModelForCausalLM

    from ..generate_cli import DEFAULT_DRAFTER, load_target
    from ..modeling import DFlashDraftModel, place_drafter
    from ..training import load_prompts, measure_tau

    device = args.device or harness.default_device()
    report = harness.header(args, device, bitsandbytes=bitsandbytes.__version__)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # on a CPU every 8-bit matmul logs a float16 cast
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    prompts = load_prompts(args.prompts)[: args.limit]
    dense, tokenizer = load_target(args.target, dtype, "cpu")
    report.update(target=args.target, drafter=Path(str(args.drafter or DEFAULT_DRAFTER)).name,
                  dtype=str(dtype).replace("torch.", ""), prompts=f"the first {len(prompts)} of {args.prompts}",
                  max_new_tokens=args.max_new_tokens, runs=[])
    with tempfile.TemporaryDirectory(prefix="quantized_") as folder:
        # bitsandbytes quantizes while from_pretrained loads, so the dense model goes through a folder.
        dense.save_pretrained(folder)
        del dense
        for variant in args.variants:
            target = AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype, quantization_config=quantization(variant, dtype), device_map=device
            ).eval()
            drafter = place_drafter(DFlashDraftModel.from_pretrained(args.drafter or DEFAULT_DRAFTER, dtype=dtype),
                                    target).eval()
            committed = steps = 0
            identical = []
            started = time.perf_counter()
            for prompt in prompts:
                measured = measure_tau(target, drafter, [prompt], args.max_new_tokens, tokenizer)
                committed += round(measured.mean_tau * measured.verify_steps)
                steps += measured.verify_steps
                identical.append(measured.matches_greedy)
            report["runs"].append({
                "variant": variant, "tau": committed / steps, "verify_steps": steps,
                "identical_to_plain_greedy": all(identical), "identical_per_prompt": identical,
                "seconds": round(time.perf_counter() - started, 1),
                "weights_mb": round(target.get_memory_footprint() / 2**20, 1),
            })
            print(report["runs"][-1], flush=True)
            harness.write_report(args.out, report)  # after every variant: a long run keeps its part
            del target, drafter
    harness.write_report(args.out, report, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    runs = report["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = [r["variant"] for r in runs]
    left.bar(names, [r["tau"] for r in runs])
    left.set_ylabel("tau")
    right.bar(names, [r["weights_mb"] for r in runs])
    right.set_ylabel("weights (MB)")
    fig.suptitle(f"{report['target']} + {report['drafter']}, {report['prompts']}, {report['machine']} "
                 f"({report['date'][:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
