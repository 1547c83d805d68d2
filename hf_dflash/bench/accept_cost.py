"""What `accept` costs under rejection sampling, now against its version at an earlier commit, in one process.

`accept` (modeling/dflash_acceptance.py) turns a verify step's scores, drafts and the drafter's proposal into the
tokens each sequence commits. This scenario imports the file as it was at `--baseline` (a git revision of this
checkout) beside the current one, gives both the same random scores, drafts and proposals, and times them
alternated, round after round, at each `--shapes` (sequences x block rows x vocabulary; by default SmolLM2's at
batch 1 and 16, and Qwen3-8B's at batch 1). Run from a git checkout of the repository.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

from . import harness

SHAPES = ["1x16x49152", "16x16x49152", "1x16x151936"]


def module_at(rev: str) -> ModuleType:
    """modeling/dflash_acceptance.py as it was at `rev`, imported as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:modeling/dflash_acceptance.py"], check=True, capture_output=True,
                            text=True).stdout
    path = Path(tempfile.mkdtemp()) / "acceptance_at_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("acceptance_at_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def parse_shape(text: str) -> tuple[int, int, int]:
    b, n, vocab = (int(part) for part in text.lower().split("x"))
    return b, n, vocab


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", required=True, help="the git revision whose accept to compare with")
    parser.add_argument("--shapes", nargs="+", default=SHAPES, metavar="BxNxV",
                        help="sequences x block rows x vocabulary (default: %(default)s)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the two versions, alternated")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per version and round")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import BadArgument, at_least, check_device

    check_device("--device", args.device)
    for option in ("rounds", "repeats"):
        at_least("--" + option, getattr(args, option), 1)
    for text in args.shapes:
        try:
            shape = parse_shape(text)
        except ValueError:
            raise BadArgument(f"--shapes {text}: write sequences x rows x vocabulary, e.g. 1x16x49152") from None
        if min(shape) < 1 or shape[1] < 2:
            raise BadArgument(f"--shapes {text}: at least 1 sequence, 2 block rows and 1 token")
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.baseline}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise BadArgument(f"--baseline {args.baseline} is not a commit of this checkout; pass a revision git knows")


def run(args: argparse.Namespace) -> int:
    from ..modeling import dflash_acceptance

    report = harness.header(args, args.device)
    baseline = module_at(args.baseline)
    generator = torch.Generator().manual_seed(0)
    rows = {}
    for text in args.shapes:
        b, n, vocab = parse_shape(text)
        scores = (torch.randn(b, n, vocab, generator=generator) * 3).to(args.device)
        draft_probs = torch.softmax(torch.randn(b, n - 1, vocab, generator=generator) * 3, dim=-1).to(args.device)
        drafts = dflash_acceptance.sample(draft_probs)
        rounds = harness.alternate({
            "baseline": lambda: harness.time_call(lambda: baseline.accept(scores, drafts, True, draft_probs),
                                                  repeats=args.repeats, warmup=1).median_ms,
            "now": lambda: harness.time_call(lambda: dflash_acceptance.accept(scores, drafts, True, draft_probs),
                                             repeats=args.repeats, warmup=1).median_ms,
        }, args.rounds)
        rows[f"{b} x {n} x {vocab}"] = {f"{name}_ms": values for name, values in rounds.items()}
        print(f"{b} x {n} x {vocab}: {args.baseline} {rounds['baseline']} ms, now {rounds['now']} ms", flush=True)
    report.update(baseline=args.baseline,
                  statistic=f"median of {args.repeats} calls per round, {args.rounds} rounds alternated", shapes=rows)
    harness.write_report(args.out, report, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    plt = harness.pyplot()
    shapes = list(report["shapes"])
    fig, axis = plt.subplots(figsize=(7, 3.6))
    harness.grouped_bars(axis, shapes, {
        f"{report['baseline']} (baseline)": [min(report["shapes"][s]["baseline_ms"]) for s in shapes],
        "now": [min(report["shapes"][s]["now_ms"]) for s in shapes],
    }, "ms per call (best round's median)")
    axis.set_title(f"accept under rejection sampling, {report['machine']} ({report['date'][:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
