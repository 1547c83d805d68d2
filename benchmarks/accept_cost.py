"""What `accept` (modeling/dflash_acceptance.py) costs under rejection sampling, against its version at an earlier
commit, side by side in one process: the same random scores, drafts and proposals, alternated, fastest of 7.

usage: python benchmarks/accept_cost.py --baseline REV [--device cpu|cuda]
Writes benchmarks/results/accept_cost_<device>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_dflash.bench import run_environment  # noqa: E402
from hf_dflash.generate_cli import timed  # noqa: E402
from hf_dflash.modeling import dflash_acceptance  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# (sequences, block rows, vocabulary): SmolLM2 at batch 1 and 16, Qwen3-8B at batch 1
SHAPES = [(1, 16, 49152), (16, 16, 49152), (1, 16, 151936)]


def module_at(rev: str):
    """dflash_acceptance.py as it was at `rev`, imported as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:modeling/dflash_acceptance.py"], check=True, capture_output=True,
                            text=True).stdout
    path = Path(tempfile.mkdtemp()) / "acceptance_at_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("acceptance_at_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def fastest_ms(call, repeats: int = 7) -> float:
    return 1000 * min(timed(call)[1] for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git revision whose accept to compare with")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(2)
    baseline = module_at(args.baseline)
    generator = torch.Generator().manual_seed(0)
    rows = {}
    for b, n, vocab in SHAPES:
        scores = (torch.randn(b, n, vocab, generator=generator) * 3).to(args.device)
        draft_probs = torch.softmax(torch.randn(b, n - 1, vocab, generator=generator) * 3, dim=-1).to(args.device)
        drafts = dflash_acceptance.sample(draft_probs)
        ours, theirs = [], []
        for _ in range(2):  # alternated, so that drift of a shared machine shows in both
            theirs.append(fastest_ms(lambda: baseline.accept(scores, drafts, True, draft_probs)))
            ours.append(fastest_ms(lambda: dflash_acceptance.accept(scores, drafts, True, draft_probs)))
        rows[f"{b} x {n} x {vocab}"] = {"baseline_ms": round(min(theirs), 3), "now_ms": round(min(ours), 3)}
        print(f"{b} x {n} x {vocab}: {args.baseline} {min(theirs):.2f} ms, now {min(ours):.2f} ms", flush=True)
    report = {**run_environment(args.device), "command": " ".join(["python", *sys.argv]), "baseline": args.baseline,
              "statistic": "fastest of 7, twice, alternated", "shapes": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"accept_cost_{args.device}.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
