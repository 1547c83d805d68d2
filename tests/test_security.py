"""Loading runs no code from weight files, and importing the remote-code bundle touches neither the network nor
anything but the documented generate dispatch."""

from __future__ import annotations

import json
import pathlib
import pickle
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_dflash import DFlashDraftModel
from tests.conftest import tiny_drafter, tiny_target

REPO = pathlib.Path(__file__).resolve().parents[1]


def pickled_checkpoint(folder: pathlib.Path, state: object) -> pathlib.Path:
    """A drafter folder whose weights are only a pickled pytorch_model.bin holding `state`."""
    drafter = tiny_drafter(tiny_target("llama"))
    drafter.config.save_pretrained(folder)
    torch.save(state, folder / "pytorch_model.bin")
    return folder


class WritesAFileWhenUnpickled:
    """What a malicious checkpoint carries: unpickling it calls `Path.touch(marker)`."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def test_pickled_weights_are_refused_without_the_opt_in(tmp_path):
    folder = pickled_checkpoint(tmp_path, tiny_drafter(tiny_target("llama")).state_dict())
    with pytest.raises(ValueError, match=r"only pickled ones \(pytorch_model.bin\).*allow_pickle=True"):
        DFlashDraftModel.from_pretrained(folder)
    with pytest.raises(ValueError, match="use_safetensors=False.*allow_pickle=True"):  # no way around the opt-in
        DFlashDraftModel.from_pretrained(folder, use_safetensors=False)


def test_opted_in_pickles_load_with_weights_only(tmp_path, monkeypatch):
    state = tiny_drafter(tiny_target("llama"), seed=5).state_dict()
    folder = pickled_checkpoint(tmp_path, state)
    calls = []
    original = torch.load

    def recording_load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    drafter = DFlashDraftModel.from_pretrained(folder, allow_pickle=True)
    assert calls and all(flag is True for flag in calls), calls
    for key, value in state.items():
        assert torch.equal(drafter.state_dict()[key], value), key
    with pytest.raises(ValueError, match=r"weights_only=True\) only; drop weights_only=False"):
        DFlashDraftModel.from_pretrained(folder, allow_pickle=True, weights_only=False)


def test_a_malicious_pickle_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    folder = pickled_checkpoint(tmp_path / "drafter", {"fc.weight": WritesAFileWhenUnpickled(marker)})
    with pytest.raises(ValueError, match="allow_pickle"):
        DFlashDraftModel.from_pretrained(folder)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):  # torch refuses it, even opted in
        DFlashDraftModel.from_pretrained(folder, allow_pickle=True)
    assert not marker.exists()


IMPORT_SCRIPT = textwrap.dedent(
    """
    import json, os, socket, sys, warnings
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(repr(args)[:200])
        raise OSError("network access during import")

    socket.socket.connect = refuse
    socket.create_connection = refuse
    socket.getaddrinfo = refuse

    import torch
    import transformers
    from transformers import AutoConfig, AutoModel, GenerationMixin, PreTrainedModel
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    def state():
        return {
            "generation_mixin": {k: id(v) for k, v in vars(GenerationMixin).items() if k != "generate"},
            "pretrained_model": {k: id(v) for k, v in vars(PreTrainedModel).items()},
            "module": {k: id(v) for k, v in vars(torch.nn.Module).items()},
            "global_hooks": [len(torch.nn.modules.module._global_forward_hooks),
                             len(torch.nn.modules.module._global_forward_pre_hooks)],
            "torch": [str(torch.get_default_dtype()), torch.get_num_threads(), torch.is_grad_enabled()],
            "environ": dict(os.environ),
            "config_mapping": sorted(CONFIG_MAPPING.keys()),
            "model_mapping": len(MODEL_MAPPING._extra_content),
            "verbosity": transformers.logging.get_verbosity(),
            "warning_filters": len(warnings.filters),
        }

    original_generate = GenerationMixin.generate
    before = state()
    sys.path.insert(0, sys.argv[1])
    import dflash_bundle
    after = state()
    changed = sorted(k for k in before if before[k] != after[k])
    wrapped = getattr(GenerationMixin.generate, "__wrapped__", None) is original_generate
    print(json.dumps({"attempts": attempts, "changed": changed, "generate_wrapped": wrapped,
                      "dispatch": getattr(GenerationMixin.generate, "_dflash_dispatch", False)}))
    """
)


def test_importing_the_bundle_makes_no_network_call_and_changes_only_generate(tmp_path):
    shutil.copytree(REPO / "modeling", tmp_path / "dflash_bundle", ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["attempts"] == [], "the bundle reached for the network at import"
    assert report["changed"] == [], f"importing the bundle changed {report['changed']}"
    assert report["generate_wrapped"] and report["dispatch"], "the documented generate dispatch is missing"
