"""What every `hf-dflash bench` scenario shares: one way to time, one way to record, one way to plot.

Timing. `timed` is one call with the device synchronized on both sides (the project's timer, shared with
`hf-dflash generate`). `time_call` times a function `repeats` times after `warmup` untimed calls and keeps the
median (and the fastest, for a machine shared with other work). `time_graph` records a function once as a CUDA
graph and times its replays with CUDA events, as the fast path replays its step. `alternate` runs variants in turn,
round after round, in one process, so that drift of a shared machine hits every variant alike: compare variants
within a round.

Recording. `header(args, device)` is what every report starts with: the scenario, the command (every option
spelled out, paths written as a user re-runs them from the repository root), the date, the machine and the library
versions (`hf_dflash.run_record`). `write_report` writes the JSON to `--out` and, given a plot function, a PNG
beside it (matplotlib, the `bench` extra; without it the JSON is written and a line says so).

Load. `arrival_offsets` and `percentiles` serve scenarios that send requests over time (a rate, or all at once)
and report latency percentiles.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from ..generate_cli import timed
from ..run_record import portable_path, run_environment, shell_line

T = TypeVar("T")
RESULTS = Path("benchmarks/results")  # where reports go by default, relative to the repository root
BENCH_EXTRA = "pip install 'hf-dflash[bench]'"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call over `repeats` timed calls: the median (the figure reports compare) and the fastest."""

    median_ms: float
    min_ms: float
    repeats: int

    @classmethod
    def of(cls, samples_ms: list[float]) -> "Timing":
        return cls(round(statistics.median(samples_ms), 4), round(min(samples_ms), 4), len(samples_ms))


def time_call(fn: Callable[[], Any], repeats: int = 20, warmup: int = 2) -> Timing:
    """`fn` called `warmup` times untimed (compiles, caches, allocator), then `repeats` times, each call timed with the
    device synchronized on both sides."""
    for _ in range(warmup):
        timed(fn)
    return Timing.of([1000 * timed(fn)[1] for _ in range(repeats)])


def record_cuda_graph(fn: Callable[[], Any], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """`fn` recorded as a CUDA graph, after `warmup` calls on a side stream (a recording needs a warmed-up stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph(fn: Callable[[], Any], replays: int = 30) -> Timing:
    """`fn` recorded once as a CUDA graph (as the engine records its step), then `replays` replays, each timed by
    CUDA events (GPU only)."""
    graph = record_cuda_graph(fn)
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return Timing.of(samples)


def alternate(variants: dict[str, Callable[[], T]], rounds: int) -> dict[str, list[T]]:
    """Each variant called once per round, in the order given, for `rounds` rounds: {name: [round 1, round 2, ...]}."""
    results: dict[str, list[T]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, variant in variants.items():
            results[name].append(variant())
    return results


# ------------------------------------------------------------------------------------------------------------------
# Recording
# ------------------------------------------------------------------------------------------------------------------

NOT_RECORDED = {"func", "command", "scenario"}  # the CLI's own plumbing in the parsed arguments


def command_line(args: argparse.Namespace) -> str:
    """`hf-dflash bench SCENARIO` with every option of `args` spelled out (a flag when true; none when unset or
    empty), so that the report says exactly what ran, whatever the defaults were then. Scenarios take lists as
    `--option A B`, never as a repeated option."""
    words = ["hf-dflash", "bench", args.scenario]
    for key, value in vars(args).items():
        if key in NOT_RECORDED or value is None or value is False or value == []:
            continue
        words.append("--" + key.replace("_", "-"))
        if value is not True:
            words += [portable_path(str(v)) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return shell_line(words)


def header(args: argparse.Namespace, device: torch.device | str, **more_versions: str) -> dict[str, Any]:
    """What every report starts with: scenario, command, date, machine and versions."""
    return {"scenario": args.scenario, "command": command_line(args), **run_environment(device, **more_versions)}


def write_report(out: str | Path, report: dict[str, Any], plot: Callable[[dict[str, Any], Path], None] | None = None
                 ) -> Path:
    """The report as JSON at `out`, and `plot(report, out.png)` beside it when given. Only the default folder
    (`RESULTS`) is made when missing: a folder a user named must exist (the CLI checks it before anything runs)."""
    path = Path(out)
    if path.parent == RESULTS:
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    if plot is not None:
        try:
            plot(report, path.with_suffix(".png"))
            pyplot().close("all")  # a figure stays open until closed, memory included
            print(f"wrote {path.with_suffix('.png')}")
        except ImportError:
            print(f"matplotlib is not installed: no plot ({BENCH_EXTRA}); the JSON has every figure")
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only); ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(axis: Any, groups: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    """One group of bars per entry of `groups`, one bar per series in each group (a series' values in group order)."""
    width = 0.8 / max(len(series), 1)
    for j, (name, values) in enumerate(series.items()):
        axis.bar([i + j * width for i in range(len(groups))], values, width, label=name)
    axis.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))], groups, fontsize=7)
    axis.set_ylabel(ylabel)
    axis.legend(fontsize=7)


# ------------------------------------------------------------------------------------------------------------------
# Load
# ------------------------------------------------------------------------------------------------------------------


def arrival_offsets(count: int, rate: float | None, seed: int = 0) -> list[float]:
    """Seconds from the start at which `count` requests arrive: all at once (rate None), or as a Poisson process of
    `rate` requests per second (exponential gaps, seeded)."""
    if rate is None:
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"a request rate must be above 0, got {rate}")
    rng, now, offsets = random.Random(seed), 0.0, []
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def percentiles(values: list[float], points: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """{"p50": ..., "p90": ..., "p99": ...} of `values` (nearest rank), and their mean."""
    if not values:
        raise ValueError("percentiles of no values")
    ordered = sorted(values)
    ranks = {f"p{p}": ordered[min(len(ordered) - 1, max(0, -(-p * len(ordered) // 100) - 1))] for p in points}
    return {**ranks, "mean": statistics.fmean(values)}


__all__ = [
    "RESULTS", "Timing", "alternate", "arrival_offsets", "command_line", "default_device", "grouped_bars", "header",
    "percentiles", "pyplot", "synchronize", "time_call", "time_graph", "timed", "write_report",
]
