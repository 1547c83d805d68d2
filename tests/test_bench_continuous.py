"""`hf-dflash bench continuous` on stories260K and a random 1-layer drafter, a few requests: the report's fields, every
arm's tokens against plain greedy, the drafter arm run or said to be unavailable, and bad arguments refused before any
model loads. These runs check what the scenario measures and records, never how fast anything is."""

from __future__ import annotations

import inspect
import json
import threading
import time

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash.bench import continuous
from hf_dflash.bundled_models import load_stories260k
from hf_dflash.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

DRAFTER_ARM = "assistant_model" in inspect.signature(LlamaForCausalLM.init_continuous_batching).parameters


@pytest.fixture(scope="module")
def options(tmp_path_factory) -> list[str]:
    """stories260K, a random drafter for it and a file of three chat turns, as the scenario's arguments."""
    root = tmp_path_factory.mktemp("continuous")
    target, _ = load_stories260k()
    torch.manual_seed(0)
    config = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=0)
    DFlashDraftModel(config).save_pretrained(root / "drafter")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": text}) for text in
                                 ["Once upon a time", "Tom saw a big dog in the park", "The sun"]))
    return ["--target", "stories260k", "--drafter", str(root / "drafter"), "--prompts", str(prompts), "--device", "cpu"]


@pytest.fixture
def drafter_forwards(monkeypatch) -> list[int]:
    """Counts the drafter's forward calls: an arm that claims the drafter must have called it."""
    calls = []
    forward = DFlashDraftModel.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DFlashDraftModel, "forward", counted)
    return calls


