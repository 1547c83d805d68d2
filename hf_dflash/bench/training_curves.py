"""Training curves of every run on one plot: loss and simulated tau against anchor blocks and GPU-minutes.

The real (HumanEval) tau measured after a run is drawn as points.

A run is a `train_log.jsonl` written by `hf-dflash train` (one line per --log-every steps: step, loss, simulated
tau, anchor blocks and training seconds so far), or an older progress-bar log (carriage returns turned into
newlines: `... 2>&1 | tr '\\r' '\\n' > run.log`) or a run of an earlier report of this scenario
(`REPORT.json#RUN_LABEL`, steps, loss and tau per step), which have steps only: give them the anchor blocks per step
and the seconds per step to place them on the same axes (`LABEL=LOG@BLOCKS_PER_STEP@SECONDS_PER_STEP`). A run that
continues another starts where that one ended: `--offset LABEL=BLOCKS@SECONDS`. Real tau: `--tau
"LABEL=TAU@BLOCKS@SECONDS"` (a point per measurement). `--previous REPORT.json` keeps every run and point of an
earlier report of this scenario, already placed, so each session adds its runs to one plot.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from . import harness

STEP = re.compile(r"train:.*\| (\d+)/(\d+) .*loss=([0-9.]+), lr=[0-9.e+-]+, tau=([0-9.]+)")
WINDOW = 50  # progress-bar steps per mean, as the trainer's own final_loss / final_tau


def parse_progress_log(path: Path, blocks_per_step: float, seconds_per_step: float) -> list[dict]:
    """Rows of a progress-bar log, one per step (a step printed twice keeps its last line), as 50-step means."""
    steps = {}
    for line in path.read_text(errors="replace").splitlines():
        if match := STEP.match(line):
            steps[int(match[1])] = (float(match[3]), float(match[4]))
    order = sorted(steps)
    return steps_to_rows(order, [steps[s][0] for s in order], [steps[s][1] for s in order], blocks_per_step,
                         seconds_per_step)


def steps_to_rows(steps: list[int], loss: list[float], tau: list[float], blocks_per_step: float,
                  seconds_per_step: float) -> list[dict]:
    """Per-step values as 50-step means, placed by anchor blocks and seconds."""
    rows = []
    for i, step in enumerate(steps):
        window = slice(max(0, i - WINDOW + 1), i + 1)
        rows.append({"step": step, "loss": sum(loss[window]) / len(loss[window]),
                     "tau": sum(tau[window]) / len(tau[window]), "anchor_blocks": step * blocks_per_step,
                     "wall_time_s": step * seconds_per_step})
    return rows


def parse_run(spec: str) -> tuple[str, list[dict]]:
    label, _, rest = spec.partition("=")
    path, *scale = rest.split("@")
    if path.endswith(".jsonl"):
        return label, [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if "#" in path:  # a run of an earlier report: {label: {"steps", "loss", "tau"}}
        report, _, key = path.partition("#")
        run = json.loads(Path(report).read_text())[key]
        return label, steps_to_rows(run["steps"], run["loss"], run["tau"], float(scale[0]), float(scale[1]))
    return label, parse_progress_log(Path(path), float(scale[0]), float(scale[1]))


def placed_run(spec: str, offsets: dict[str, tuple[float, float]]) -> tuple[str, dict[str, list[float]]]:
    """A `--run` as the report keeps it: loss and simulated tau against millions of anchor blocks and GPU-minutes,
    from where its `--offset` says the run started."""
    label, rows = parse_run(spec)
    blocks0, seconds0 = offsets.get(label, (0.0, 0.0))
    return label, {"anchor_blocks_m": [(blocks0 + r["anchor_blocks"]) / 1e6 for r in rows],
                   "gpu_minutes": [(seconds0 + r["wall_time_s"]) / 60 for r in rows],
                   "loss": [r["loss"] for r in rows], "tau": [r["tau"] for r in rows]}


def split_spec(option: str, spec: str, parts: int) -> tuple[str, list[float]]:
    """LABEL=A@B[@C] -> (label, [A, B, C])."""
    from ..cli_checks import BadArgument

    label, _, rest = spec.partition("=")
    try:
        values = [float(x) for x in rest.split("@")]
    except ValueError:
        values = []
    if not label or len(values) != parts:
        raise BadArgument(f"{option} {spec}: write LABEL=" + "@".join(["NUMBER"] * parts))
    return label, values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", nargs="+", default=[], metavar="LABEL=LOG", help="runs' logs")
    parser.add_argument("--previous", default=None, help="an earlier report of this scenario whose runs are kept")
    parser.add_argument("--offset", nargs="+", default=[], metavar="LABEL=BLOCKS@SECONDS",
                        help="where continued runs start")
    parser.add_argument("--tau", nargs="+", default=[], metavar="LABEL=TAU@BLOCKS@SECONDS",
                        help="real tau measured after runs")


def check(args: argparse.Namespace) -> None:
    from ..cli_checks import BadArgument

    if not args.run and not args.previous:
        raise BadArgument("nothing to plot: pass --run LABEL=LOG (or --previous REPORT.json)")
    for spec in args.run:
        label, _, rest = spec.partition("=")
        if not label or not Path(rest.split("@")[0].partition("#")[0]).is_file():
            raise BadArgument(f"--run {spec}: write LABEL=LOG with a log file that exists")
    if args.previous is not None and not Path(args.previous).is_file():
        raise BadArgument(f"--previous {args.previous}: no such file")
    for spec in args.offset:
        split_spec("--offset", spec, 2)
    for spec in args.tau:
        split_spec("--tau", spec, 3)


def run(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {**harness.header(args, "cpu"), "runs": {}, "real_tau": []}
    if args.previous:
        previous = json.loads(Path(args.previous).read_text())
        report["runs"].update(previous["runs"])
        report["real_tau"] += previous["real_tau"]
    offsets = {label: tuple(values) for label, values in (split_spec("--offset", s, 2) for s in args.offset)}
    for spec in args.run:
        label, run_ = placed_run(spec, offsets)
        report["runs"][label] = run_
        print(f"{label}: {len(run_['loss'])} points, last: loss {run_['loss'][-1]:.3f}, simulated tau "
              f"{run_['tau'][-1]:.3f}, {run_['anchor_blocks_m'][-1]:.1f}M anchor blocks, {run_['gpu_minutes'][-1]:.1f} "
              "GPU-minutes")
    for spec in args.tau:
        label, (tau, blocks, seconds) = split_spec("--tau", spec, 3)
        report["real_tau"].append({"label": label, "tau": tau, "anchor_blocks_m": blocks / 1e6,
                                   "gpu_minutes": seconds / 60})
    harness.write_report(args.out, report, plot)
    return 0


def plot(report: dict, path: Path) -> None:
    """Loss (top) and tau (bottom) against anchor blocks (left) and GPU-minutes (right); real tau as stars."""
    plt = harness.pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for label, run_ in report["runs"].items():
        for column, x in enumerate((run_["anchor_blocks_m"], run_["gpu_minutes"])):
            axes[0, column].plot(x, run_["loss"], label=label)
            axes[1, column].plot(x, run_["tau"], label=label)
    for point in report["real_tau"]:
        for column, x in enumerate((point["anchor_blocks_m"], point["gpu_minutes"])):
            axes[1, column].scatter([x], [point["tau"]], marker="*", s=120, zorder=3, label=f"{point['label']} (real)")
    for column, name in enumerate(("anchor blocks trained (millions)", "GPU-minutes of training")):
        axes[0, column].set(xlabel=name, ylabel="training loss (window mean)")
        axes[1, column].set(xlabel=name, ylabel="tau: simulated (lines), HumanEval (stars)")
    axes[1, 1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
