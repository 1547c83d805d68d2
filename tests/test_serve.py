"""transformers serve with hf-dflash's drafter attached, talked to the way users do: the `openai` package, over
127.0.0.1, against a server started as `hf-dflash serve` starts it (tests/serve_launcher.py).

One server per module and variant: with transformers' own continuous-batching manager (no drafter: the serving
layer alone, and the baseline a load test compares against), and with the DFlash engine once hf-dflash has it. The
served model is stories260K with a chat template and a random drafter (tests/serve_helpers.py), in float32, so at
temperature 0 every answer must equal plain greedy `generate` on the same chat-templated prompt, token for token
(compared as text, with the token count from `usage`). The SIGTERM test stops the server: it comes last.

Every wait has a time limit and every request a cap on its tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_dflash import serve_load
from hf_dflash.serve_process import LocalServer, free_port
from hf_dflash.serve_requests import RequestLimits
from hf_dflash.serve_transformers import SAMPLES_PER_REQUEST, STATE_ROUTE
from tests.serve_helpers import (
    DRAFTER_CONTEXT,
    SERVER_CB_OPTIONS,
    ENGINE_TAKES_DRAFTER,
    POISON,
    STEP_DELAY,
    WAITING_FOR_ENGINE,
    greedy_answer,
    launcher_command,
    save_served_model,
)

START_SECONDS = 420  # two imports of torch and transformers (the model loads in a process of its own) on 2 cores
REQUEST_SECONDS = 180
GRACE_SECONDS = 12  # long enough for a short answer in flight to finish at 5.17, whose CPU steps are slow
PROMPTS = ["Once upon a time", "Tom had a red ball.", "The cat sat on the mat and"]


@dataclass
class Reference:
    """The served model, loaded here: what plain greedy generate answers."""

    model: torch.nn.Module
    tokenizer: object

    def chat_ids(self, prompt: str) -> list[int]:
        messages = [{"role": "user", "content": prompt}]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        return greedy_answer(self.model, prompt_ids, max_new_tokens, self.tokenizer.eos_token_id)

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class Server:
    process: LocalServer
    name: str  # the model name clients send
    limits: RequestLimits
    drafter: bool

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.process.url}/v1", api_key="none", max_retries=0,
                             timeout=REQUEST_SECONDS)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.process.url}/v1", api_key="none", max_retries=0,
                                  timeout=REQUEST_SECONDS)

    def state(self) -> dict:
        with urllib.request.urlopen(self.process.url + STATE_ROUTE, timeout=30) as response:
            return json.loads(response.read())

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict]:
        """A raw POST: (status, JSON body)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.process.url + path, data=data,
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def served_model(tmp_path_factory) -> tuple[Path, Path]:
    return save_served_model(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def reference(served_model) -> Reference:
    folder = served_model[0]
    return Reference(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
                     AutoTokenizer.from_pretrained(folder))


@pytest.fixture(scope="module", params=["transformers-manager", "dflash-engine"])
def server(request, served_model, tmp_path_factory, reference):
    with_drafter = request.param == "dflash-engine"
    if with_drafter and not ENGINE_TAKES_DRAFTER:
        pytest.skip(WAITING_FOR_ENGINE)
    target, drafter = served_model
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    process = LocalServer.start(launcher_command(target, drafter, port, with_drafter, GRACE_SECONDS), port, log)
    try:
        process.wait_ready(START_SECONDS)
    except (RuntimeError, TimeoutError):
        process.kill()
        raise
    limits = RequestLimits(DRAFTER_CONTEXT, "the drafter's context") if with_drafter else RequestLimits(
        2048, "the target's context")
    handle = Server(process, str(target), limits, with_drafter)
    # A greedy first request: transformers 5.17 builds its manager from the first request's settings.
    handle.client().chat.completions.create(model=handle.name, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=2, temperature=0)
    yield handle
    if process.process.poll() is None:
        process.stop(timeout=60)


def run(server: Server, scenario, seconds: float = REQUEST_SECONDS):
    """asyncio.run(scenario(client)) with an AsyncOpenAI client closed on its own loop, within `seconds`."""

    async def with_client():
        async with server.async_client() as client:
            return await asyncio.wait_for(scenario(client), seconds)

    return asyncio.run(with_client())


# --------------------------------------------------------------------------------------------------
# Answers
# --------------------------------------------------------------------------------------------------


async def chat(client: openai.AsyncOpenAI, server: Server, prompt: str, stream: bool, **options) -> tuple:
    """(text, finish reason, usage) of a chat completion, streamed or not."""
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        response = await client.chat.completions.create(model=server.name, messages=messages, **options)
        return response.choices[0].message.content, response.choices[0].finish_reason, response.usage
    chunks = await client.chat.completions.create(model=server.name, messages=messages, stream=True,
                                                  stream_options={"include_usage": True}, **options)
    text, finish, usage = "", None, None
    async for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def test_chat_completions_at_temperature_0_equal_greedy_generate(server, reference):
    """Streamed and not, all at once (one batch): each answer is plain greedy generate's, with its usage."""
    max_tokens = 20
    jobs = [(prompt, stream) for prompt in PROMPTS for stream in (False, True)]

    async def all_at_once(client):
        return await asyncio.gather(*(chat(client, server, prompt, stream, max_tokens=max_tokens, temperature=0)
                                      for prompt, stream in jobs))

    for (prompt, stream), (text, finish, usage) in zip(jobs, run(server, all_at_once)):
        prompt_ids = reference.chat_ids(prompt)
        expected = reference.greedy(prompt_ids, max_tokens)
        assert text == reference.text(expected), (prompt, stream)
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), len(expected)), (prompt, stream)
        assert usage.total_tokens == len(prompt_ids) + len(expected)
        assert finish == ("length" if len(expected) == max_tokens else "stop")


