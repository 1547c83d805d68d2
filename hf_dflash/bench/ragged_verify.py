"""A ragged verify's target forward (each request its own rows, packed into one forward) against the padded one, and
its attention over the whole padded block against attention cut into column spans where that pays
(modeling/dflash_attention.py's `cuts`).

For each pattern of rows per request (`--patterns`, e.g. 1,1,1,1,1,1,1,16: eight requests), that many requests of
`--prompt-tokens` random tokens each are admitted to an engine (its pages), and one verify forward of their drafts is
timed four ways, alternated in one process: padded to the widest (every request verifying the widest pattern's width, the
one-width step), padded to the pattern's mean (what the policy's cost reads a ragged step at), packed with
attention over the whole padded block (one span), and packed with attention in the spans `cuts` chooses. Medians,
in ms. `--shape` as `hf-dflash bench engine-step` takes it (random weights: the rows computed, not the tokens, set
the cost).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from . import harness
from .engine_step import SHAPES, admissions, drafter_block_size, models

DEFAULT_PATTERNS = ["1,1,1,1,1,1,1,16", "1,1,1,1,1,1,1,9", "1,2,3,4,5,6,1,10", "1,1,1,1,2,3,3,4", "2,2,2,2,3,3,3,3"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=list(SHAPES), default="smollm2",
                        help="smollm2 (default: its shape, random weights, the shipped drafter), qwen3-8b or tiny")
    parser.add_argument("--patterns", nargs="+", default=DEFAULT_PATTERNS,
                        help="rows per request, comma-separated, one request per number (default: five patterns of 8)")
    parser.add_argument("--prompt-tokens", type=int, default=400, help="each request's prompt length (default 400)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds of the four variants (default 15)")


def widths_of(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import BadArgument, at_least

    at_least("--prompt-tokens", args.prompt_tokens, 1)
    at_least("--rounds", args.rounds, 1)
    for pattern in args.patterns:
        try:
            widths = widths_of(pattern)
        except ValueError:
            raise BadArgument(f"--patterns {pattern}: write rows per request separated by commas, e.g. 1,4,2") from None
        if min(widths) < 1:
            raise BadArgument(f"--patterns {pattern}: every request verifies at least 1 row (its anchor)")
        block = drafter_block_size(args.shape)
        if max(widths) > block:
            raise BadArgument(f"--patterns {pattern}: the {args.shape} shape's drafter verifies at most {block} rows "
                              "per request")


@torch.no_grad()
def run(args: argparse.Namespace) -> int:
    from ..modeling.dflash_attention import PackedQueries
    from ..modeling.dflash_engine import DFlashEngine, RowScoring

    target, drafter = models(args, "cpu", torch.float32)
    block = drafter.config.block_size
    results = []
    for pattern in args.patterns:
        widths = widths_of(pattern)
        n = len(widths)
        engine = DFlashEngine(target, drafter, max_batch_size=n, adaptive=False)
        for request in admissions(args, n, target.config.vocab_size, max_new_tokens=block + 1):
            engine.admit(*request)
        with engine.proposer.capture:
            span = engine._step_span()
            rows = engine._rows(n, span, RowScoring(sampled=False, penalized=False))
            engine.propose(rows)
            input_ids = torch.cat([rows.anchor_ids, rows.drafts], dim=1)
            positions = rows.anchor_pos[:, None] + engine.block_offsets
            cut = PackedQueries.of(widths, input_ids.device, span)
            whole = PackedQueries.of(widths, input_ids.device)  # no key positions to save: one span

            def verify(width: int, layout: Any = None) -> float:
                engine.proposer.capture.destination = rows.verify_rows[:, :width]
                return harness.timed(lambda: engine._verify_in_pool(
                    rows, input_ids[:, :width], positions[:, :width], layout))[1]

            mean = max(1, round(sum(widths) / n))
            variants = {"padded_widest": lambda: verify(max(widths)), "padded_mean": lambda: verify(mean),
                        "one_span": lambda: verify(cut.width, whole), "cut": lambda: verify(cut.width, cut)}
            harness.alternate(variants, 2)  # warm-up
            timings = {name: harness.Timing.of([1000 * s for s in samples]).median_ms
                       for name, samples in harness.alternate(variants, args.rounds).items()}
        row = {"pattern": pattern, "rows": sum(widths), "key_positions": span, "spans": len(cut.spans),
               **{f"{name}_ms": ms for name, ms in timings.items()},
               "cut_over_one_span": timings["cut"] / timings["one_span"]}
        results.append(row)
        print(f"{pattern:24s} rows {row['rows']:3d}  spans {row['spans']}  " + "  ".join(
            f"{name} {ms:6.1f} ms" for name, ms in timings.items()) + f"  cut/one span {row['cut_over_one_span']:.2f}",
            flush=True)
    report = {**harness.header(args, "cpu"), "shape": args.shape, "block_size": block, "rows": results}
    harness.write_report(args.out, report, plot)
    return 0


def plot(report: dict[str, Any], path: Path) -> None:
    plt = harness.pyplot()
    fig, axis = plt.subplots(figsize=(10, 4))
    rows = report["rows"]
    names = ("padded_widest", "padded_mean", "one_span", "cut")
    harness.grouped_bars(axis, [f"{row['pattern']}\n({row['spans']} spans)" for row in rows],
                         {name: [row[f"{name}_ms"] for row in rows] for name in names}, "ms per verify forward")
    axis.set_title(f"ragged verify, {report['shape']} shape, {report['machine']} ({report['date'][:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