def run_continuous(tmp_path, *argv: str) -> dict:
    out = tmp_path / "continuous.json"
    assert main(["bench", "continuous", *argv, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_every_arm_at_every_concurrency_reports_its_figures_and_plain_greedy_tokens(options, tmp_path,
                                                                                      drafter_forwards):
    report = run_continuous(tmp_path, *options, "--requests", "4", "--concurrency", "1", "3", "--max-new-tokens", "6",
                            "--check", "4")
    assert report["scenario"] == "continuous" and {"date", "machine", "versions", "command"} <= report.keys()
    assert report["command"].startswith("hf-dflash bench continuous ") and "--concurrency 1 3" in report["command"]
    assert report["arrival"] == "all at once" and report["distinct_prompts"] == 3
    arms = ["cb", "cb-freed", *(["cb-drafter"] if DRAFTER_ARM else []), "generate-batches"]
    assert [(r["arm"], r["concurrency"]) for r in report["runs"]] == [(a, c) for c in (1, 3) for a in arms]
    for run in report["runs"]:
        assert run["requests"] == run["sent"] == run["completed"] == 4 and run["errors"] == []
        assert run["output_tokens"] == 4 * 6 and run["requests_per_s"] > 0 and run["output_tokens_per_s"] > 0
        for key in ("ttft_s", "itl_s", "latency_s"):
            assert 0 <= run[key]["p50"] <= run[key]["p99"]
        # request 3 repeats prompt 0 (requests cycle the prompts): checked too
        assert run["identical_to_plain"] == {"checked": 4, "identical": 4, "mismatches": []}
        # a manager's warmup is timed apart from its run; fixed batches have none
        assert (run["warmup_s"] >= 0) if run["arm"] != "generate-batches" else "warmup_s" not in run
        if run["arm"] != "cb-drafter":
            assert "engine" not in run
            continue
        engine = run["engine"]  # what the drafter's engine did: its policy is on on a CPU by default
        assert engine["policy"] is True and engine["steps"] == sum(engine["width_steps"].values()) > 0
        assert 0 <= engine["plain_step_fraction"] <= 1 and 1 <= engine["mean_width"] <= 4 and engine["tau"] >= 1
    assert report["mismatches"] == 0
    assert drafter_forwards  # the fixed batches decoded with the drafter
    if DRAFTER_ARM:
        assert report["arms"]["cb-drafter"]["available"] is True
    else:
        drafter_arm = report["arms"]["cb-drafter"]
        assert drafter_arm["available"] is False and "takes no assistant_model" in drafter_arm["reason"]


def test_a_request_that_ends_on_eos_ends_there_in_every_arm(options, tmp_path, monkeypatch):
    """eos is made the third token plain greedy answers the first prompt with: every arm must stop that request
    there, eos included, as plain generate does, while the other requests run on."""
    from hf_dflash import generate_cli
    from hf_dflash.training.data import encode_prompt

    target, tokenizer = load_stories260k()
    prompt = encode_prompt(tokenizer, "Once upon a time")
    answer = target.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)[0, len(prompt):].tolist()
    target.generation_config.eos_token_id = answer[2]
    monkeypatch.setattr(generate_cli, "load_target", lambda *args: (target, tokenizer))
    report = run_continuous(tmp_path, *options, "--requests", "3", "--concurrency", "3", "--max-new-tokens", "8")
    for run in report["runs"]:
        assert run["completed"] == 3 and run["identical_to_plain"] == {"checked": 3, "identical": 3, "mismatches": []}
        assert run["output_tokens"] < 3 * 8  # request 0 ended on eos


def test_no_adaptive_verifies_every_step_at_the_full_block_and_rows_are_set(options, tmp_path):
    report = run_continuous(tmp_path, *options, "--requests", "3", "--concurrency", "3", "--max-new-tokens", "6",
                            "--arms", "cb-drafter", "--no-adaptive", "--cb-max-requests", "2")
    (run,) = report["runs"]
    assert run["completed"] == 3 and run["identical_to_plain"]["identical"] == 3
    engine = run["engine"]
    assert engine["policy"] is False and list(engine["width_steps"]) == ["4"] and engine["rows"] == 2


def test_cb_cuda_graphs_reaches_the_drafters_manager(options, tmp_path):
    # on a CPU "on" runs the engine's padded static-shape step eagerly (no graph): the option reached the engine
    report = run_continuous(tmp_path, *options, "--requests", "2", "--concurrency", "2", "--max-new-tokens", "6",
                            "--arms", "cb-drafter", "--no-adaptive", "--cb-cuda-graphs", "on")
    (run,) = report["runs"]
    assert run["completed"] == 2 and run["identical_to_plain"]["identical"] == 2
    assert run["engine"]["static_shapes"] is True and run["engine"]["cuda_graphs"] is False
    assert "--cb-cuda-graphs on" in report["command"]


def test_a_small_cache_preempts_and_the_report_counts_it(options, tmp_path):
    # one block of transformers' config, 256 positions: three requests of 96 new tokens grow past them together, and
    # every answer is still plain greedy's
    report = run_continuous(tmp_path, *options, "--requests", "3", "--concurrency", "3", "--max-new-tokens", "96",
                            "--arms", "cb-drafter", "--no-adaptive", "--cb-num-blocks", "1", "--check", "3")
    (run,) = report["runs"]
    assert run["completed"] == 3 and run["identical_to_plain"]["identical"] == 3
    assert run["engine"]["preemptions"] > 0


def test_the_full_width_arm_runs_beside_the_policy_at_static_shapes(options, tmp_path):
    # static shapes with the policy: the step in parts a GPU records, run eagerly here
    report = run_continuous(tmp_path, *options, "--requests", "2", "--concurrency", "2", "--max-new-tokens", "6",
                            "--arms", "cb-drafter", "cb-drafter-full", "--adaptive", "--cb-cuda-graphs", "on")
    runs = {run["arm"]: run for run in report["runs"]}
    assert all(run["completed"] == 2 and run["identical_to_plain"]["identical"] == 2 for run in runs.values())
    assert runs["cb-drafter"]["engine"]["policy"] is True and runs["cb-drafter"]["engine"]["static_shapes"] is True
    assert runs["cb-drafter-full"]["engine"]["policy"] is False
    assert list(runs["cb-drafter-full"]["engine"]["width_steps"]) == ["4"]


def test_the_one_width_arm_runs_beside_per_request_widths(options, tmp_path):
    from hf_dflash.bench.continuous import arm_policy

    assert arm_policy("cb-drafter-uniform", None).per_sequence is False and arm_policy("cb-drafter", None) is None
    assert arm_policy("cb-drafter-uniform", False) is False  # --no-adaptive: no policy in any arm
    report = run_continuous(tmp_path, *options, "--requests", "3", "--concurrency", "3", "--max-new-tokens", "12",
                            "--arms", "cb-drafter", "cb-drafter-uniform", "--check", "3")
    runs = {run["arm"]: run for run in report["runs"]}
    assert all(run["completed"] == 3 and run["identical_to_plain"]["identical"] == 3 for run in runs.values())
    uniform = runs["cb-drafter-uniform"]["engine"]
    assert uniform["policy"] is True and uniform["ragged_step_fraction"] == 0
    assert uniform["rows_per_sequence_step"] >= 1


def test_a_poisson_arrival_and_one_arm(options, tmp_path):
    report = run_continuous(tmp_path, *options, "--requests", "3", "--concurrency", "2", "--max-new-tokens", "4",
                            "--rate", "20", "--seed", "1", "--arms", "cb")
    assert report["arrival"] == "Poisson, 20.0 requests/s (seed 1)" and set(report["arms"]) == {"cb"}
    (run,) = report["runs"]
    assert run["completed"] == 3 and run["identical_to_plain"]["identical"] == 3


def test_max_seconds_stops_sending_and_says_so(options, tmp_path):
    report = run_continuous(tmp_path, *options, "--requests", "3", "--concurrency", "1", "--max-new-tokens", "4",
                            "--max-seconds", "1e-9", "--arms", "generate-batches")
    (run,) = report["runs"]
    assert run["not_sent"] == 3 and run["completed"] == 0 and run["requests_per_s"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "4", "0"], "--concurrency must be at least 1, got 0"),
    (["--requests", "0"], "--requests must be at least 1"),
    (["--cb-max-requests", "0"], "--cb-max-requests must be at least 1"),
    (["--rate", "0"], "--rate must be greater than 0"),
    (["--arrival", "poisson"], "--arrival poisson needs --rate R"),
    (["--arrival", "all-at-once", "--rate", "2"], "--rate sets a Poisson arrival"),
    (["--max-seconds", "0"], "--max-seconds must be greater than 0"),
    (["--prompts", "no-such-file.jsonl"], "no such file"),
    (["--max-new-tokens", "100000"], "do not fit"),
])
def test_a_bad_argument_is_refused_in_one_line_before_any_model_loads(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(continuous, "benchmark", lambda args: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "continuous", "--target", "stories260k", *argv])
    error = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and message in error and len(error.splitlines()) == 1