def test_completions_and_responses_at_temperature_0_equal_greedy_generate(server, reference):
    client = server.client()
    prompt, max_tokens = PROMPTS[0], 16
    prompt_ids = reference.tokenizer(prompt)["input_ids"]
    expected = reference.greedy(prompt_ids, max_tokens)
    completion = client.completions.create(model=server.name, prompt=prompt, max_tokens=max_tokens, temperature=0)
    assert completion.choices[0].text == reference.text(expected)
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (len(prompt_ids), len(expected))

    chat_ids = reference.chat_ids(prompt)
    expected = reference.greedy(chat_ids, max_tokens)
    # stream=False said outright: transformers serve before 5.25 streams a response unless told not to
    response = client.responses.create(model=server.name, input=prompt, max_output_tokens=max_tokens, temperature=0,
                                       stream=False)
    assert response.output_text == reference.text(expected)
    assert (response.usage.input_tokens, response.usage.output_tokens) == (len(chat_ids), len(expected))


# --------------------------------------------------------------------------------------------------
# Sampling follows each request's options
# --------------------------------------------------------------------------------------------------

needs_per_request_sampling = pytest.mark.skipif(
    not SAMPLES_PER_REQUEST,
    reason="transformers serve before 5.25 samples every continuous-batching request with its first request's "
           "settings, drafter or not",
)


@needs_per_request_sampling
def test_a_sampled_request_with_a_tiny_top_p_is_greedy(server, reference):
    """top_p 1e-6 keeps only the most likely token: a sampled request that honours its own top_p is greedy."""
    prompt, max_tokens = PROMPTS[1], 20
    text, _, _ = run(server, lambda client: chat(client, server, prompt, False, max_tokens=max_tokens,
                                                 temperature=1.0, top_p=1e-6))
    assert text == reference.text(reference.greedy(reference.chat_ids(prompt), max_tokens))


