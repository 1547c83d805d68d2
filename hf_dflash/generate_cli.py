"""`hf-dflash generate`: the main job.

Decodes prompts with a target and a DFlash drafter, and with the target alone, side by side in one process; prints
the text, tau (tokens committed per verify step), the speedup, and whether the two outputs are identical (in float32
they must be; in bfloat16 they may part where two logits nearly tie). It says which path DFlash takes (the CUDA-graph
fast path, or the engine's step without graphs); without graphs the text streams as it is committed and plain generate
shows a progress bar, and the time spent printing is left out of the figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import TextStreamer
from transformers.generation.streamers import BaseStreamer

from .cli_checks import add_threads_option
from .modeling import DFlashDraftModel
from .modeling.dflash_policy import VerifyPolicy
from .training.data import encode_prompt

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
    """The prompt as train and eval encode it (`encode_prompt`: a chat prompt when the tokenizer has a template, whose
    text already holds any BOS; the raw text otherwise), as a batch of one on `device`."""
    ids = torch.tensor([encode_prompt(tokenizer, prompt)], device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def timed(fn: Any) -> tuple[Any, float]:
    """(fn(), seconds), with the GPU synchronized on both sides so the time covers the work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def say(message: str) -> None:
    """What the job is doing, on stderr (stdout keeps the texts and figures)."""
    print(message, file=sys.stderr, flush=True)


class TimedStreamer(BaseStreamer):
    """Passes tokens on to `inner` and keeps the seconds spent there, which the timed figures leave out."""

    def __init__(self, inner: BaseStreamer) -> None:
        self.inner = inner
        self.seconds = 0.0

    def put(self, value: torch.Tensor) -> None:
        start = time.perf_counter()
        self.inner.put(value)
        self.seconds += time.perf_counter() - start

    def end(self) -> None:
        start = time.perf_counter()
        self.inner.end()
        self.seconds += time.perf_counter() - start


class TokenProgress(BaseStreamer):
    """A progress bar of new tokens (generate first puts the prompt, which is not counted)."""

    def __init__(self, total: int, description: str) -> None:
        self.bar = tqdm(total=total, desc=description, unit="tok", leave=False, file=sys.stderr)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.bar.update(value.numel())
        self.prompt_seen = True

    def end(self) -> None:
        self.bar.close()


def warm_up(target: Any, drafter: Any, tokenizer: Any, device: str, dflash_settings: dict[str, Any]) -> str:
    """Run plain generate and DFlash once on a short prompt, so one-time costs (allocator, kernels, the CUDA-graph
    capture) stay out of the timings, and say which path DFlash takes: the engine's step (on a GPU a CUDA graph,
    unless each step chooses its width on the host), over transformers' cache for a target the engine's pool cannot
    serve."""
    warm = encode(tokenizer, "Hi", device)
    settings = dict(max_new_tokens=4, do_sample=False)
    target.generate(**warm, **settings)
    try:
        target.generate(**warm, **settings, assistant_model=drafter, dflash_fast_path=True, **dflash_settings)
    except ValueError as refusal:
        # The default call decides: it raises again if the call itself is wrong, not just the fast path.
        target.generate(**warm, **settings, assistant_model=drafter, **dflash_settings)
        return f"engine's step over transformers' cache: {str(refusal).split('cannot serve this call: ')[-1]}"
    if not device.startswith("cuda"):
        return "engine's step (eager on a CPU)"
    block = drafter.config.block_size
    if dflash_settings.get("dflash_adaptive") or dflash_settings.get("dflash_verify_rows", block) < block:
        return "CUDA-graph fast path, each step in recorded parts (its width chosen on the host between them)"
    return "CUDA-graph fast path"


def identity_verdict(plain: torch.Tensor, dflash: torch.Tensor, dtype: torch.dtype) -> str:
    """The line that says whether DFlash gave plain greedy's tokens. In float32 it must (a difference is a bug, and
    stops the job); in bfloat16 the block verify and the 1-token steps round differently, so where two logits nearly
    tie the texts may part, as transformers' own compiled generate parts from its eager one."""
    if torch.equal(plain, dflash):
        return "[identical to plain greedy generate: True]"
    if dtype == torch.float32:
        raise SystemExit("DFlash output differs from plain greedy generate in float32: please report this as a bug")
    name = str(dtype).removeprefix("torch.")
    return (f"[identical to plain greedy generate: False; expected now and then in {name}, where a near tie can round "
            "either way; --dtype float32 gives identical tokens]")


