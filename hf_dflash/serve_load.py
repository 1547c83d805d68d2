"""A bounded load test of `hf-dflash serve` against `transformers serve --continuous-batching` without a drafter, on the
same prompts, in one run.

Each server in turn (transformers serve first, then ours) is started on a free port of 127.0.0.1 (or reached at a
URL of 127.0.0.1 given with --baseline-url / --ours-url), sent the same `--requests` chat requests by up to
`--concurrency` streaming clients at once (the `openai` package, asynchronously), and stopped. Every answer must
be complete (a finish reason, its usage counted), and since both servers decode greedily, the two servers' answers
to each prompt must be the same text. Recorded per server: time to first token and time per output token after it
(p50 / p99 over requests), the gaps between streamed chunks (p50 / p99), requests/s and tokens/s; written as JSON,
with a plot beside it.

Bounded: at most --requests requests (a hard cap of MAX_REQUESTS), each at most --max-tokens tokens, the whole
run within --seconds (requests still running then are cancelled and the run fails), each server's start within
--startup-seconds; servers only on 127.0.0.1.

    python -m hf_dflash.serve_load --requests 64 --concurrency 64 --max-tokens 128 --out serve_load.json

(`add_arguments` and `run` are the `serve` scenario of the bench harness.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .serve_process import HOST, LocalServer, free_port

MAX_REQUESTS = 4096
# Chat prompts of the kinds people send, code and prose (cycled when --requests is larger).
PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain in three sentences why the sky is blue.",
    "Write a haiku about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for a good night's sleep.",
    "Write a function that reverses a linked list.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I read a file line by line in Python?",
    "Explain what a hash table is to a beginner.",
    "Write a SQL query that counts the orders of each customer.",
    "Why do leaves change colour in autumn?",
    "Write a bash command that finds the largest files in a folder.",
    "What are the main causes of inflation?",
    "Write a short story about a robot who learns to paint.",
    "Explain recursion with an example.",
    "List five uses of a paperclip.",
]


@dataclass
class Answer:
    """One request's answer, as its client saw it."""

    prompt_index: int
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    sent: float = 0.0
    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    ended: float | None = None
    error: str | None = None

    @property
    def complete(self) -> bool:
        return self.error is None and self.finish_reason in ("stop", "length") and self.completion_tokens > 0


@dataclass
class ServerFigures:
    """One server's figures under the load (seconds; rates per second)."""

    name: str
    url: str
    requests: int
    complete: int
    seconds: float
    requests_per_second: float
    tokens_per_second: float
    time_to_first_token_p50: float
    time_to_first_token_p99: float
    time_per_output_token_p50: float
    time_per_output_token_p99: float
    chunk_gap_p50: float
    chunk_gap_p99: float
    errors: list[str]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def figures(name: str, url: str, answers: list[Answer], seconds: float) -> ServerFigures:
    done = [answer for answer in answers if answer.complete]
    first = [answer.first_token - answer.sent for answer in done if answer.first_token is not None]
    per_token = [(answer.ended - answer.first_token) / (answer.completion_tokens - 1)
                 for answer in done if answer.completion_tokens > 1 and answer.first_token is not None]
    gaps = [later - earlier for answer in done for earlier, later in zip(answer.chunk_times, answer.chunk_times[1:])]
    tokens = sum(answer.completion_tokens for answer in done)
    return ServerFigures(
        name=name, url=url, requests=len(answers), complete=len(done), seconds=seconds,
        requests_per_second=len(done) / seconds, tokens_per_second=tokens / seconds,
        time_to_first_token_p50=percentile(first, 50), time_to_first_token_p99=percentile(first, 99),
        time_per_output_token_p50=percentile(per_token, 50), time_per_output_token_p99=percentile(per_token, 99),
        chunk_gap_p50=percentile(gaps, 50), chunk_gap_p99=percentile(gaps, 99),
        errors=sorted({answer.error for answer in answers if answer.error})[:10],
    )


# --------------------------------------------------------------------------------------------------
# The load
# --------------------------------------------------------------------------------------------------


async def one_request(client: Any, model: str, prompt: str, answer: Answer, max_tokens: int) -> None:
    import openai

    answer.sent = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                answer.completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    answer.first_token = answer.first_token or now
                    answer.chunk_times.append(now)
                    answer.text += choice.delta.content
                answer.finish_reason = choice.finish_reason or answer.finish_reason
        answer.ended = time.perf_counter()
    except openai.APIError as error:
        answer.error = f"{type(error).__name__}: {error}"


