"""`hf-dflash bench SCENARIO`: every measurement of the project, one named scenario each, on one harness.

A scenario is one module (its docstring is its `--help`, the first line its one-line summary) with
`add_arguments(parser)`, `run(args)` and, optionally, `check(args)`, registered by one line in SCENARIOS below. The
CLI adds `--out` to every scenario (default benchmarks/results/NAME.json; the plot goes beside it as .png) and
`--threads` (applied before `run`; a scenario may change its default with `parser.set_defaults`), checks `--out` and
then the scenario's own `check` before anything loads, and calls `run`. Every scenario times through `harness.py`
(synchronized calls, warm-up, medians, variants alternated in one process, CUDA graphs where the fast path replays
its step) and records through it (`harness.header` for scenario, command, date, machine, threads and versions;
`harness.write_report` for the JSON and the plot).

To add a scenario:
1. Write the module: a docstring that says what it measures and how; `add_arguments(parser)` with its options
   (not `--out` or `--threads`, which the CLI adds); `check(args)` raising `hf_dflash.cli_checks.BadArgument` with
   the fix for a bad value (it runs before any model loads); `run(args)` that measures, then calls
   `harness.write_report(args.out, {**harness.header(args, device), ...results}, plot)` and returns 0. Import heavy
   or optional packages inside `run`: the CLI imports every scenario module to build its help.
2. Add its line to SCENARIOS: `"name": "package.module"` (any importable module, e.g. `hf_dflash.serve_load`).
3. Run it on tiny inputs in a test (tests/test_bench_scenarios.py), and put its figures, with the command that made
   them, at the top of its topic page in benchmarks/ (benchmarks/README.md lists the pages).
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType
from typing import Any

from ..cli_checks import add_threads_option
from .harness import RESULTS

# name -> module. One line per scenario.
SCENARIOS = {
    "decode": "hf_dflash.bench.decode",
    "step-cost": "hf_dflash.bench.step_cost",
    "sampler-cost": "hf_dflash.bench.sampler_cost",
    "accept-cost": "hf_dflash.bench.accept_cost",
    "top-k-top-p": "hf_dflash.bench.top_k_top_p",
    "sampling-rules": "hf_dflash.bench.sampling_rules",
    "draft-vocabulary": "hf_dflash.bench.draft_vocabulary",
    "rollback-cost": "hf_dflash.bench.rollback_cost",
    "quantized": "hf_dflash.bench.quantized",
    "closeness": "hf_dflash.bench.closeness",
    "soak": "hf_dflash.bench.soak",
    "continuous": "hf_dflash.bench.continuous",
    "engine-step": "hf_dflash.bench.engine_step",
    "ragged-verify": "hf_dflash.bench.ragged_verify",
    "caller-thread": "hf_dflash.bench.caller_thread",
    "dflash2-parts": "hf_dflash.bench.dflash2_parts",
    "training-throughput": "hf_dflash.bench.training_throughput",
    "training-curves": "hf_dflash.bench.training_curves",
}


def default_out(name: str) -> str:
    """Where a scenario's report goes when `--out` is left out (the one folder made when missing)."""
    return str(RESULTS / f"{name.replace('-', '_')}.json")


def scenario_module(name: str) -> ModuleType:
    return importlib.import_module(SCENARIOS[name])


def summary(module: ModuleType) -> str:
    return (module.__doc__ or "").strip().splitlines()[0]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure decoding, a part of the step, sampling, training or reliability (one scenario per question)",
        description="Measure one scenario; each writes a JSON report (and a plot) with the command, date, machine and "
        "versions. `hf-dflash bench SCENARIO --help` says what a scenario measures and how.",
    )
    scenarios = parser.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    for name in SCENARIOS:
        module = scenario_module(name)
        sub = scenarios.add_parser(name, help=summary(module), description=module.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
        add_threads_option(sub)
        module.add_arguments(sub)
        sub.add_argument("--out", default=default_out(name),
                         help="the JSON report, in a folder that exists (a .png plot is written beside it); default: "
                              "%(default)s")
        sub.set_defaults(func=module.run)


def check_scenario(args: argparse.Namespace) -> None:
    """The checks of a scenario's arguments, before anything loads: `--out` is a file to write, then the scenario's
    own `check`. Raises `BadArgument`."""
    from ..cli_checks import check_report_file

    check_report_file("--out", args.out, default_out(args.scenario))
    check = getattr(scenario_module(args.scenario), "check", None)
    if check is not None:
        check(args)


__all__ = ["SCENARIOS", "check_scenario", "default_out", "register", "scenario_module"]