def test_inter_token_gaps_share_a_delivery_among_its_tokens():
    # first token at 0.1; one delivery of three tokens 0.3 s later; one of one token 0.3 s after that
    assert continuous.inter_token_gaps([0.1, 0.4, 0.4, 0.4, 0.7]) == pytest.approx([0.1, 0.1, 0.1, 0.3])
    assert continuous.inter_token_gaps([0.5]) == []


def test_the_token_clock_names_each_sequence_by_its_prompt_and_stops_at_the_deadline():
    start = time.perf_counter()
    clock = continuous.TokenClock(width=2, start=start, deadline=60)
    batch = torch.tensor([[0, 5, 7], [4, 6, 8]])
    assert not clock(batch).any()  # plain generate: the whole batch, once per step
    assert not clock(torch.tensor([[4, 6, 8, 9]])).any()  # ours: one sequence, once per token
    time.sleep(2 * clock.STEP_GAP_S)  # the next step
    assert not clock(torch.tensor([[4, 6, 8, 9, 10]])).any()
    assert set(clock.times) == {(0, 5), (4, 6)}
    first, same_step, next_step = (clock.times[(4, 6)][n] for n in (1, 2, 3))
    assert first == same_step == clock.times[(0, 5)][1] < next_step
    late = continuous.TokenClock(width=2, start=start - 120, deadline=60)
    assert late(batch).all() and late.cut


def test_the_drafter_arm_is_available_only_where_init_continuous_batching_takes_a_drafter():
    target, _ = load_stories260k()
    reason = continuous.drafter_arm_unavailable(target)
    assert (reason is None) == DRAFTER_ARM

    class TakesADrafter(type(target)):
        def init_continuous_batching(self, generation_config=None, assistant_model=None, **kwargs):
            raise AssertionError("not called")

    target.__class__ = TakesADrafter
    assert continuous.drafter_arm_unavailable(target) is None


def test_caller_thread_serves_both_ways_with_the_drafter_and_the_same_tokens(options, tmp_path, monkeypatch):
    threads = set()  # where the drafter ran: both ways must have run it
    forward = DFlashDraftModel.forward
    monkeypatch.setattr(DFlashDraftModel, "forward", lambda self, *args, **kwargs: threads.add(
        threading.current_thread().name) or forward(self, *args, **kwargs))
    out = tmp_path / "caller_thread.json"
    assert main(["bench", "caller-thread", *options, "--batches", "1", "2", "--rounds", "1", "--max-new-tokens", "4",
                 "--forwards", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["prompts"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert row["same_tokens"] and row["calling thread tok/s median"] > 0 and row["worker thread tok/s median"] > 0
    freed = "worker thread, caller's pool freed"
    assert all(report["forward_ms"][mode] > 0 for mode in ("calling thread", "worker thread", freed))
    assert threads == {threading.current_thread().name, "dflash-continuous-batching"}