def chi_square_upper(degrees: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (z = 3.09; 3.72 for 1 - 0.0001), by Wilson and Hilferty's approximation."""
    return degrees * (1 - 2 / (9 * degrees) + z * math.sqrt(2 / (9 * degrees))) ** 3


def chi_square(counts: Counter, probabilities: dict[str, float], total: int) -> tuple[float, int]:
    """Pearson's statistic over the answers, those expected fewer than 5 times pooled into one bin."""
    big = {text for text, p in probabilities.items() if p * total >= 5}
    observed = [counts[text] for text in big] + [total - sum(counts[text] for text in big)]
    expected = [probabilities[text] * total for text in big] + [total * (1 - sum(probabilities[t] for t in big))]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    return statistic, len(observed) - 1


@needs_per_request_sampling
def test_sampled_first_tokens_follow_each_requests_temperature(server, reference):
    """120 one-token answers at temperature 0.5 and 120 at 1.5, sent together: each set fits its own
    temperature's distribution (softmax(logits / T) within the model's top-k 50) and not the other's. (The served
    model's own temperature is not 1: transformers' manager applies a request's temperature only where the model's
    config has a temperature processor, and 1 makes none.)"""
    prompt, samples = PROMPTS[0], 120
    prompt_ids = reference.chat_ids(prompt)
    with torch.no_grad():
        logits = reference.model(torch.tensor([prompt_ids])).logits[0, -1]

    def distribution(temperature: float) -> dict[str, float]:
        top = torch.topk(logits / temperature, 50)
        probabilities = torch.softmax(top.values, dim=-1)
        by_text: dict[str, float] = {}
        for token, p in zip(top.indices.tolist(), probabilities.tolist()):
            text = reference.text([token])
            by_text[text] = by_text.get(text, 0.0) + p
        return by_text

    async def sample_all(client):
        return await asyncio.gather(*(
            chat(client, server, prompt, False, max_tokens=1, temperature=temperature, top_p=1.0)
            for temperature in (0.5, 1.5) for _ in range(samples)
        ))

    answers = [text for text, _, _ in run(server, sample_all)]
    cold, hot = Counter(answers[:samples]), Counter(answers[samples:])
    for counts, own, other in ((cold, 0.5, 1.5), (hot, 1.5, 0.5)):
        # At p = 0.001 a right temperature fails by chance one run in a thousand, per fit; that happened once in CI
        # (transformers' own manager, 21.05 against 20.75). The fit to its own temperature is judged at p = 0.0001,
        # the misfit to the other at p = 0.001 (a wrong temperature lands far beyond either).
        statistic, degrees = chi_square(counts, distribution(own), samples)
        assert statistic < chi_square_upper(degrees, z=3.72), (own, counts)
        statistic, degrees = chi_square(counts, distribution(other), samples)
        assert statistic > chi_square_upper(degrees), (own, "fits the other temperature too", counts)


# --------------------------------------------------------------------------------------------------
# Bad input: a 4xx JSON error naming the problem, and the server keeps serving
# --------------------------------------------------------------------------------------------------


def test_bad_requests_get_a_4xx_naming_the_problem_and_the_server_keeps_serving(server, reference):
    chat_path, messages = "/v1/chat/completions", [{"role": "user", "content": PROMPTS[0]}]
    long_prompt = [{"role": "user", "content": "a b " * 1500}]  # ~3000 tokens: over every limit here
    cases = [
        (b'{"model": "m", "messages": [', "not valid JSON"),
        ({"model": server.name, "messages": "hello"}, "`messages` must be a list"),
        ({"model": server.name, "messages": []}, "`messages` is empty"),
        ({"model": server.name, "messages": messages, "temperature": "hot"}, "`temperature` must be a number"),
        ({"model": server.name, "messages": messages, "max_tokens": 0}, "`max_tokens` must be at least 1"),
        ({"model": server.name, "messages": messages, "max_tokens": server.limits.max_request_tokens},
         f"at most {server.limits.max_request_tokens} tokens, prompt and answer ({server.limits.limited_by})"),
        ({"model": server.name, "messages": long_prompt, "max_tokens": 5}, "tokens"),
        ({"model": server.name, "messages": long_prompt, "max_tokens": 5, "stream": True}, "tokens"),
    ]
    for body, expected in cases:
        status, answer = server.post(chat_path, body)
        assert 400 <= status < 500 and expected in answer["detail"], (body if isinstance(body, bytes) else
                                                                       {**body, "messages": "..."}, status, answer)
    if server.drafter:  # within the target's context, beyond the drafter's: refused by the manager
        over_drafter = [{"role": "user", "content": "a b " * 600}]
        status, answer = server.post(chat_path, {"model": server.name, "messages": over_drafter, "max_tokens": 5})
        assert status == 400 and "the drafter's context" in answer["detail"], answer
    text, _, _ = run(server, lambda client: chat(client, server, PROMPTS[0], False, max_tokens=8, temperature=0))
    assert text == reference.text(reference.greedy(reference.chat_ids(PROMPTS[0]), 8))


# --------------------------------------------------------------------------------------------------
# The load generator, at a tiny scale
# --------------------------------------------------------------------------------------------------


def load_arguments(server: Server, out: Path, *options: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_load.add_arguments(parser)
    parser.add_argument("--out")
    return parser.parse_args(["--target", server.name, "--ours-url", server.process.url, "--ours-model", server.name,
                              "--out", str(out), *options])


def test_the_load_generator_checks_every_answer_against_transformers_serve(server, tmp_path):
    """This module's server as ours, and transformers serve (`transformers serve --continuous-batching`, started by
    the load generator) as the baseline: every streamed answer complete and the same text from both."""
    out = tmp_path / "load.json"
    args = load_arguments(server, out, "--requests", "6", "--concurrency", "3", "--max-tokens", "12",
                          "--seconds", "300", "--startup-seconds", str(START_SECONDS),
                          "--server-options", " ".join(SERVER_CB_OPTIONS))
    assert serve_load.run(args) == 0
    report = json.loads(out.read_text())
    assert report["answers_identical"]
    baseline, ours = report["servers"]
    assert baseline["name"] == "transformers serve" and ours["url"] == server.process.url
    for figures in (baseline, ours):
        assert figures["complete"] == figures["requests"] == 6 and not figures["errors"]
        assert 0 < figures["time_to_first_token_p50"] <= figures["time_to_first_token_p99"]
        assert 0 < figures["time_per_output_token_p50"] <= figures["time_per_output_token_p99"]
        assert figures["tokens_per_second"] > 0 and figures["requests_per_second"] > 0
    # The plot, where matplotlib is installed (the bench extra); the JSON has every figure either way.
    assert out.with_suffix(".png").is_file() == (importlib.util.find_spec("matplotlib") is not None)


def test_the_load_generator_stops_at_its_time_limit(server, tmp_path):
    """Requests still running at --seconds are cancelled and counted as failed, and the run fails."""
    out = tmp_path / "load.json"
    args = load_arguments(server, out, "--baseline-url", server.process.url, "--baseline-model", server.name,
                          "--requests", "2", "--concurrency", "2", "--max-tokens", "900", "--seconds", "1")
    started = time.monotonic()
    assert serve_load.run(args) == 1
    assert time.monotonic() - started < 60
    for figures in json.loads(out.read_text())["servers"]:
        assert figures["complete"] == 0 and "not answered within --seconds 1" in figures["errors"][0]
    wait_for_state(server, lambda s: s["requests_running"] == s["requests_waiting"] == 0, seconds=30)


# --------------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------------


def wait_for_state(server: Server, condition, seconds: float) -> tuple[dict, float]:
    """Polls the served manager's state until `condition(state)`; (state, seconds it took). Fails after `seconds`."""
    start = time.monotonic()
    while True:
        state = server.state()
        if condition(state):
            return state, time.monotonic() - start
        assert time.monotonic() - start < seconds, f"still {state} after {seconds} s"
        time.sleep(0.2)


def test_a_client_that_disconnects_mid_stream_frees_its_request_and_leaves_the_others_exact(server, reference):
    prompt = PROMPTS[0]
    long_tokens = server.limits.max_request_tokens - len(reference.chat_ids(prompt)) - 8
    # Each step of the served target takes at least STEP_DELAY, so the long answer alone runs for this long:
    long_seconds = long_tokens * STEP_DELAY
    other_prompt, other_tokens = PROMPTS[2], 30

    async def scenario(client):
        stream = await client.chat.completions.create(
            model=server.name, messages=[{"role": "user", "content": prompt}], max_tokens=long_tokens,
            temperature=0, stream=True)
        other = asyncio.create_task(chat(client, server, other_prompt, False, max_tokens=other_tokens,
                                         temperature=0))
        chunks = 0
        async for _ in stream:
            chunks += 1
            if chunks == 5:
                break
        await stream.close()  # the client leaves
        left_at = time.monotonic()
        text, _, _ = await other
        return text, left_at

    text, left_at = run(server, scenario)
    assert text == reference.text(reference.greedy(reference.chat_ids(other_prompt), other_tokens))
    state, _ = wait_for_state(server, lambda s: s["requests_running"] == s["requests_waiting"] == 0,
                              seconds=long_seconds / 2)
    assert time.monotonic() - left_at < long_seconds / 2  # freed long before the answer would have ended
    if server.drafter:
        assert state["drafter_pages_used"] == state["target_pages_used"] == 0


def test_an_exception_inside_one_requests_step_fails_that_request_and_the_others_continue(server, reference):
    if not server.drafter:
        pytest.skip("transformers' own manager stops for good at any error in a step (every request fails and the "
                    "server exits): failing one request alone is the DFlash engine's")
    poisoned = f"{PROMPTS[0]} {reference.text([POISON])}"
    assert POISON in reference.chat_ids(poisoned)

    async def together(client):
        return await asyncio.gather(
            chat(client, server, poisoned, False, max_tokens=8, temperature=0),
            chat(client, server, PROMPTS[1], False, max_tokens=12, temperature=0),
            return_exceptions=True,
        )

    failed, healthy = run(server, together)
    assert isinstance(failed, openai.InternalServerError) and "injected fault" in str(failed), failed
    assert healthy[0] == reference.text(reference.greedy(reference.chat_ids(PROMPTS[1]), 12))
    text, _, _ = run(server, lambda client: chat(client, server, PROMPTS[2], False, max_tokens=6, temperature=0))
    assert text == reference.text(reference.greedy(reference.chat_ids(PROMPTS[2]), 6))


def test_after_the_faults_nothing_is_held(server):
    state, _ = wait_for_state(server, lambda s: s["requests_running"] == s["requests_waiting"] == 0, seconds=30)
    if server.drafter:
        assert state["drafter_pages_used"] == 0 and state["target_pages_used"] == 0
        assert state["drafter_pages_total"] > 0 and state["target_pages_total"] > 0


# --------------------------------------------------------------------------------------------------
# SIGTERM (stops the server: last)
# --------------------------------------------------------------------------------------------------


def child_pids(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                children.append(int(entry.name))
    return children


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the server's child processes from /proc")
def test_sigterm_stops_accepting_ends_the_work_in_flight_and_exits_0(server, reference):
    pid = server.process.process.pid
    children = child_pids(pid)
    results: dict[str, object] = {}
    short_prompt, short_tokens = PROMPTS[1], 4
    long_tokens = server.limits.max_request_tokens - 64

    def long_stream():
        try:
            chunks = server.client().chat.completions.create(
                model=server.name, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=long_tokens,
                temperature=0, stream=True)
            results["long"] = sum(1 for _ in chunks)
        except (openai.APIError, OSError) as error:  # cut when the grace runs out
            results["long"] = error

    def short_request():
        try:
            results["short"] = server.client().chat.completions.create(
                model=server.name, messages=[{"role": "user", "content": short_prompt}], max_tokens=short_tokens,
                temperature=0).choices[0].message.content
        except (openai.APIError, OSError) as error:
            results["short"] = error

    threads = [threading.Thread(target=long_stream), threading.Thread(target=short_request)]
    threads[0].start()
    wait_for_state(server, lambda s: s["requests_running"] == 1, seconds=60)  # the long answer is under way
    threads[1].start()
    time.sleep(0.2)  # the short request sent (it may end before SIGTERM or after)
    signalled = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    refused = False
    while time.monotonic() - signalled < GRACE_SECONDS:
        try:
            socket.create_connection(("127.0.0.1", server.process.port), timeout=1).close()
        except OSError:
            refused = True
            break
        time.sleep(0.1)
    assert refused, "still accepting connections after SIGTERM"
    status = server.process.process.wait(timeout=GRACE_SECONDS + 60)
    stopped_after = time.monotonic() - signalled
    for thread in threads:
        thread.join(timeout=30)
    assert status == 0, server.process.log_tail()
    assert stopped_after < GRACE_SECONDS + 60
    assert not any(thread.is_alive() for thread in threads)
    # Every request in flight ended: complete (and exact), or cut when the grace ran out, never left hanging.
    short = results["short"]
    assert isinstance(short, Exception) or short == reference.text(
        reference.greedy(reference.chat_ids(short_prompt), short_tokens))
    assert isinstance(results["long"], (int, Exception))
    assert not [child for child in children if alive(child)], "the server left a process behind"
