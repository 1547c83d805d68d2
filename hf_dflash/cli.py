"""`hf-dflash`: the command line. Each subcommand lives with the part it drives and registers itself here.

Every argument is checked (`cli_checks.py`) before any model loads. A bad one is one line on stderr that names the
fix, with exit status 2 (argparse's convention); an error after that (while loading or generating) is one line with
exit status 1; Ctrl-C is one line, "interrupted", with exit status 130 (the `hf-dflash` command's entry point,
`hf_dflash_command.py`, does the same while this module is still being imported). `HF_DFLASH_DEBUG=1` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

import torch

from . import bench, generate_cli, hub_cli, serve_cli
from .cli_checks import BadArgument, check_arguments, describe_failure
from .training import cli as training_cli

DEBUG_ENV = "HF_DFLASH_DEBUG"


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, with its errors as one line (`hf-dflash generate: error: ...`) instead of usage + error.
    Subparsers are made of the same class, so this covers every subcommand."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="hf-dflash",
        description="DFlash speculative decoding for Hugging Face transformers.",
        epilog=f"Bad arguments are refused before any model loads; {DEBUG_ENV}=1 shows tracebacks.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate_cli.register(subparsers)
    bench.register(subparsers)
    training_cli.register(subparsers)
    hub_cli.register(subparsers)
    serve_cli.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    prog = "hf-dflash"
    try:
        args = build_parser().parse_args(argv)
        prog = f"hf-dflash {args.command}"
        check_arguments(args)
        if getattr(args, "threads", None):
            torch.set_num_threads(args.threads)
        return args.func(args) or 0
    except KeyboardInterrupt:  # at any moment: while checking (a tokenizer loading), loading or generating
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BadArgument as error:
        if debug:
            raise
        print(f"{prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None  # as argparse does for the errors it finds itself
    except Exception as error:  # the top of the program: one line for the user, the traceback on request
        if debug:
            raise
        print(f"{prog}: error: {describe_failure(error)} ({DEBUG_ENV}=1 shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
