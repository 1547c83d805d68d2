"""`hf-dflash generate`: the main job.

Decodes prompts with a target and a DFlash drafter, and with the target alone, side by side in one process; prints
the text, tau (tokens committed per verify step), the speedup, and whether the two outputs are identical.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from .modeling import DFlashDraftModel

# Our trained drafter for SmolLM2-135M-Instruct, shipped with the package (config + weights; the remote-code bundle
# is added whenever it is saved or pushed).
DEFAULT_DRAFTER = Path(__file__).parent / "drafters" / "smollm2-135m-instruct"
DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain in three sentences why the sky is blue.",
]


def load_target(name: str, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, Any]:
    """`smollm2` and `stories260k` are the offline bundled models; anything else is a from_pretrained path/id."""
    from . import bundled_models

    if name == "smollm2":
        return bundled_models.load_smollm2(dtype=dtype, device=device)
    if name == "stories260k":
        return bundled_models.load_stories260k(dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, device_map=device).eval()
    return model, AutoTokenizer.from_pretrained(name)


def encode(tokenizer: Any, prompt: str, device: str) -> dict[str, torch.Tensor]:
    """A chat prompt when the tokenizer has a template (instruction-tuned targets), the raw text otherwise."""
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return tokenizer(prompt, return_tensors="pt").to(device)


def timed(fn: Any) -> tuple[Any, float]:
    """(fn(), seconds), with the GPU synchronized on both sides so the time covers the work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[args.dtype]
    drafter_path = Path(args.drafter) if args.drafter else DEFAULT_DRAFTER
    if not (drafter_path / "config.json").exists() and args.drafter is None:
        raise SystemExit(f"the default drafter is missing from {drafter_path}; pass --drafter PATH")
    target, tokenizer = load_target(args.target, dtype, device)
    drafter = DFlashDraftModel.from_pretrained(drafter_path, dtype=dtype).to(device).eval()
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    dflash_settings = dict(dflash_verify_rows=args.verify_rows) if args.verify_rows else {}
    # One short warm-up of each path so one-time costs (allocator, kernels) stay out of the timings.
    warm = encode(tokenizer, "Hi", device)
    target.generate(**warm, max_new_tokens=4, do_sample=False)
    target.generate(**warm, max_new_tokens=4, do_sample=False, assistant_model=drafter, **dflash_settings)

    plain_seconds = dflash_seconds = 0.0
    new_tokens = 0
    committed: list[int] = []
    for prompt in args.prompt or DEFAULT_PROMPTS:
        inputs = encode(tokenizer, prompt, device)
        plain, seconds = timed(lambda: target.generate(**inputs, **settings))
        plain_seconds += seconds
        out, seconds = timed(
            lambda: target.generate(
                **inputs, **settings, **dflash_settings, assistant_model=drafter, return_dict_in_generate=True
            )
        )
        dflash_seconds += seconds
        new_tokens += out.sequences.shape[1] - inputs["input_ids"].shape[1]
        committed += out.acceptance_lengths[0]
        text = tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        identical = torch.equal(plain, out.sequences)
        print(f"\n>>> {prompt}\n{text}\n[identical to plain greedy generate: {identical}]")
        if not identical:
            raise SystemExit("DFlash output differs from plain greedy generate: please report this as a bug")
    tau = sum(committed) / max(len(committed), 1)
    print(
        f"\ntarget {args.target} | drafter {drafter_path.name} | {device} {str(dtype).replace('torch.', '')}\n"
        f"tau (tokens per verify step): {tau:.2f}\n"
        f"plain generate: {new_tokens / plain_seconds:.1f} tok/s | DFlash: {new_tokens / dflash_seconds:.1f} tok/s | "
        f"speedup {plain_seconds / dflash_seconds:.2f}x"
    )
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="decode prompts with DFlash and plain generate side by side (text, tau, speedup)",
        description=__doc__,
    )
    parser.add_argument("--target", default="smollm2", help="smollm2 | stories260k | a model path or Hub id")
    parser.add_argument("--drafter", default=None, help=f"drafter directory (default: {DEFAULT_DRAFTER.name})")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); two built-in ones by default")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--verify-rows", type=int, default=None,
                        help="rows the target verifies per step (default: the block size); fewer pay on a CPU")
    parser.add_argument("--device", default=None, help="cuda when available, else cpu")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="auto: bfloat16 on GPU, float32 on CPU")
    parser.set_defaults(func=run)
