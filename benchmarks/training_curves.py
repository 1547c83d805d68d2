"""Training curves of every run on one plot: loss and simulated tau against anchor blocks and GPU-minutes, with
the real (HumanEval) tau measured after a run as points.

A run is a `train_log.jsonl` written by `hf-dflash train` (one line per --log-every steps: step, loss, simulated
tau, anchor blocks and training seconds so far), or an older progress-bar log (carriage returns turned into
newlines: `... 2>&1 | tr '\\r' '\\n' > run.log`) or a run of an earlier report of this script
(`REPORT.json#RUN_LABEL`, steps, loss and tau per step), which have steps only: give them the anchor blocks per
step and the seconds per step to place them on the same axes (`LABEL=LOG@BLOCKS_PER_STEP@SECONDS_PER_STEP`). A run that
continues another starts where that one ended: `--offset LABEL=BLOCKS@SECONDS`. Real tau: `--tau
"LABEL=TAU@BLOCKS@SECONDS"` (a point per measurement). `--previous REPORT.json` keeps every run and point of an
earlier report of this script, already placed, so each session adds its runs to one plot.

    python benchmarks/training_curves.py --run "hard=run/hard/train_log.jsonl" --out benchmarks/results/curves.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", default=[], metavar="LABEL=LOG")
    parser.add_argument("--previous", help="an earlier report of this script whose runs and points are kept")
    parser.add_argument("--offset", action="append", default=[], metavar="LABEL=BLOCKS@SECONDS")
    parser.add_argument("--tau", action="append", default=[], metavar="LABEL=TAU@BLOCKS@SECONDS")
    parser.add_argument("--out", required=True, help="JSON report; the plot is written beside it (.png)")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    offsets = {}
    for spec in args.offset:
        label, _, rest = spec.partition("=")
        offsets[label] = tuple(float(x) for x in rest.split("@"))
    report = {"runs": {}, "real_tau": []}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    if args.previous:
        previous = json.loads(Path(args.previous).read_text())
        for label, run in previous["runs"].items():
            report["runs"][label] = run
            for column, x in enumerate((run["anchor_blocks_m"], run["gpu_minutes"])):
                axes[0, column].plot(x, run["loss"], label=label)
                axes[1, column].plot(x, run["tau"], label=label)
        for point in previous["real_tau"]:
            report["real_tau"].append(point)
            for column, x in enumerate((point["anchor_blocks_m"], point["gpu_minutes"])):
                axes[1, column].scatter([x], [point["tau"]], marker="*", s=120, zorder=3, label=f"{point['label']} (real)")
    for spec in args.run:
        label, rows = parse_run(spec)
        blocks0, seconds0 = offsets.get(label, (0.0, 0.0))
        blocks = [(blocks0 + r["anchor_blocks"]) / 1e6 for r in rows]
        minutes = [(seconds0 + r["wall_time_s"]) / 60 for r in rows]
        report["runs"][label] = {"anchor_blocks_m": blocks, "gpu_minutes": minutes,
                                 "loss": [r["loss"] for r in rows], "tau": [r["tau"] for r in rows]}
        for column, x in enumerate((blocks, minutes)):
            axes[0, column].plot(x, [r["loss"] for r in rows], label=label)
            axes[1, column].plot(x, [r["tau"] for r in rows], label=label)
        print(f"{label}: {len(rows)} points, last: loss {rows[-1]['loss']:.3f}, simulated tau {rows[-1]['tau']:.3f}, "
              f"{blocks[-1]:.1f}M anchor blocks, {minutes[-1]:.1f} GPU-minutes")
    for spec in args.tau:
        label, _, rest = spec.partition("=")
        tau, blocks, seconds = (float(x) for x in rest.split("@"))
        report["real_tau"].append({"label": label, "tau": tau, "anchor_blocks_m": blocks / 1e6,
                                   "gpu_minutes": seconds / 60})
        for column, x in enumerate((blocks / 1e6, seconds / 60)):
            axes[1, column].scatter([x], [tau], marker="*", s=120, zorder=3, label=f"{label} (real)")
    for column, name in enumerate(("anchor blocks trained (millions)", "GPU-minutes of training")):
        axes[0, column].set(xlabel=name, ylabel="training loss (window mean)")
        axes[1, column].set(xlabel=name, ylabel="tau: simulated (lines), HumanEval (stars)")
    axes[1, 1].legend(fontsize=7)
    fig.tight_layout()
    out = Path(args.out)
    out.write_text(json.dumps(report))
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