def run(args: argparse.Namespace) -> int:
    """The arguments were checked by `cli_checks.check_generate` before this runs."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    threads = torch.get_num_threads()  # `--threads`, which cli.main applied
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[args.dtype]
    dtype_name = str(dtype).replace("torch.", "")
    drafter_source = args.drafter or DEFAULT_DRAFTER
    drafter_name = args.drafter or f"{DEFAULT_DRAFTER.name} (ours, shipped with hf-dflash)"
    say(f"loading the target {args.target} ({device}, {dtype_name}) ...")
    target, tokenizer = load_target(args.target, dtype, device)
    say(f"loading the drafter {drafter_name} ...")
    drafter = DFlashDraftModel.from_pretrained(drafter_source, dtype=dtype).to(device).eval()
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    dflash_settings = dict(dflash_verify_rows=args.verify_rows) if args.verify_rows else {}
    # One policy for every call, the warm-up's included: its fit of this machine's verify cost carries over. On by
    # default on a CPU, where a verify costs about in proportion to its rows; a GPU takes the full-width fast path.
    if args.adaptive if args.adaptive is not None else device == "cpu":
        dflash_settings["dflash_adaptive"] = VerifyPolicy()
    say("warming up (one short run of each) ...")
    path = warm_up(target, drafter, tokenizer, device, dflash_settings)
    # On the CUDA-graph fast path the text is printed after each call, so that no printing sits between graph
    # replays (a streamer would be served there too, around the step); a step run eagerly streams its text as it is
    # committed, and plain generate shows a progress bar. The seconds spent printing are left out of both timings.
    live = not path.startswith("CUDA-graph")
    say(f"DFlash decodes on the {path}" + ("; its text streams as it is committed" if live else ""))

    prompts = args.prompt or DEFAULT_PROMPTS
    plain_seconds = dflash_seconds = printing_seconds = 0.0
    plain_tokens = dflash_tokens = 0  # equal in float32; in bfloat16 the two texts may part and differ in length
    committed: list[int] = []
    for number, prompt in enumerate(prompts, 1):
        inputs = encode(tokenizer, prompt, device)
        prompt_length = inputs["input_ids"].shape[1]
        print(f"\n>>> [{number}/{len(prompts)}] {prompt}", flush=True)
        progress = TimedStreamer(TokenProgress(args.max_new_tokens, "plain generate")) if live else None
        plain, seconds = timed(lambda: target.generate(**inputs, **settings, streamer=progress))
        plain_seconds += seconds - (progress.seconds if live else 0.0)
        streamer = TimedStreamer(TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)) if live else None
        out, seconds = timed(
            lambda: target.generate(
                **inputs, **settings, **dflash_settings, assistant_model=drafter, return_dict_in_generate=True,
                streamer=streamer,
            )
        )
        dflash_seconds += seconds - (streamer.seconds if live else 0.0)
        printing_seconds += progress.seconds + streamer.seconds if live else 0.0
        plain_tokens += plain.shape[1] - prompt_length
        dflash_tokens += out.sequences.shape[1] - prompt_length
        committed += out.acceptance_lengths[0]
        if not live:
            print(tokenizer.decode(out.sequences[0, prompt_length:], skip_special_tokens=True))
        print(identity_verdict(plain, out.sequences, dtype), flush=True)
    tau = sum(committed) / max(len(committed), 1)
    plain_rate, dflash_rate = plain_tokens / plain_seconds, dflash_tokens / dflash_seconds
    excluded = f" (timings exclude {printing_seconds:.2f} s of printing)" if live else ""
    machine = f"{device} {dtype_name}"
    if device == "cpu":  # the figures depend on it: see --threads
        machine += f", {threads} thread" + ("s" if threads > 1 else "")
    print(
        f"\ntarget {args.target} | drafter {drafter_name} | {machine} | DFlash on the {path}\n"
        f"tau (tokens per verify step): {tau:.2f}\n"
        f"plain generate: {plain_rate:.1f} tok/s | DFlash: {dflash_rate:.1f} tok/s | "
        f"speedup {dflash_rate / plain_rate:.2f}x{excluded}"
    )
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="decode prompts with DFlash and plain generate side by side (text, tau, speedup)",
        description=__doc__,
    )
    parser.add_argument("--target", default="smollm2", help="smollm2 | stories260k | a model path or Hub id")
    parser.add_argument("--drafter", default=None, help=f"drafter folder or Hub id (default: ours, {DEFAULT_DRAFTER.name})")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); two built-in ones by default")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--verify-rows", type=int, default=None,
                        help="rows the target verifies per step (default: the block size); fewer pay on a CPU")
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                        help="choose each step's verified rows from the drafter's confidence and the measured verify "
                        "cost, down to plain decoding where drafting does not pay (default: on on a CPU)")
    parser.add_argument("--device", default=None, help="cuda when available, else cpu")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="auto: bfloat16 on GPU, float32 on CPU")
    add_threads_option(parser)
    parser.set_defaults(func=run)
