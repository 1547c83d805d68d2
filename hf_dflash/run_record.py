"""What a saved result records about the run that made it (training_args.json, bench and eval reports), written so
that it reads the same on any machine: the command and its paths as a user re-runs them from the repository root,
never a machine's own paths, and the name of the device it ran on."""

from __future__ import annotations

import platform
import re
import shlex
from pathlib import Path

import torch


def portable_command(argv: list[str]) -> str:
    """The command line as a user re-runs it from the repository root: `hf-dflash ...` for the CLI, paths under
    the current directory made relative and the home directory written `~`."""
    program = Path(argv[0]).name if argv else ""
    words = ["hf-dflash"] if program in ("cli.py", "hf-dflash", "__main__.py") else [program]
    words += [portable_path(word) for word in argv[1:]]
    # Quoted for a shell where needed; a leading ~ stays bare, so that the shell expands it.
    return " ".join(w if re.fullmatch(r"~?[\w@%+=:,./-]*", w) else shlex.quote(w) for w in words)


def portable_path(word: str) -> str:
    """A path under the current directory made relative, one under the home directory written `~`."""
    cwd, home = str(Path.cwd()) + "/", str(Path.home())
    if word.startswith(cwd):
        return word[len(cwd):]
    if word == home or word.startswith(home + "/"):
        return "~" + word[len(home):]
    return word


def device_name(device: torch.device | str) -> str:
    """'NVIDIA H200' for a CUDA device, 'x86_64 CPU' (the machine's architecture) otherwise."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} CPU"


__all__ = ["device_name", "portable_command", "portable_path"]
