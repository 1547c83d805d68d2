"""Data-parallel generation: two gloo processes on this CPU give exactly the answers of one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_dflash.parallel import generate_data_parallel
from tests import data_parallel_worker
from tests.conftest import tiny_target

ROOT = Path(__file__).resolve().parent.parent


def test_two_processes_give_the_answers_of_one(tmp_path):
    out = tmp_path / "two.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run = subprocess.run(
        [*launch, str(ROOT / "tests" / "data_parallel_worker.py"), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    two = json.loads(out.read_text())
    assert two["num_processes"] == 2, "the processes did not form one group"

    data_parallel_worker.main(str(tmp_path / "one.json"))  # this process alone
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["num_processes"] == 1
    assert two["answers"] == one["answers"]

    # ... and those are the target's own greedy answers, in prompt order.
    target = tiny_target("llama", seed=21)
    for prompt, answer in zip(data_parallel_worker.PROMPTS, one["answers"]):
        plain = target.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        expected = plain[0, len(prompt) :].tolist()
        eos = target.generation_config.eos_token_id
        assert answer == (expected[: expected.index(eos) + 1] if eos in expected else expected)


def test_text_prompts_need_the_tokenizer():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="pass tokenizer="):
        generate_data_parallel(target, None, ["Once upon a time"], max_new_tokens=4)