async def load(url: str, model: str, prompts: list[str], args: argparse.Namespace) -> tuple[list[Answer], float]:
    """Sends every prompt (at most --concurrency at once); (answers, seconds). Requests still running after
    --seconds are cancelled and recorded as failed."""
    import openai

    answers = [Answer(index % len(prompts)) for index in range(args.requests)]
    gate = asyncio.Semaphore(args.concurrency)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                  timeout=args.seconds) as client:

        async def gated(answer: Answer, prompt: str) -> None:
            async with gate:
                await one_request(client, model, prompt, answer, args.max_tokens)

        tasks = [asyncio.create_task(gated(answer, prompts[index % len(prompts)]))
                 for index, answer in enumerate(answers)]
        start = time.perf_counter()
        _, running = await asyncio.wait(tasks, timeout=args.seconds)
        for task in running:
            task.cancel()
        seconds = time.perf_counter() - start
    for answer in answers:
        if answer.ended is None and answer.error is None:
            answer.error = f"not answered within --seconds {args.seconds:g}"
    return answers, seconds


# --------------------------------------------------------------------------------------------------
# The servers
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerPlan:
    """How to reach one server: a command to start (or None, for a URL given), and the model name to send."""

    name: str
    model: str
    url: str | None = None
    command: tuple[str, ...] | None = None


def server_plans(args: argparse.Namespace) -> list[ServerPlan]:
    from .generate_cli import DEFAULT_DRAFTER
    from .serve import BUNDLED_TARGET, bundled_target_folder

    extra = shlex.split(args.server_options)
    baseline_model = str(bundled_target_folder()) if args.target == BUNDLED_TARGET else args.target
    plans = []
    if args.baseline_url:
        plans.append(ServerPlan("transformers serve", args.baseline_model or baseline_model, url=args.baseline_url))
    else:
        plans.append(ServerPlan("transformers serve", baseline_model, command=(
            sys.executable, "-m", "transformers.cli.transformers", "serve", baseline_model, "--continuous-batching",
            "--host", HOST, "--log-level", "warning", *extra)))
    if args.ours_url:
        plans.append(ServerPlan("hf-dflash serve", args.ours_model or args.target, url=args.ours_url))
    else:
        plans.append(ServerPlan("hf-dflash serve", args.target, command=(
            sys.executable, "-m", "hf_dflash.cli", "serve", args.target, "--drafter",
            args.drafter or str(DEFAULT_DRAFTER), "--log-level", "warning", *extra)))
    return plans


def measure(plan: ServerPlan, prompts: list[str], args: argparse.Namespace, logs: Path) -> tuple[ServerFigures,
                                                                                                 list[Answer]]:
    server = None
    url = plan.url
    if url is None:
        port = free_port()
        log = logs / f"{plan.name.split()[0]}.log"
        server = LocalServer.start([*plan.command, "--port", str(port)], port, log)
        print(f"serve_load: starting {plan.name} on {server.url} (log: {log}) ...", file=sys.stderr, flush=True)
        try:
            server.wait_ready(args.startup_seconds)
        except (RuntimeError, TimeoutError):
            server.kill()
            raise
        url = server.url
    try:
        print(f"serve_load: {args.requests} requests, {args.concurrency} at once, to {plan.name} ...",
              file=sys.stderr, flush=True)
        answers, seconds = asyncio.run(load(url, plan.model, prompts, args))
    finally:
        if server is not None:
            server.stop(timeout=120)
    return figures(plan.name, url, answers, seconds), answers


# --------------------------------------------------------------------------------------------------
# The scenario: arguments, run, report
# --------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2", help="a folder, a Hub id, or smollm2 (the default)")
    parser.add_argument("--drafter", default=None, help="the drafter of `hf-dflash serve` (default: the shipped one)")
    parser.add_argument("--requests", type=int, default=64, help=f"requests sent to each server (at most "
                                                                 f"{MAX_REQUESTS})")
    parser.add_argument("--concurrency", type=int, default=64, help="streaming clients at once")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per answer, at most")
    parser.add_argument("--seconds", type=float, default=900, help="the longest either server's load may take")
    parser.add_argument("--startup-seconds", type=float, default=600, help="the longest a server may take to start")
    parser.add_argument("--prompts", default=None, help='a .jsonl file of {"prompt": ...} (default: 16 built-in)')
    parser.add_argument("--server-options", default="",
                        help="options for both servers, as one string, e.g. '--cb-num-blocks 512 --cb-block-size 32'")
    parser.add_argument("--baseline-url", default=None, help="a transformers serve already running on 127.0.0.1")
    parser.add_argument("--baseline-model", default=None, help="the model name the --baseline-url server answers to")
    parser.add_argument("--ours-url", default=None, help="an hf-dflash serve already running on 127.0.0.1")
    parser.add_argument("--ours-model", default=None, help="the model name the --ours-url server answers to")


