"""The examples of the documentation run as written, as the README's snippet does (tests/test_readme.py).

- Every ```python block of docs/ and benchmarks/ runs, with the Hub ids of test_readme.py replaced, as text, by local
  stand-ins: stories260K (saved as a transformers checkpoint, with a pad token so that it pads a batch as Qwen3's
  tokenizer does) and a seeded random drafter for it. A block that decodes must run the drafter; a block that
  defines a scenario (`add_arguments` and `run`) is run as `hf-dflash bench` runs one and must write its report.
- Every command of a ```bash block in the README, docs/ and benchmarks/ is one that exists: an `hf-dflash` command
  line parses with the command's own parser (nothing is run), and a script, example, test file or shell file it
  names is in the checkout. Lines ending in a backslash continue; `#` starts a comment.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
import torch

import hf_dflash
from hf_dflash.bundled_models import load_stories260k
from hf_dflash.cli import build_parser
from tests.test_readme import DRAFTER_ID, TARGET_ID

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([*REPO.glob("docs/*.md"), *REPO.glob("benchmarks/*.md"), REPO / "benchmarks" / "gpu" / "README.md"])
COMMAND_PAGES = [REPO / "README.md", *PAGES]


def blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), flags=re.DOTALL | re.MULTILINE)


# serving.md's examples talk to, or start, a server: tests/test_serve_smollm2.py runs its client example against a
# live one, and tests/test_serve*.py cover the Python ways in.
SERVER_PAGES = {REPO / "docs" / "serving.md"}
PYTHON_BLOCKS = [pytest.param(block, id=f"{page.relative_to(REPO)}:{number}")
                 for page in PAGES if page not in SERVER_PAGES
                 for number, block in enumerate(blocks(page, "python"), 1)]


def test_the_pages_hold_examples():
    assert len(PYTHON_BLOCKS) >= 2 and len(COMMANDS) >= 40


@pytest.fixture(scope="module")
def local_ids(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("docs")
    target, tokenizer = load_stories260k()
    tokenizer.pad_token = tokenizer.unk_token  # Qwen3's tokenizer has a pad token; stories260K's has none
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    torch.manual_seed(0)
    config = hf_dflash.DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=8, mask_token_id=0)
    hf_dflash.DFlashDraftModel(config).save_pretrained(root / "drafter")
    return {TARGET_ID: str(root / "target"), DRAFTER_ID: str(root / "drafter")}


@pytest.mark.parametrize("block", PYTHON_BLOCKS)
def test_python_examples_run_as_written(block, local_ids, monkeypatch, tmp_path, one_thread):
    for hub_id, local in local_ids.items():
        block = block.replace(f'"{hub_id}"', repr(local))
    forwards = []
    forward = hf_dflash.DFlashDraftModel.forward
    monkeypatch.setattr(hf_dflash.DFlashDraftModel, "forward",
                        lambda self, *args, **kwargs: forwards.append(1) or forward(self, *args, **kwargs))
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(block, "docs example", "exec"), namespace)
    if "assistant_model=drafter" in block:
        assert forwards, "the example never ran the drafter"
    if {"add_arguments", "run"} <= namespace.keys():  # a scenario: run it as `hf-dflash bench` would
        parser = argparse.ArgumentParser()
        namespace["add_arguments"](parser)
        args = parser.parse_args(["--device", "cpu"] if "--device" in parser.format_help() else [])
        args.scenario, args.out = "example", str(tmp_path / "example.json")
        assert namespace["run"](args) == 0
        report = json.loads((tmp_path / "example.json").read_text())
        assert {"scenario", "command", "date", "machine", "versions"} <= report.keys()


def command_lines(page: Path) -> list[str]:
    """The commands of a page's bash blocks: continued lines joined, each `&&`-separated part on its own."""
    commands = []
    for block in blocks(page, "bash"):
        pending = ""  # a line whose quote is still open (a JSON body over several lines) joins the next
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(pending + line, comments=True)
            except ValueError:
                pending += line + "\n"
                continue
            pending = ""
            while words:
                part = words[: words.index("&&")] if "&&" in words else words
                commands.append(shlex.join(part))
                words = words[len(part) + 1 :]
    return [command for command in commands if command]


COMMANDS = [pytest.param(command, id=f"{page.relative_to(REPO)}: {command[:60]}")
            for page in COMMAND_PAGES for command in command_lines(page)]
CLI = (["hf-dflash"], ["python3", "-m", "hf_dflash.cli"], ["python", "-m", "hf_dflash.cli"])


def named_files(words: list[str]) -> list[str]:
    """The files of the checkout a (non-CLI) command runs."""
    if words[1:3] == ["-m", "pytest"]:
        return [word for word in words[3:] if not word.startswith("-")]
    if words[0] in ("bash", "source", "python", "python3"):
        return words[1:2]
    if words[0] in ("torchrun", "accelerate"):
        return [word for word in words if word.endswith(".py")]
    raise AssertionError(f"`{shlex.join(words)}`: a kind of command this test does not check; teach it")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_documented_command_exists(command):
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # environment settings before the command
        words = words[1:]
    cli = next((prefix for prefix in CLI if words[: len(prefix)] == prefix), None)
    if cli is not None:
        try:
            build_parser().parse_args(words[len(cli):])
        except SystemExit as exit_:
            pytest.fail(f"`{command}` does not parse (exit {exit_.code})")
    elif words[0] in ("python", "python3") and words[1] == "-m" and words[2] != "pytest":
        assert importlib.util.find_spec(words[2]) is not None, f"`{command}` runs a module not here"
    elif words[0] == "curl":  # requests to a running server: tests/test_serve_smollm2.py sends them
        assert any(word.startswith("http://127.0.0.1:") for word in words), f"`{command}` asks a remote host"
    elif words[:2] != ["pip", "install"]:  # installs are not run here; their extras are checked below
        files = named_files(words)
        assert files and all((REPO / name).is_file() for name in files), f"`{command}` names a file not here"


def test_the_extras_the_pages_install_exist():
    section = (REPO / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = set(re.findall(r"^(\w+) = \[", section, flags=re.MULTILINE))
    named = {extra for page in COMMAND_PAGES for command in command_lines(page)
             for extra in re.findall(r"\.\[(\w+)\]", command)}
    assert named and named <= extras, named - extras
