"""Loss and simulated tau per step, parsed from `hf-dflash train` logs, as JSON and a plot (one line per run).

The training progress bar prints `loss=..., lr=..., tau=...` at every step; pass its output, carriage returns
turned into newlines (`... 2>&1 | tr '\\r' '\\n' > run.log`):

    python benchmarks/training_curves.py --run "label=run.log" [--run ...] --out benchmarks/results/curves.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

STEP = re.compile(r"train:.*\| (\d+)/(\d+) .*loss=([0-9.]+), lr=[0-9.e+-]+, tau=([0-9.]+)")
WINDOW = 50  # steps per mean, as the trainer's own final_loss / final_tau


def parse_log(path: str | Path) -> dict[int, tuple[float, float]]:
    """{step: (loss, simulated tau)}; a step printed twice keeps its last line."""
    rows = {}
    for line in Path(path).read_text(errors="replace").splitlines():
        if match := STEP.match(line):
            rows[int(match[1])] = (float(match[3]), float(match[4]))
    return rows


def trailing_mean(values: list[float], i: int) -> float:
    window = values[max(0, i - WINDOW + 1) : i + 1]
    return sum(window) / len(window)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, metavar="LABEL=LOG")
    parser.add_argument("--out", required=True, help="JSON report; the plot is written beside it (.png)")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report, (fig, axes) = {}, plt.subplots(1, 2, figsize=(11, 4))
    for run in args.run:
        label, _, path = run.partition("=")
        rows = parse_log(path)
        steps = sorted(rows)
        loss, tau = [rows[s][0] for s in steps], [rows[s][1] for s in steps]
        report[label] = {"steps": steps, "loss": loss, "tau": tau}
        for ax, values in zip(axes, (loss, tau)):
            ax.plot(steps, [trailing_mean(values, i) for i in range(len(values))], label=label)
        print(f"{label}: {len(steps)} steps, last {WINDOW}: loss {trailing_mean(loss, len(loss) - 1):.3f}, "
              f"tau {trailing_mean(tau, len(tau) - 1):.3f}")
    axes[0].set(xlabel="optimizer step", ylabel=f"weighted CE loss ({WINDOW}-step mean)")
    axes[1].set(xlabel="optimizer step", ylabel=f"simulated tau ({WINDOW}-step mean)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    out = Path(args.out)
    out.write_text(json.dumps(report))
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
