"""Many consecutive DFlash generate calls: memory must come back, nothing may stay attached to the target.

Call i draws (from its seed) a batch size 1..4, left-padded prompts of 1..32 tokens, 1..48 new tokens, greedy or
sampled (either acceptance rule), sometimes an eos; one call in 16 fails on purpose part-way (a stopping criterion
that raises, ctrl-c in a streamer, an out-of-memory error from the drafter's forward). After every call: no forward
hook left on the target or drafter. Every 8th greedy call is checked against plain generate (identical tokens).
Every `--every` calls: resident memory (RSS), CUDA allocated memory on a GPU, and the DFlash proposers still alive once
the engine held on the drafter is released (must be 0). The first `--warmup` calls fill the allocator's caches; memory is compared from there to the end. The
target is a small random Llama (4 layers, width 128, vocabulary 512) with a 2-layer drafter of block size 8. The run
exits with status 1 when it found a problem (each is listed in the report).
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

from ..modeling import DFlashConfig, DFlashDraftModel
from ..modeling.dflash_compat import forward_hook_count
from . import harness

VOCAB = 512
PAD = 0


class RaiseAtLength(StoppingCriteria):
    """A stopping criterion that raises ValueError once the sequences are `length` tokens long (a fault on purpose)."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor, **kwargs: Any) -> torch.BoolTensor:
        if input_ids.shape[1] >= self.length:
            raise ValueError("soak: a stopping criterion that raises")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class InterruptingStreamer:
    """A streamer whose `put` is interrupted (ctrl-c) on its `calls`-th call; generate's own first put is the prompt."""

    def __init__(self, calls: int):
        self.calls = calls

    def put(self, value: torch.Tensor) -> None:
        self.calls -= 1
        if self.calls == 0:
            raise KeyboardInterrupt("soak: ctrl-c in a streamer")

    def end(self) -> None:
        pass


