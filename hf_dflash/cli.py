"""`hf-dflash`: the command line. Each subcommand lives with the part it drives and registers itself here."""

from __future__ import annotations

import argparse
import sys

from . import bench, generate_cli, hub_cli
from .training import cli as training_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-dflash",
        description="DFlash speculative decoding for Hugging Face transformers.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate_cli.register(subparsers)
    bench.register(subparsers)
    training_cli.register(subparsers)
    hub_cli.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
