"""docs/serving.md's examples, run as written against `hf-dflash serve`'s default target, the bundled
SmolLM2-135M-Instruct (served by the name `smollm2`): its curl command and its openai snippet answer what plain
greedy `generate` answers on the same chat-templated prompt.

The one substitution: the port (the docs say 8000; the test takes a free one). Two servers: the documented command
itself (`hf-dflash serve`, with the shipped drafter), and the same command's target with transformers' own manager
(tests/serve_launcher.py), which checks the serving layer alone. Each must listen on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_dflash.bundled_models import load_smollm2
from hf_dflash.serve_process import LocalServer, free_port
from tests.serve_helpers import ENGINE_TAKES_DRAFTER, WAITING_FOR_ENGINE, greedy_answer

DOCS = Path(__file__).resolve().parent.parent / "docs" / "serving.md"
DOCUMENTED_URL = "http://127.0.0.1:8000"
START_SECONDS = 420


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", DOCS.read_text(), flags=re.DOTALL | re.MULTILINE)


def documented(language: str, marker: str) -> str:
    (block,) = [block for block in code_blocks(language) if marker in block]
    return block


def listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses something listens on at `port` (from /proc/net/tcp; state 0A is LISTEN)."""
    addresses = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            addresses.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return addresses


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2(dtype=torch.float32)


@pytest.fixture(scope="module", params=["transformers-manager", "dflash-engine"])
def server(request, tmp_path_factory):
    port = free_port()
    command_line = documented("bash", "hf-dflash serve").splitlines()[-1].split("#")[0].split()
    assert command_line == ["hf-dflash", "serve"], "docs/serving.md's command changed: update this test"
    if request.param == "dflash-engine":
        if not ENGINE_TAKES_DRAFTER:
            pytest.skip(WAITING_FOR_ENGINE)
        command = [sys.executable, "-m", "hf_dflash.cli", "serve", "--port", str(port)]
    else:
        launcher = Path(__file__).with_name("serve_launcher.py")
        command = [sys.executable, str(launcher), "serve", "--port", str(port), "--no-drafter-for-tests"]
    log = tmp_path_factory.mktemp("smollm2") / "server.log"
    server = LocalServer.start(command, port, log)
    try:
        server.wait_ready(START_SECONDS)
    except (RuntimeError, TimeoutError):
        server.kill()
        raise
    yield server
    server.stop(timeout=60)


def test_the_documented_examples_answer_as_greedy_generate(server, smollm2):
    model, tokenizer = smollm2
    assert listening_addresses(server.port) == {"127.0.0.1"}
    curl = documented("bash", "curl ")
    snippet = documented("python", "OpenAI(")
    assert DOCUMENTED_URL in curl and DOCUMENTED_URL in snippet

    request = json.loads(curl[curl.index("-d '") + 4: curl.rindex("'")])
    prompt_ids = tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    expected = tokenizer.decode(greedy_answer(model, prompt_ids, request["max_tokens"], tokenizer.eos_token_id),
                                skip_special_tokens=True)

    shell = subprocess.run(["bash", "-c", curl.replace(DOCUMENTED_URL, server.url)], capture_output=True, text=True,
                           timeout=300, check=True)
    answer = json.loads(shell.stdout)
    assert answer["model"].startswith("smollm2")  # 5.17 adds the revision: smollm2@main
    assert answer["choices"][0]["message"]["content"] == expected

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippet.replace(DOCUMENTED_URL, server.url), str(DOCS), "exec"), {"__name__": "docs_snippet"})
    assert printed.getvalue() == expected + "\n"
