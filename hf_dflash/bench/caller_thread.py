"""Continuous batching on a CPU: the same manager serving in the calling thread and in a worker thread, side by side.

With torch's OpenMP backend every thread that runs parallel ops keeps its own pool of intra-op threads; once the
calling thread has one, ops in a second thread run slower (their waiting threads sleep instead of spinning), unless
the calling thread's pool is freed first, as the manager's `start` does on a CPU (modeling/dflash_openmp.py). The
caller's thread runs one target forward first, as any caller's has (loading a model does). Then, in alternated
rounds, for each `--batches` count of prompts decoded greedily together:
- `calling thread`: `target.generate_batch(prompts, assistant_model=drafter)`, which runs the manager's loop in the
  thread that calls it (`run_until_done`);
- `worker thread`: `continuous_batching_context_manager(assistant_model=drafter)`, its requests added and their
  results read from the calling thread while the manager's worker thread steps, as a server runs it.
Reported per count: tokens/s of each round and their medians, the ratio, and whether every round's tokens are the
same. Also one `--forward-tokens`-token target forward (mean of `--forwards`), timed in the calling thread, in a
worker thread, and in a worker thread after the calling thread's pool was freed, which shows the cost and the fix
without the manager. Meant for a CPU; a GPU run measures the thread handoff only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from . import harness

MODES = ("calling thread", "worker thread")
FREED = "worker thread, caller's pool freed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2", help="smollm2 (default), stories260k, or a path/id")
    parser.add_argument("--drafter", default=None, help="drafter directory (default: our SmolLM2 drafter)")
    parser.add_argument("--prompts", default="humaneval", help="prompt set (default: humaneval)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="prompts decoded together")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per count (the median is reported)")
    parser.add_argument("--forward-tokens", type=int, default=16)
    parser.add_argument("--forwards", type=int, default=30, help="timed forwards per thread")
    parser.add_argument("--device", default="cpu", help="cpu (default; the question is a CPU's)")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import at_least, check_device, check_drafter, check_model, check_prompts

    for option in ("--max-new-tokens", "--rounds", "--forward-tokens", "--forwards"):
        at_least(option, getattr(args, option[2:].replace("-", "_")), 1)
    for count in args.batches:
        at_least("--batches", count, 1)
    check_device("--device", args.device)
    check_prompts("--prompts", args.prompts)
    check_model("--target", args.target)
    check_drafter("--drafter", args.drafter)


def in_a_worker_thread(function: Callable[[], Any]) -> Any:
    """`function()` in a new thread, waited for; its result (an exception is raised here)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(function).result()


@torch.no_grad()
def forward_ms(target: torch.nn.Module, input_ids: torch.Tensor, forwards: int) -> float:
    """Mean milliseconds of one target forward, after one untimed."""
    target(input_ids)
    start = time.perf_counter()
    for _ in range(forwards):
        target(input_ids)
    return 1000 * (time.perf_counter() - start) / forwards


def run(args: argparse.Namespace) -> int:
    from transformers import GenerationConfig

    from ..batching import left_pad_token_id
    from ..generate_cli import DEFAULT_DRAFTER, load_target
    from ..modeling import DFlashDraftModel
    from ..modeling.dflash_openmp import release_openmp_threads
    from ..training.data import encode_prompt, load_prompts

    report = harness.header(args, args.device)
    target, tokenizer = load_target(args.target, torch.float32, args.device)
    target.eval()
    drafter = DFlashDraftModel.from_pretrained(args.drafter or DEFAULT_DRAFTER, dtype=torch.float32)
    drafter = drafter.to(args.device).eval()
    texts = load_prompts(args.prompts)
    prompts = [encode_prompt(tokenizer, texts[i % len(texts)]) for i in range(max(args.batches))]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False,
                              eos_token_id=target.generation_config.eos_token_id,
                              pad_token_id=left_pad_token_id(tokenizer, target))

    ids = torch.tensor([prompts[0][: args.forward_tokens]], device=args.device)
    forward = {"calling thread": forward_ms(target, ids, args.forwards)}  # the caller's thread has run ops now
    forward["worker thread"] = in_a_worker_thread(lambda: forward_ms(target, ids, args.forwards))
    release_openmp_threads()
    forward[FREED] = in_a_worker_thread(lambda: forward_ms(target, ids, args.forwards))
    print(f"one {ids.shape[1]}-token forward: {forward['calling thread']:.1f} ms in the calling thread, "
          f"{forward['worker thread']:.1f} ms in a worker thread, {forward[FREED]:.1f} ms in a worker thread after "
          "the calling thread's OpenMP threads were freed", flush=True)

    def calling_thread(batch: list[list[int]]) -> list[list[int]]:
        out = target.generate_batch(batch, generation_config=config, assistant_model=drafter)
        return [output.generated_tokens for output in out.values()]

    def worker_thread(batch: list[list[int]]) -> list[list[int]]:
        with target.continuous_batching_context_manager(generation_config=config, assistant_model=drafter) as manager:
            request_ids = manager.add_requests(batch)
            results = {}
            while len(results) < len(request_ids):
                output = manager.get_result(timeout=1)
                if output is not None and output.is_finished():
                    results[output.request_id] = output
        if any(output.error for output in results.values()):
            raise RuntimeError(f"a request failed: {next(o.error for o in results.values() if o.error)}")
        return [results[request_id].generated_tokens for request_id in request_ids]

    calling_thread(prompts[:1])  # untimed: first-call costs
    rows = []
    for count in args.batches:
        batch = prompts[:count]

        def timed(serve: Callable[[list[list[int]]], list[list[int]]]) -> tuple[float, list[list[int]]]:
            start = time.perf_counter()
            tokens = serve(batch)
            return sum(map(len, tokens)) / (time.perf_counter() - start), tokens

        rounds = harness.alternate({"calling thread": lambda: timed(calling_thread),
                                    "worker thread": lambda: timed(worker_thread)}, args.rounds)
        outputs = [tokens for results in rounds.values() for _, tokens in results]
        row = {"prompts": count,
               **{f"{mode} tok/s": [rate for rate, _ in rounds[mode]] for mode in MODES},
               **{f"{mode} tok/s median": statistics.median(rate for rate, _ in rounds[mode]) for mode in MODES},
               "same_tokens": all(tokens == outputs[0] for tokens in outputs)}
        row["calling / worker"] = row["calling thread tok/s median"] / row["worker thread tok/s median"]
        rows.append(row)
        print(f"{count:>3} prompts: calling thread {row['calling thread tok/s median']:.1f} tok/s, worker thread "
              f"{row['worker thread tok/s median']:.1f} tok/s ({row['calling / worker']:.2f}x); same tokens: "
              f"{row['same_tokens']}", flush=True)
    report.update(target=args.target, threads=torch.get_num_threads(), forward_ms=forward,
                  statistic=f"median of {args.rounds} alternated rounds", rows=rows)
    harness.write_report(args.out, report, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.5))
    rows = report["rows"]
    harness.grouped_bars(axis, [str(row["prompts"]) for row in rows],
                         {mode: [row[f"{mode} tok/s median"] for row in rows] for mode in MODES}, "tokens/s")
    axis.set_xlabel("prompts decoded together")
    axis.set_title(f"continuous batching with the drafter, {report['target']}, {report['machine']}, "
                   f"{report['threads']} threads ({report['date'][:10]})", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
