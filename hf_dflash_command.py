"""The `hf-dflash` command's entry point: `hf_dflash.cli.main`, with Ctrl-C during its import as one line.

Importing the command line takes seconds (torch, transformers); an interrupt then would otherwise print a traceback of
the import machinery. This module imports nothing heavy itself, so it can catch the interrupt; `hf_dflash.cli.main`
handles one that comes later. It lives outside the `hf_dflash` package because importing anything inside the
package runs the package's own heavy `__init__` first.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from hf_dflash.cli import main as run_command
    except KeyboardInterrupt:
        print("hf-dflash: interrupted", file=sys.stderr)
        return 130
    return run_command()


if __name__ == "__main__":
    sys.exit(main())
