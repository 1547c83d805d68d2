"""Runs `hf-dflash serve` for the serving tests: its own parser, checks and `serve_until_stopped`, with the target
prepared by `FaultyServedTarget` (tests/serve_helpers.py). `--no-drafter-for-tests` serves with transformers' own
continuous-batching manager instead of the drafter (the drafter is still checked against the target).

usage: python tests/serve_launcher.py serve TARGET --drafter DRAFTER [hf-dflash serve's options]
                                      [--no-drafter-for-tests]
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

# The model's process (spawned by transformers serve from 5.25) unpickles FaultyServedTarget by its module's name.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_dflash import serve_cli  # noqa: E402
from hf_dflash.cli import build_parser  # noqa: E402
from hf_dflash.cli_checks import check_arguments  # noqa: E402
from hf_dflash.serve import ServedTarget, serve_until_stopped  # noqa: E402
from tests.serve_helpers import FaultyServedTarget  # noqa: E402

NO_DRAFTER = "--no-drafter-for-tests"


def main(argv: list[str]) -> int:
    args = build_parser().parse_args([word for word in argv if word != NO_DRAFTER])
    check_arguments(args)
    served = serve_cli.served_target(args)
    if NO_DRAFTER in argv:
        max_model_len = getattr(args, "transformers_max_model_len", None)  # an option from transformers 5.25
        served = ServedTarget.for_serving(args.target, None, max_model_len=max_model_len)
    faulty = FaultyServedTarget(**{field.name: getattr(served, field.name) for field in fields(ServedTarget)})
    serve_until_stopped(faulty, serve_cli.transformers_options(args), args.graceful_shutdown_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