def small_pair(device: str, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A small random Llama target (4 layers, width 128, GQA 2) and a 2-layer drafter with block size 8."""
    torch.manual_seed(seed)
    target = LlamaForCausalLM(
        LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    ).eval().to(device)
    config = DFlashConfig.for_target(target.config, num_hidden_layers=2, block_size=8, mask_token_id=VOCAB - 1)
    return target, DFlashDraftModel(config).eval().to(device)


def hook_count(model: torch.nn.Module) -> int:
    return sum(forward_hook_count(m) for m in model.modules())


def live_proposers() -> int:
    from ..modeling import DFlashProposer

    gc.collect()
    # type() rather than isinstance: isinstance would touch lazy module attributes of every object (warnings)
    return sum(issubclass(type(o), DFlashProposer) for o in gc.get_objects())


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _call(rng: random.Random, device: str) -> dict[str, Any]:
    """The arguments of one generate call, and the fault it carries (None for a normal call)."""
    batch = rng.choice([1, 1, 2, 3, 4])
    lengths = [rng.choice([1, rng.randint(2, 32)]) for _ in range(batch)]
    width = max(lengths)
    ids = torch.full((batch, width), PAD, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.tensor([rng.randrange(1, VOCAB - 1) for _ in range(n)])
        mask[row, width - n :] = 1
    kwargs: dict[str, Any] = dict(
        input_ids=ids.to(device), attention_mask=mask.to(device), pad_token_id=PAD,
        max_new_tokens=rng.randint(1, 48), do_sample=rng.random() < 0.4,
    )
    if kwargs["do_sample"]:
        kwargs.update(temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([0, 20]),
                      dflash_sampling=rng.choice(["rejection", "point_mass"]))
    if rng.random() < 0.2:
        kwargs["eos_token_id"] = rng.randrange(1, VOCAB - 1)
    fault = rng.choice(["criterion", "streamer", "oom"]) if rng.random() < 1 / 16 else None
    if fault == "criterion":
        kwargs["stopping_criteria"] = StoppingCriteriaList([RaiseAtLength(width + 1 + rng.randrange(4))])
        kwargs["max_new_tokens"] = max(kwargs["max_new_tokens"], 8)
    elif fault == "streamer":  # streamers take one sequence; generate's own first put is the prompt
        kwargs.update(input_ids=kwargs["input_ids"][:1], attention_mask=kwargs["attention_mask"][:1],
                      streamer=InterruptingStreamer(calls=2 + rng.randrange(4)),
                      max_new_tokens=max(kwargs["max_new_tokens"], 8))
    elif fault == "oom":
        kwargs["max_new_tokens"] = max(kwargs["max_new_tokens"], 8)
    return {"kwargs": kwargs, "fault": fault}


def _fail_drafter_forward(drafter: torch.nn.Module) -> None:
    """The drafter's next-but-one forward raises an out-of-memory error (an instance attribute, deleted after)."""
    original, count = drafter.forward, [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] == 2:
            raise torch.OutOfMemoryError("soak: out of memory raised on purpose in the drafter")
        return original(*args, **kwargs)

    drafter.forward = forward


def run_soak(
    target: torch.nn.Module, drafter: torch.nn.Module, calls: int, seed: int = 0, warmup: int = 50, every: int = 50
) -> dict[str, Any]:
    """Run the soak; returns its measurements (see the module docstring). Raises nothing on a failed check: the
    caller reads `problems`."""
    from ..modeling.dflash_fast_path import release_fast_path

    device = str(next(target.parameters()).device)
    rng = random.Random(seed)
    hooks = (hook_count(target), hook_count(drafter))
    problems: list[str] = []
    # a fault planned after the call's last token (every sequence ended on eos first) is counted, not raised
    counts = {"calls": 0, "greedy": 0, "sampled": 0, "faults": 0, "faults_not_reached": 0, "checked_against_plain": 0,
              "tokens": 0}
    samples: list[dict[str, float]] = []
    start = time.perf_counter()
    for i in range(calls):
        call = _call(rng, device)
        kwargs, fault = call["kwargs"], call["fault"]
        counts["calls"] += 1
        counts["sampled" if kwargs["do_sample"] else "greedy"] += 1
        if fault is not None:
            counts["faults"] += 1
            expected = {"criterion": ValueError, "streamer": KeyboardInterrupt, "oom": torch.OutOfMemoryError}[fault]
            if fault == "oom":
                _fail_drafter_forward(drafter)
            try:
                target.generate(**kwargs, assistant_model=drafter)
                counts["faults_not_reached"] += 1
            except expected:
                pass
            finally:
                if fault == "oom":
                    del drafter.forward
        else:
            out = target.generate(**kwargs, assistant_model=drafter)
            counts["tokens"] += out.numel() - kwargs["input_ids"].numel()
            if not kwargs["do_sample"] and counts["greedy"] % 8 == 0:
                counts["checked_against_plain"] += 1
                if not torch.equal(out, target.generate(**kwargs)):
                    problems.append(f"call {i}: greedy DFlash output differs from plain generate")
        if (hook_count(target), hook_count(drafter)) != hooks:
            problems.append(f"call {i}: a forward hook stayed attached after the call (fault: {fault})")
            hooks = (hook_count(target), hook_count(drafter))
        if (i + 1) % every == 0 or i + 1 == calls or i + 1 == warmup:
            # The drafter keeps one engine (buffers, pools, graphs on a GPU) on purpose, between calls; let it go so
            # that what stays is a leak.
            release_fast_path(drafter)
            alive = live_proposers()
            if alive:
                problems.append(f"after call {i}: {alive} DFlash proposers still alive")
            sample = {"call": i + 1, "rss_mb": round(rss_mb(), 1), "seconds": round(time.perf_counter() - start, 1)}
            if device.startswith("cuda"):
                sample["cuda_allocated_mb"] = round(torch.cuda.memory_allocated() / 2**20, 2)
            samples.append(sample)
    at_warmup = next(s for s in samples if s["call"] >= min(warmup, calls))
    end = samples[-1]
    result = {
        **counts,
        "problems": problems,
        "rss_mb_after_warmup": at_warmup["rss_mb"],
        "rss_mb_end": end["rss_mb"],
        "rss_growth_mb": round(end["rss_mb"] - at_warmup["rss_mb"], 1),
        "samples": samples,
        "seconds": round(time.perf_counter() - start, 1),
    }
    if device.startswith("cuda"):
        result["cuda_allocated_mb_after_warmup"] = at_warmup["cuda_allocated_mb"]
        result["cuda_allocated_mb_end"] = end["cuda_allocated_mb"]
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=50, help="calls before memory is compared")
    parser.add_argument("--every", type=int, default=50, help="calls between memory samples")
    parser.set_defaults(threads=1)  # small models: one thread is fastest
    parser.add_argument("--max-rss-growth-mb", type=float, default=16.0,
                        help="resident memory growth after the warm-up that counts as a problem")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import above, at_least, check_device

    for option in ("calls", "warmup", "every"):
        at_least("--" + option, getattr(args, option), 1)
    above("--max-rss-growth-mb", args.max_rss_growth_mb, 0)
    check_device("--device", args.device)


def run(args: argparse.Namespace) -> int:
    import psutil

    device = args.device or harness.default_device()
    report = harness.header(args, device)
    target, drafter = small_pair(device, args.seed)
    rss_before = rss_mb()
    result = run_soak(target, drafter, args.calls, args.seed, args.warmup, args.every)
    if result["rss_growth_mb"] > args.max_rss_growth_mb:
        result["problems"].append(
            f"resident memory grew {result['rss_growth_mb']} MB after warm-up (limit {args.max_rss_growth_mb})"
        )
    report.update(cpu_cores=psutil.cpu_count(), rss_mb_before_first_call=round(rss_before, 1),
                  **result)
    print({k: v for k, v in report.items() if k != "samples"})
    harness.write_report(args.out, report, plot)
    return 1 if result["problems"] else 0


def plot(report: dict, path: Path) -> None:
    """Resident memory (and CUDA allocated memory on a GPU) at each sample, against the calls made."""
    plt = harness.pyplot()
    samples = report["samples"]
    fig, axis = plt.subplots(figsize=(7, 3.6))
    calls = [s["call"] for s in samples]
    axis.plot(calls, [s["rss_mb"] for s in samples], marker="o", label="resident memory (MB)")
    if "cuda_allocated_mb" in samples[0]:
        axis.plot(calls, [s["cuda_allocated_mb"] for s in samples], marker="s", label="CUDA allocated (MB)")
    axis.set(xlabel="calls", ylabel="MB", title=f"soak, {report['machine']} ({report['date'][:10]})")
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