def check(args: argparse.Namespace) -> None:
    """Raises BadArgument, naming the fix, for a bad argument (before any server starts)."""
    from .cli_checks import BadArgument

    if not 1 <= args.requests <= MAX_REQUESTS:
        raise BadArgument(f"--requests must be 1 .. {MAX_REQUESTS}, got {args.requests}")
    for option in ("concurrency", "max_tokens"):
        if getattr(args, option) < 1:
            raise BadArgument(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    for option in ("seconds", "startup_seconds"):
        if not getattr(args, option) > 0:
            raise BadArgument(f"--{option.replace('_', '-')} must be greater than 0, got {getattr(args, option):g}")
    for option in ("baseline_url", "ours_url"):
        url = getattr(args, option)
        if url is not None and urllib.parse.urlsplit(url).hostname not in (HOST, "localhost"):
            raise BadArgument(f"--{option.replace('_', '-')} {url}: the load test only talks to 127.0.0.1")
    if args.prompts is not None and not Path(args.prompts).is_file():
        raise BadArgument(f"--prompts {args.prompts}: no such file; pass a .jsonl file of {{\"prompt\": ...}} lines")
    if Path(args.out).is_dir():
        raise BadArgument(f"--out {args.out} is a folder; pass the JSON file to write")


def read_prompts(path: str | None) -> list[str]:
    if path is None:
        return PROMPTS
    prompts = [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {path} holds no prompt")
    return prompts


def plot(report: dict, path: Path) -> None:
    """Latency percentiles and throughput of each server, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = report["servers"]
    names = [server["name"] for server in servers]
    panels = [
        ("time to first token (s)", "time_to_first_token"),
        ("time per output token (s)", "time_per_output_token"),
        ("gap between chunks (s)", "chunk_gap"),
    ]
    figure, axes = plt.subplots(1, 4, figsize=(16, 4))
    for axis, (title, key) in zip(axes, panels):
        positions = range(len(names))
        axis.bar([p - 0.2 for p in positions], [server[f"{key}_p50"] for server in servers], 0.4, label="p50")
        axis.bar([p + 0.2 for p in positions], [server[f"{key}_p99"] for server in servers], 0.4, label="p99")
        axis.set_xticks(list(positions), names)
        axis.set_title(title)
        axis.legend()
    axes[3].bar(names, [server["tokens_per_second"] for server in servers])
    axes[3].set_title("tokens/s")
    settings = report["settings"]
    figure.suptitle(f"{report['target']}: {settings['requests']} requests, {settings['concurrency']} at once, "
                    f"{settings['max_tokens']} tokens at most ({report['device']})")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def write_report(out: Path, report: dict) -> None:
    """The JSON at `out`, and the plot beside it (.png) where matplotlib is installed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    try:
        plot(report, out.with_suffix(".png"))
    except ImportError:
        print('matplotlib is not installed: no plot (pip install "hf-dflash[bench]"); the JSON has every figure')


def run(args: argparse.Namespace) -> int:
    """Measures both servers and writes the report; 1 if an answer is missing or the two servers' differ."""
    import torch
    import transformers

    from .run_record import device_name, portable_command

    check(args)
    prompts = read_prompts(args.prompts)
    results = []
    with tempfile.TemporaryDirectory(prefix="serve_load_") as logs:
        for plan in server_plans(args):
            results.append(measure(plan, prompts, args, Path(logs)))
    (baseline, baseline_answers), (ours, our_answers) = results
    differing = [index for index, (a, b) in enumerate(zip(baseline_answers, our_answers))
                 if a.complete and b.complete and a.text != b.text]
    report = {
        "scenario": "serve",
        "command": portable_command(sys.argv),
        "device": device_name("cuda" if torch.cuda.is_available() else "cpu"),
        "transformers": transformers.__version__,
        "target": args.target,
        "drafter": args.drafter or "shipped",
        "settings": {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                     "server_options": args.server_options},
        "servers": [asdict(baseline), asdict(ours)],
        "answers_identical": not differing,
        "differing_requests": differing[:20],
    }
    out = Path(args.out)
    write_report(out, report)
    for server in (baseline, ours):
        print(f"{server.name:>18}: {server.complete}/{server.requests} complete, {server.requests_per_second:.2f} "
              f"req/s, {server.tokens_per_second:.1f} tok/s, TTFT p50 {server.time_to_first_token_p50:.3f} s "
              f"p99 {server.time_to_first_token_p99:.3f} s, TPOT p50 {server.time_per_output_token_p50 * 1e3:.1f} ms "
              f"p99 {server.time_per_output_token_p99 * 1e3:.1f} ms")
    print(f"answers identical: {not differing}; report {out}")
    complete = baseline.complete == baseline.requests and ours.complete == ours.requests
    return 0 if complete and not differing else 1


def main(argv: list[str] | None = None) -> int:
    from .cli_checks import BadArgument

    parser = argparse.ArgumentParser(prog="python -m hf_dflash.serve_load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--out", default="serve_load.json", help="the JSON report (the plot goes beside it, .png)")
    args = parser.parse_args(argv)
    try:
        check(args)
    except BadArgument as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
