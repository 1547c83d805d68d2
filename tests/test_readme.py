"""The README's first Python snippet runs as written, on stories260K.

The one substitution: the snippet's Hub ids (TARGET_ID and DRAFTER_ID below) are replaced, as text, by local directories before it
runs: the target id by stories260K (the copy shipped in the package, saved as a transformers checkpoint) and the
drafter id by a seeded random DFlash drafter for it. Every other character of the snippet is what runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import hf_dflash
from hf_dflash.bundled_models import load_stories260k

README = Path(__file__).resolve().parent.parent / "README.md"
TARGET_ID = "Qwen/Qwen3-4B"
DRAFTER_ID = "z-lab/Qwen3-4B-DFlash-b16"


def first_python_block(markdown: str) -> str:
    match = re.search(r"^```python\n(.*?)^```", markdown, flags=re.DOTALL | re.MULTILINE)
    assert match, "README.md has no ```python block"
    return match.group(1)


@pytest.fixture(scope="module")
def local_ids(tmp_path_factory) -> dict[str, str]:
    """The snippet's Hub ids -> local stand-ins: stories260K and a random drafter for it, saved as users save theirs."""
    root = tmp_path_factory.mktemp("readme")
    target, tokenizer = load_stories260k()
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    torch.manual_seed(0)
    # mask token <unk> (id 0): a row stories260K never produces as text.
    config = hf_dflash.DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=8, mask_token_id=0)
    hf_dflash.DFlashDraftModel(config).save_pretrained(root / "drafter")
    return {TARGET_ID: str(root / "target"), DRAFTER_ID: str(root / "drafter")}


def test_first_snippet_runs_as_written_and_is_lossless(local_ids, monkeypatch, capsys, one_thread):
    snippet = first_python_block(README.read_text())
    for hub_id, local in local_ids.items():
        assert f'"{hub_id}"' in snippet, f"the README snippet no longer loads {hub_id}: update TARGET_ID / DRAFTER_ID here"
        snippet = snippet.replace(f'"{hub_id}"', repr(local))

    drafter_forwards = 0
    forward = hf_dflash.DFlashDraftModel.forward

    def counted_forward(self, *args, **kwargs):
        nonlocal drafter_forwards
        drafter_forwards += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(hf_dflash.DFlashDraftModel, "forward", counted_forward)
    namespace: dict = {"__name__": "readme_snippet"}
    exec(compile(snippet, str(README), "exec"), namespace)
    monkeypatch.undo()

    target, inputs, out, tokenizer = (namespace[name] for name in ("target", "inputs", "out", "tokenizer"))
    assert drafter_forwards > 0, "generate never ran the drafter: the snippet did not take the DFlash path"
    assert target.dtype == torch.float32  # dtype="auto" reads the saved float32 checkpoint
    max_new_tokens = int(re.search(r"max_new_tokens=(\d+)", snippet).group(1))
    plain = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    assert torch.equal(out, plain), (tokenizer.decode(out[0]), tokenizer.decode(plain[0]))
    assert capsys.readouterr().out.strip() == tokenizer.decode(out[0], skip_special_tokens=True).strip()
