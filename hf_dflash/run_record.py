"""What a saved result records about the run that made it (training_args.json, bench and eval reports), written so
that it reads the same on any machine: the command and its paths as a user re-runs them from the repository root,
never a machine's own paths, the name of the device it ran on, the date and the library versions."""

from __future__ import annotations

import platform
import re
import shlex
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch


def portable_command(argv: list[str]) -> str:
    """The command line as a user re-runs it from the repository root: `hf-dflash ...` for the CLI, paths under
    the current directory made relative and the home directory written `~`."""
    program = Path(argv[0]).name if argv else ""
    words = ["hf-dflash"] if program in ("cli.py", "hf-dflash", "__main__.py") else [program]
    return shell_line(words + [portable_path(word) for word in argv[1:]])


def shell_line(words: list[str]) -> str:
    """The words as one shell command line, each quoted where a shell needs it; a leading ~ stays bare, so that the
    shell expands it."""
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


def run_environment(device: torch.device | str, **more_versions: str) -> dict[str, Any]:
    """The date (UTC, to the second), the machine (`device_name`), the CPU threads torch computes with (`--threads`)
    and the versions of the libraries a result depends on; `more_versions` adds others (e.g. bitsandbytes="0.50.2")."""
    import transformers

    from . import __version__

    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "hf_dflash": __version__,
                "python": platform.python_version(), **more_versions}
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": device_name(device),
            "threads": torch.get_num_threads(), "versions": versions}


__all__ = ["device_name", "portable_command", "portable_path", "run_environment", "shell_line"]
