"""`hf-dflash serve`: transformers serve (OpenAI-compatible: /v1/chat/completions, /v1/completions, /v1/responses),
with a DFlash drafter attached to the target's continuous batching.

    hf-dflash serve                                          # SmolLM2-135M-Instruct + the shipped drafter
    hf-dflash serve Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16 --port 8000

It is transformers' own server, started with the drafter attached (see serve.py); every option of the installed
transformers serve is taken and passed on as it is. Two defaults differ from transformers serve's: continuous
batching is on (the drafter speculates inside it), and the server binds 127.0.0.1 (pass --host to listen
elsewhere). Remote code runs only with --trust-remote-code. The drafter is checked against the target from their
configs before anything loads; a mismatch is one line naming the fix (exit status 2). SIGTERM stops the server
gracefully: it stops accepting, lets the answers in flight finish for up to --graceful-shutdown-seconds, cancels
the rest, and exits 0.
"""

from __future__ import annotations

import argparse
import enum
import sys
from typing import Any

from .cli_checks import BadArgument, above, add_threads_option, check_bundled_target, check_drafter, check_model
from .generate_cli import DEFAULT_DRAFTER
from .serve import BUNDLED_TARGET, ServedTarget, serve_until_stopped
from .serve_transformers import ServeOption, serve_options

# Where `hf-dflash serve`'s defaults differ from transformers serve's, and why (shown in --help).
OUR_DEFAULTS = {
    "continuous_batching": (True, "the drafter speculates inside continuous batching"),
    "host": ("127.0.0.1", "this machine only; pass --host 0.0.0.0 to listen on every interface"),
}
PREFIX = "transformers_"
SERVE_EXTRA = 'pip install "hf-dflash[serve]"'
  # argparse's dest of transformers serve's options, kept apart from ours


def add_serve_option(group: Any, option: ServeOption) -> None:
    flag = "--" + option.name.replace("_", "-")
    default, why = OUR_DEFAULTS.get(option.name, (option.default, None))
    ours = f" (default here: {default}: {why})" if why else ""
    help_text = argparse.SUPPRESS if option.hidden else option.help + ours
    common = dict(dest=PREFIX + option.name, default=default, help=help_text)
    if option.kind is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
    elif isinstance(option.kind, type) and issubclass(option.kind, enum.Enum):
        group.add_argument(flag, choices=[member.value for member in option.kind], type=str, **common)
    else:
        group.add_argument(flag, type=option.kind, metavar=option.name.upper(), **common)


def transformers_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `Serve(...)` keyword arguments the command line gives (enums as their members)."""
    options = {}
    for option in serve_options():
        value = getattr(args, PREFIX + option.name)
        if isinstance(option.kind, type) and issubclass(option.kind, enum.Enum) and value is not None:
            value = option.kind(value)
        options[option.name] = value
    return options


def check_serve(args: argparse.Namespace) -> None:
    """Run by `cli_checks.check_arguments` before anything loads."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise BadArgument(f"transformers serve needs FastAPI, uvicorn, pydantic and openai: {SERVE_EXTRA}")
    options = transformers_options(args)
    above("--graceful-shutdown-seconds", args.graceful_shutdown_seconds, 0)
    if not options["continuous_batching"]:
        raise BadArgument(
            "the drafter speculates inside continuous batching: leave out --no-continuous-batching (transformers "
            "serve without it decodes one request at a time, and without a drafter)"
        )
    if options.get("api_server_count", 1) != 1:
        raise BadArgument(
            "--api-server-count: hf-dflash serve checks requests in its one API server; leave it at 1 (the model "
            "runs in a process of its own either way)"
        )
    if args.target == BUNDLED_TARGET:
        check_bundled_target("TARGET", args.target)
    else:
        check_model("TARGET", args.target, bundled=False)
    check_drafter("--drafter", args.drafter)
    try:
        served_target(args)  # reads both configs: a drafter that does not fit stops here, before any weights load
    except (ValueError, OSError) as error:
        message = " ".join(str(error).split())
        if "trust_remote_code=True" in message:  # transformers' words for a Python call
            message = (f"{args.target} loads with code of its own, which runs only with --trust-remote-code: read "
                       "that code, then pass --trust-remote-code")
        raise BadArgument(message) from None


def served_target(args: argparse.Namespace) -> ServedTarget:
    return ServedTarget.for_serving(
        args.target,
        args.drafter or str(DEFAULT_DRAFTER),
        trust_remote_code=getattr(args, PREFIX + "trust_remote_code"),
        max_model_len=getattr(args, PREFIX + "max_model_len", None),
        adaptive=args.adaptive,
    )


def run(args: argparse.Namespace) -> int:
    served = served_target(args)
    options = transformers_options(args)
    drafter = served.drafter if args.drafter else f"{DEFAULT_DRAFTER.name} (shipped with hf-dflash)"
    print(
        f"hf-dflash serve: {served.name} with the drafter {drafter} on http://{options['host']}:{options['port']}/v1 "
        f"(model name: {served.name!r}); transformers serve starts now",
        file=sys.stderr,
        flush=True,
    )
    serve_until_stopped(served, options, args.graceful_shutdown_seconds)
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="transformers serve (OpenAI-compatible) with a DFlash drafter in its continuous batching",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "target", nargs="?", default=BUNDLED_TARGET, metavar="TARGET",
        help=f"the model to serve: a folder, a Hub id, or {BUNDLED_TARGET} (the bundled SmolLM2-135M-Instruct, the "
             "default); clients send this name as `model`",
    )
    parser.add_argument("--drafter", default=None,
                        help="the DFlash drafter: a folder or Hub id (default: ours for SmolLM2, "
                             f"{DEFAULT_DRAFTER.name})")
    parser.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine's verify policy: each step verifies only the rows likely to pay, down to "
                             "plain decoding (default: on where the target runs on a CPU, off on a GPU)")
    parser.add_argument("--graceful-shutdown-seconds", type=float, default=30,
                        help="on SIGTERM, how long answers in flight may take to finish before they are cancelled")
    add_threads_option(parser)
    group = parser.add_argument_group("transformers serve's options (passed on as they are)")
    for option in serve_options():
        add_serve_option(group, option)
    parser.set_defaults(func=run)
