"""The wheel holds every module and data file of the checkout, and the installed layout finds its data.

`scripts/check_install.sh` goes further (a fresh virtual environment, the CLI run from outside the checkout); these
tests are the fast part: build the wheel from the files git knows, compare its contents with the checkout, and import
the unpacked wheel in a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hf_dflash import bundled_models, hub

REPO = Path(__file__).resolve().parent.parent
# Checkout folder -> where its files live in the wheel (pyproject.toml's package-dir).
WHEEL_LOCATION = {"hf_dflash": "hf_dflash", "modeling": "hf_dflash/modeling", "hub_configs": "hf_dflash/hub_configs"}
ENTRY_MODULE = "hf_dflash_command.py"  # the `hf-dflash` command's entry point, a module of its own at the top level
STORIES_README = REPO / "hf_dflash" / "models" / "stories260K" / "README.md"


def checkout_files() -> list[str]:
    """Tracked and new (not ignored) files of the checkout, as a fresh clone plus local edits would have them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    return sorted(f for f in listed if f and (REPO / f).is_file())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout's files (no stale build/ folder, no virtual environment)."""
    root = tmp_path_factory.mktemp("wheel")
    for name in checkout_files():
        (root / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / "src" / name)
    # No build isolation: it would fetch setuptools from an index; the test extra installs it.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"),
         str(root / "src")],
        check=True, capture_output=True,
    )
    (built,) = (root / "dist").glob("hf_dflash-*.whl")
    return built


def test_wheel_holds_exactly_the_package_files_of_the_checkout(wheel):
    expected = set()
    for name in checkout_files():
        top, _, rest = name.partition("/")
        if top in WHEEL_LOCATION and rest and "__pycache__" not in name:
            expected.add(f"{WHEEL_LOCATION[top]}/{rest}")
    expected.add(ENTRY_MODULE)
    with zipfile.ZipFile(wheel) as archive:
        packaged = {n for n in archive.namelist() if ".dist-info/" not in n}
        entry_points = next(n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt"))
        assert "hf-dflash = hf_dflash_command:main" in archive.read(entry_points).decode()
    assert packaged - expected == set(), "the wheel holds files the checkout does not"
    assert expected - packaged == set(), "files of the checkout left out of the wheel: fix pyproject.toml"
    # The parts issue 17 found missing, named so a regression reads plainly.
    for part in ("hf_dflash/training/cli.py", "hf_dflash/hub_configs/index.json",
                 "hf_dflash/models/stories260K/stories260K.gguf", "hf_dflash/models/stories260K/LICENSE"):
        assert part in packaged


def test_unpacked_wheel_finds_its_configs_and_stories260k_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    probe = (
        "import json, hf_dflash\n"
        "from hf_dflash import bundled_models, hub\n"
        "config = hf_dflash.DFlashConfig.from_pretrained('z-lab/Qwen3-8B-DFlash-b16')\n"
        "print(json.dumps({'package': hf_dflash.__file__, 'hub_configs': str(hub.HUB_CONFIGS),\n"
        "    'stories260k': str(bundled_models.stories260k_gguf_path()), 'block_size': config.block_size}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    env.pop(bundled_models.STORIES260K_ENV, None)
    # The wheel comes first on sys.path, ahead of the editable install's finder; cwd is outside the checkout.
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("package", "hub_configs", "stories260k"):
        assert Path(found[key]).is_relative_to(site), (key, found[key])
    assert found["block_size"] == 16


def test_checkout_finds_the_top_level_hub_configs():
    assert hub.HUB_CONFIGS == REPO / "hub_configs"


def test_stories260k_copy_is_the_recorded_file():
    recorded = re.search(r"sha256 `([0-9a-f]{64})`", STORIES_README.read_text()).group(1)
    path = REPO / "hf_dflash" / "models" / "stories260K" / "stories260K.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == recorded
    assert bundled_models.STORIES260K_GGUF == path


def test_stories260k_path_comes_from_the_package_unless_overridden(monkeypatch, tmp_path):
    monkeypatch.delenv(bundled_models.STORIES260K_ENV, raising=False)
    assert bundled_models.stories260k_gguf_path() == bundled_models.STORIES260K_GGUF
    copy = tmp_path / "elsewhere.gguf"
    shutil.copy(bundled_models.STORIES260K_GGUF, copy)
    monkeypatch.setenv(bundled_models.STORIES260K_ENV, str(copy))
    assert bundled_models.stories260k_gguf_path() == copy.resolve()
    monkeypatch.setenv(bundled_models.STORIES260K_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match=re.escape(f"${bundled_models.STORIES260K_ENV} points at")):
        bundled_models.stories260k_gguf_path()


def test_stories260k_without_gguf_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # find_spec then reports it missing, as on a plain install
    with pytest.raises(ImportError, match=re.escape('pip install "hf-dflash[local]"')):
        bundled_models.load_stories260k()


def test_every_import_of_our_own_modules_names_something_that_exists():
    """Imports inside functions (GPU-only and optional paths, which CPU tests never run) are checked too: each name
    taken from one of hf-dflash's own modules exists there (a module whose optional dependency is missing is left
    out)."""
    import ast
    import importlib

    missing = []
    for path in sorted([*REPO.glob("hf_dflash/**/*.py"), *REPO.glob("modeling/*.py")]):
        if "models" in path.relative_to(REPO).parts[1:-1]:
            continue
        parts = path.relative_to(REPO).with_suffix("").parts
        package = ("hf_dflash.modeling",) if parts[0] == "modeling" else parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = list(package[0].split(".") if parts[0] == "modeling" else package)
                base = base[: len(base) - node.level + 1]
                name = ".".join([*base, *([node.module] if node.module else [])])
            elif (node.module or "").startswith("hf_dflash"):
                name = node.module
            else:
                continue
            try:
                module = importlib.import_module(name)
            except ImportError:  # an optional dependency of that module
                continue
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{name}.{alias.name}")
                    except ImportError:
                        missing.append(f"{path.relative_to(REPO)}:{node.lineno} {name}.{alias.name}")
    assert not missing, missing
