"""transformers' (and torch's) private and version-dependent API is used in one file, modeling/dflash_compat.py.

The scan reads the source (ast) of modeling/ and hf_dflash/: outside dflash_compat.py, an underscore name reached as
an attribute (`x._name`, or `getattr(x, "_name")`) or imported from another package must be one this project defines
itself, and the names of transformers' cache internals that changed between versions must not appear at all. A new
transformers release that renames something then breaks dflash_compat.py and nothing else. Also checked here: the
few compat entries whose behaviour the rest of the project relies on across threads.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import threading
from pathlib import Path

import pytest
import torch

from hf_dflash.modeling import dflash_compat
from tests.test_hybrid_fast_path import paged_hybrid_cache
from tests.test_families import family_target

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.glob("modeling/**/*.py"), *ROOT.glob("hf_dflash/**/*.py")])
COMPAT = ROOT / "modeling" / "dflash_compat.py"
# Names of transformers' cache internals and modeling-module globals that differ between the supported versions.
VERSION_DEPENDENT = {"conv_states", "recurrent_states", "cumulative_length_linear", "torch_chunk_gated_delta_rule"}
# Private names of other packages that stay outside dflash_compat.py, with why.
ALLOWED = {"_SubParsersAction": "argparse's subparsers type, in an annotation; the standard library keeps it"}
ATTRIBUTE_BUILTINS = {"getattr", "hasattr", "setattr", "delattr"}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in SOURCES}


def attribute_string(node: ast.AST) -> str | None:
    """The attribute name of `getattr(x, "name", ...)` and its relatives, else None."""
    if (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_BUILTINS
        and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def defined_names(modules: dict[Path, ast.Module]) -> set[str]:
    """Every name the project defines: functions, classes, module and class variables, the attributes its classes
    set on themselves, and those it sets on other objects under its own `_dflash` prefix (`drafter._dflash_...`).
    Writing another package's private attribute (`config._attn_implementation_internal = ...`) defines nothing."""
    names = set()
    for tree in modules.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                on_itself = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if on_itself or node.attr.startswith("_dflash"):
                    names.add(node.attr)
    return names


def uses(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, name, how) for every attribute name, attribute string and imported name of `tree`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr, "attribute"))
        elif isinstance(node, ast.Constant) and node.value in VERSION_DEPENDENT:
            found.append((node.lineno, node.value, "string"))
        elif (name := attribute_string(node)) is not None:
            found.append((node.lineno, name, "attribute string"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found += [(node.lineno, part, "imported module") for part in (node.module or "").split(".")]
            found += [(node.lineno, alias.name, "imported name") for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, part, "imported module") for alias in node.names for part in alias.name.split(".")]
    return found


def test_private_and_version_dependent_names_only_in_compat():
    modules = trees()
    assert COMPAT in modules and len(modules) > 40  # the scan reads the whole library and bundle
    ours = defined_names(modules)
    problems = []
    for path, tree in modules.items():
        if path == COMPAT:
            continue
        for line, name, how in uses(tree):
            where = f"{path.relative_to(ROOT)}:{line}: {how} {name!r}"
            if name in VERSION_DEPENDENT:
                problems.append(f"{where} differs between transformers versions")
            elif private(name) and name not in ours and name not in ALLOWED:
                problems.append(f"{where} is another package's private name")
    assert not problems, "move these behind a function of modeling/dflash_compat.py:\n" + "\n".join(problems)


def test_the_scan_finds_what_it_looks_for():
    """The scan flags a private transformers name, a version-dependent one and a private import, and passes the
    project's own underscore names."""
    tree = ast.parse(
        "import torch._dynamo\n"
        "x = config._attn_implementation\n"
        "y = getattr(layer, 'cumulative_length_linear', None)\n"
        "RULE = 'torch_chunk_gated_delta_rule'\n"
        "config._attn_implementation_internal = 'sdpa'\n"
        "self._ours = 1\n"
        "z = self._ours\n"
    )
    found = {name for _, name, _ in uses(tree)}
    assert {"_dynamo", "_attn_implementation", "cumulative_length_linear", "torch_chunk_gated_delta_rule"} <= found
    defined = defined_names({COMPAT: tree})
    assert "_ours" in defined and "_attn_implementation_internal" not in defined
    assert not {"_attn_implementation", "_attn_implementation_internal"} & defined_names(trees())


def test_compat_names_exist_in_this_transformers():
    """Each private name dflash_compat.py reaches exists in the installed transformers (run at both ends of the
    supported range)."""
    from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel
    from transformers.cache_utils import DynamicLayer

    config = PretrainedConfig()
    assert dflash_compat.has_attention_implementation(config)
    dflash_compat.set_attention_implementation(config, "eager")
    assert dflash_compat.attention_implementation(config) == "eager"
    assert "num_assistant_tokens" in dflash_compat.default_generation_params(GenerationConfig())
    assert callable(getattr(PreTrainedModel, "_upload_modified_files"))
    assert callable(getattr(PreTrainedModel, "_from_config"))
    layer = DynamicLayer()
    layer.lazy_initialization(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    layer.keys, layer.values = torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4)
    dflash_compat.drop_front_slots(layer, 2)
    assert layer.keys.shape[2] == layer.values.shape[2] == 3


def test_cache_argument_matches_this_transformers():
    target = family_target("llama")
    name = dflash_compat.cache_argument(target)
    assert name in dflash_compat.CACHE_ARGUMENTS
    assert name in inspect.signature(target.forward).parameters


def test_chunk_rule_recorded_for_the_recording_thread_only():
    """`recording_chunk_rule`: a Gated DeltaNet forward of this thread is recorded; the same forward run by another
    thread meanwhile is not, and both compute what they compute without it."""
    target = family_target("qwen3_5_text")
    layers = [layer.linear_attn for layer in target.model.layers if hasattr(layer, "linear_attn")]
    assert layers and all(dflash_compat.chunk_rule_reachable(layer) for layer in layers)
    prompt = torch.arange(1, 9)[None]
    with torch.no_grad():
        expected = target(prompt).logits
    here, elsewhere = [], []
    outputs = {}

    def other_thread() -> None:
        with torch.no_grad():
            outputs["other"] = target(prompt).logits

    with dflash_compat.recording_chunk_rule(layers, lambda rule, args, kwargs: here.append(kwargs["g"].shape)):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        with torch.no_grad():
            outputs["here"] = target(prompt).logits
    with dflash_compat.recording_chunk_rule(layers, lambda rule, args, kwargs: elsewhere.append(1)):
        pass
    assert len(here) == len(layers)  # this thread's forward only: one call per linear layer
    assert not elsewhere
    assert torch.equal(outputs["here"], expected) and torch.equal(outputs["other"], expected)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_linear_cache_speaks_what_this_transformers_calls(family):
    """Every cache method and attribute the installed transformers' Gated DeltaNet modeling file reaches for exists on
    DFlash's own cache for those layers (`LinearAttentionCacheMethods`); `get_seq_length` is asked only when no
    position ids are passed, and the fast path always passes them."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    called = set(re.findall(r"\b(?:cache|cache_params|past_key_values)\.(\w+)", inspect.getsource(module)))
    assert {"update_conv_state", "update_recurrent_state"} <= called  # the scan reads the cache calls
    target = family_target("qwen3_5_text" if family == "qwen3_5" else family)
    text = target.config.get_text_config()
    cache = paged_hybrid_cache(target, 1, num_slots=16)
    assert not [name for name in called - {"get_seq_length"} if not hasattr(cache, name)]
