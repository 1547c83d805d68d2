"""Hub push and pull without a network: the exact folder push_to_hub uploads, and pulls through a Hugging Face cache
laid out as hub downloads leave it (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi
from safetensors.torch import load_file, save_file

from hf_dflash import DFlashDraftModel
from tests.conftest import tiny_drafter, tiny_target

REPO = "my-org/tiny-dflash"


@pytest.fixture
def uploads(monkeypatch):
    """Stands in for the Hub: records the files of every commit push_to_hub makes (read while they still exist)."""
    commits: list[dict] = []

    def create_repo(self, repo_id, **kwargs):
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def create_commit(self, repo_id, operations, **kwargs):
        files = {op.path_in_repo: Path(op.path_or_fileobj).read_bytes() for op in operations}
        commits.append({"repo_id": repo_id, "files": files, **kwargs})
        return "commit-url"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    return commits


def test_push_uploads_weights_config_bundle_card_and_generation_config(tmp_path, uploads):
    drafter = tiny_drafter(tiny_target("qwen3"))
    drafter.save_pretrained(tmp_path / "trained")
    record = {"steps": 3000, "lr": 0.002, "batch_size": 4, "final_tau": 2.17, "command": "hf-dflash train ..."}
    (tmp_path / "trained" / "training_args.json").write_text(json.dumps(record))
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "trained")

    assert loaded.push_to_hub(REPO, target_model="my-org/tiny-target", tau=3.25, private=True) == "commit-url"

    (commit,) = uploads
    files = commit["files"]
    assert commit["repo_id"] == REPO and commit["commit_message"] == "Upload DFlash drafter"
    bundle = {p.name for p in Path("modeling").glob("*.py") if p.name != "__init__.py"}
    assert bundle <= set(files), bundle - set(files)
    expected = {"model.safetensors", "config.json", "README.md", "generation_config.json", "training_args.json"}
    assert expected <= set(files)
    config = json.loads(files["config.json"])
    assert config["auto_map"]["AutoModel"] == "modeling_dflash.DFlashDraftModel"
    (tmp_path / "w.safetensors").write_bytes(files["model.safetensors"])
    weights = load_file(str(tmp_path / "w.safetensors"))
    assert weights.keys() == drafter.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in drafter.state_dict().items())
    assert json.loads(files["generation_config.json"])["num_assistant_tokens"] == drafter.config.block_size - 1
    card = files["README.md"].decode()
    assert "base_model: my-org/tiny-target" in card
    assert f"{drafter.config.target_layer_ids} of {drafter.config.num_target_layers}" in card
    assert f"| block size (anchor + mask rows) | {drafter.config.block_size} |" in card
    assert "| measured tau (tokens per verify step) | 3.25 |" in card
    assert f'AutoModel.from_pretrained("{REPO}", trust_remote_code=True' in card
    assert "- optimizer steps: 3000" in card and "simulated on the last training batches: 2.17" in card
    # What is pushed is what save_pretrained writes, file for file.
    drafter.save_pretrained(tmp_path / "saved")
    assert set(files) - {"training_args.json"} == {p.name for p in (tmp_path / "saved").iterdir()}


def _populate_cache(cache: Path, repo_id: str, files: dict[str, bytes], sha: str = "0123456789abcdef" * 2 + "01234567"):
    """Lay `files` out as a hub download leaves them: models--org--name/snapshots/<sha>/..., refs/main = sha."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)
    for name, data in files.items():
        path = root / "snapshots" / sha / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


PULL_WITH_LIBRARY = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import load_file
    from hf_dflash import DFlashConfig, DFlashDraftModel
    drafter = DFlashDraftModel.from_pretrained(sys.argv[1])
    expected = load_file(sys.argv[2])
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in expected.items())
    config = DFlashConfig.from_pretrained("z-lab/Qwen3-8B-DFlash-b16")  # not cached: the published config
    assert (config.hidden_size, config.block_size, config.target_model) == (4096, 16, "Qwen/Qwen3-8B")
    try:
        DFlashDraftModel.from_pretrained("z-lab/Qwen3-8B-DFlash-b16")
        raise SystemExit("loaded weights that are not there")
    except OSError as error:
        assert "not on this machine" in str(error) and "DFlashConfig.from_pretrained" in str(error), error
    print("pulled ok")
    """
)

PULL_WITHOUT_LIBRARY = textwrap.dedent(
    """
    import sys
    sys.modules["hf_dflash"] = None
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(sys.argv[2]).eval()
    drafter = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
    prompt = torch.tensor([[5, 17, 99, 3, 42, 7]])
    plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
    out = target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=drafter,
                          return_dict_in_generate=True)
    assert torch.equal(plain, out.sequences) and out.acceptance_lengths[0]
    print("remote code from the cache ok")
    """
)


def test_card_shows_the_target_the_trainer_recorded(tmp_path):
    """A drafter saved without target_model still names the target its training record gives, without claiming it
    as Hub metadata (the record holds the name as given to the trainer, which need not be a Hub id)."""
    drafter = tiny_drafter(tiny_target("qwen3"))
    drafter.config.target_model = None
    drafter.save_pretrained(tmp_path / "trained")
    (tmp_path / "trained" / "training_args.json").write_text(json.dumps({"target": "smollm2", "steps": 5}))
    DFlashDraftModel.from_pretrained(tmp_path / "trained").save_pretrained(tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| target model | `smollm2` (as given to the trainer) |" in card and "base_model" not in card


def test_card_says_which_vocabulary_the_drafter_drafts_over(tmp_path):
    drafter = tiny_drafter(tiny_target("qwen3"))
    drafter.save_pretrained(tmp_path / "full")
    assert "| draft vocabulary | the target's whole vocabulary |" in (tmp_path / "full" / "README.md").read_text()
    drafter.set_draft_vocabulary(range(0, 100, 4))
    drafter.save_pretrained(tmp_path / "reduced")
    card = (tmp_path / "reduced" / "README.md").read_text()
    assert "| draft vocabulary | 25 tokens (`draft_vocab.safetensors`) |" in card


def test_pull_from_a_populated_cache_offline(tmp_path, uploads):
    target = tiny_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    drafter = tiny_drafter(target)
    drafter.push_to_hub(REPO)
    _populate_cache(tmp_path / "hub", REPO, uploads[0]["files"])
    save_file(drafter.state_dict(), str(tmp_path / "expected.safetensors"))
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "home"),
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    for script, args, expected in [
        (PULL_WITH_LIBRARY, [REPO, str(tmp_path / "expected.safetensors")], "pulled ok"),
        (PULL_WITHOUT_LIBRARY, [REPO, str(tmp_path / "target")], "remote code from the cache ok"),
    ]:
        result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                                env=env, cwd=Path(__file__).parent.parent)
        assert result.returncode == 0, result.stderr[-3000:]
        assert expected in result.stdout
