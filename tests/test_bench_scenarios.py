"""Every `hf-dflash bench` scenario runs end to end on tiny inputs on the CPU and writes its report; the harness they
share times, alternates and records as it says. (`decode` has its own tests: test_bench.py, test_bench_shapes.py.)

These runs check that each scenario works and what its report holds, never how fast anything is.
"""

from __future__ import annotations

import json
import shlex
import sys

import pytest
import torch

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash.bench import SCENARIOS, harness, scenario_module
from hf_dflash.bundled_models import load_stories260k
from hf_dflash.cli import build_parser, main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, str]:
    """A random 1-layer drafter for stories260K and a file of two prompts, as the scenarios' arguments."""
    root = tmp_path_factory.mktemp("scenarios")
    target, _ = load_stories260k()
    torch.manual_seed(0)
    config = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=0)
    DFlashDraftModel(config).save_pretrained(root / "drafter")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": text}) for text in ["Once upon a time", "Tom saw a dog"]))
    return {"--target": "stories260k", "--drafter": str(root / "drafter"), "--prompts": str(prompts)}


def run_scenario(name: str, tmp_path, *options: str, code: int = 0) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["bench", name, *options, "--out", str(out)]) == code
    report = json.loads(out.read_text())
    assert report["scenario"] == name and {"date", "machine", "threads", "versions", "command"} <= report.keys()
    assert report["command"].startswith(f"hf-dflash bench {name} ")
    return report


def with_pair(pair: dict[str, str], *keys: str) -> list[str]:
    return [word for key in keys for word in (key, pair[key])]


# ------------------------------------------------------------------------------------------------------------------
# The registry and the CLI
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_scenario_is_one_module_with_the_interface(name):
    module = scenario_module(name)
    assert module.__doc__ and module.__doc__.strip().splitlines()[0]
    assert callable(module.add_arguments) and callable(module.run)


def test_a_scenario_must_be_named(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--target", "stories260k"])
    assert exit_.value.code == 2
    assert "decode" in capsys.readouterr().err  # the choices are named


def test_a_bad_argument_is_refused_before_anything_runs(tmp_path, capsys):
    assert_refused = []
    for argv, message in [
        (["bench", "top-k-top-p", "--shapes", "4by256"], "--shapes 4by256: write rows x vocabulary"),
        (["bench", "soak", "--calls", "0"], "--calls must be at least 1"),
        (["bench", "step-cost", "--contexts", "8", "--profile-context", "16"], "is not one of --contexts"),
        (["bench", "accept-cost", "--baseline", "no-such-revision"], "is not a commit of this checkout"),
        (["bench", "training-curves"], "nothing to plot"),
        (["bench", "rollback-cost", "--out", str(tmp_path)], "is a folder"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert_refused.append((exit_.value.code, message in capsys.readouterr().err, argv))
    assert all(code == 2 and found for code, found, _ in assert_refused), assert_refused


def test_the_recorded_command_parses_back_to_the_same_arguments(tmp_path):
    """A report's command spells out every option, so re-running it runs the same measurement."""
    argv = ["bench", "training-curves", "--run", "a b=log.jsonl", "c=x.jsonl", "--tau", "a b=2.5@1000@60",
            "--out", str(tmp_path / "curves.json")]
    args = build_parser().parse_args(argv)
    recorded = harness.command_line(args)
    again = build_parser().parse_args(shlex.split(recorded)[1:])
    assert vars(again) == vars(args)
    assert "'a b=log.jsonl'" in recorded  # quoted for a shell


# ------------------------------------------------------------------------------------------------------------------
# The harness
# ------------------------------------------------------------------------------------------------------------------


def test_time_call_warms_up_then_times_each_call():
    calls = []
    timing = harness.time_call(lambda: calls.append(1), repeats=5, warmup=2)
    assert len(calls) == 7 and timing.repeats == 5 and 0 <= timing.min_ms <= timing.median_ms


def test_alternate_runs_the_variants_in_turn_round_after_round():
    order = []
    results = harness.alternate({"a": lambda: order.append("a") or len(order), "b": lambda: order.append("b")
                                 or len(order)}, rounds=3)
    assert order == ["a", "b"] * 3 and results == {"a": [1, 3, 5], "b": [2, 4, 6]}


def test_arrivals_and_percentiles():
    assert harness.arrival_offsets(4, None) == [0.0] * 4
    offsets = harness.arrival_offsets(2000, rate=10.0, seed=1)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0 and all(g > 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)  # a Poisson process of 10 requests per second
    assert harness.arrival_offsets(5, rate=2.0, seed=3) == harness.arrival_offsets(5, rate=2.0, seed=3)
    with pytest.raises(ValueError, match="above 0"):
        harness.arrival_offsets(3, rate=0)
    stats = harness.percentiles([float(v) for v in range(1, 101)])
    assert (stats["p50"], stats["p90"], stats["p99"], stats["mean"]) == (50.0, 90.0, 99.0, 50.5)


def test_write_report_writes_the_json_and_says_when_there_is_no_plot(tmp_path, monkeypatch, capsys):
    plotted = []
    path = harness.write_report(tmp_path / "r.json", {"x": 1}, lambda report, png: plotted.append(png))
    assert json.loads(path.read_text()) == {"x": 1} and plotted == [path.with_suffix(".png")]
    with pytest.raises(FileNotFoundError):  # only the default results folder is made: a named one must exist
        harness.write_report(tmp_path / "deep" / "r.json", {"x": 1})

    def needs_matplotlib(report, png):
        harness.pyplot()

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    harness.write_report(tmp_path / "r2.json", {"x": 2}, needs_matplotlib)
    assert "matplotlib is not installed" in capsys.readouterr().out and (tmp_path / "r2.json").is_file()


# ------------------------------------------------------------------------------------------------------------------
# The scenarios, on tiny inputs
# ------------------------------------------------------------------------------------------------------------------


def test_step_cost_times_each_variant_against_the_1_token_step(tmp_path):
    report = run_scenario("step-cost", tmp_path, "--device", "cpu", "--contexts", "8", "12", "--new-tokens", "4",
                          "--variants", "before", "fast_path")
    assert report["scaled_down"] and report["shape"] == "qwen3-8b" and report["linear_attention_kernels"] is None
    assert [r["context"] for r in report["results"]] == [8, 12]
    for row in report["results"]:
        assert row["target_1_token_ms"] > 0 and "fold" not in row
        for variant in ("before", "fast_path"):
            parts = row[variant]
            assert parts["step_ms"] > 0 and parts["step_over_1_token"] == parts["step_ms"] / row["target_1_token_ms"]
            assert any("scaled_dot_product" in op for op in parts["verify_sdpa_ops"])  # the profiled verify ran


def test_step_cost_names_the_gated_delta_rule_of_a_hybrid_target(tmp_path):
    report = run_scenario("step-cost", tmp_path, "--device", "cpu", "--shape", "qwen3.5-4b", "--contexts", "8",
                          "--new-tokens", "4", "--variants", "fast_path", "--without-fla")
    assert report["linear_attention_kernels"] == {"flash_linear_attention": "hidden (--without-fla)"}
    assert report["results"][0]["fast_path"]["step_ms"] > 0


def test_top_k_top_p_agrees_with_transformers_and_times_both(tmp_path):
    threads = torch.get_num_threads()
    try:  # every scenario takes --threads, and its report records what it ran with
        report = run_scenario("top-k-top-p", tmp_path, "--shapes", "8x256", "--repeats", "2", "--threads", "2")
    finally:
        torch.set_num_threads(threads)
    assert report["threads"] == 2
    for result in report["shapes"]["8 x 256"].values():
        assert result["float32"]["rows_differing_from_transformers"] == 0
        assert result["bf16_rounded"]["rows_differing_from_stable_sort_pair"] == 0
        assert result["ms"]["transformers_pair"] > 0 and result["ms"]["merged_step"] > 0


def test_accept_cost_alternates_the_baseline_and_now(tmp_path):
    report = run_scenario("accept-cost", tmp_path, "--baseline", "HEAD", "--shapes", "2x4x64", "--rounds", "2",
                          "--repeats", "2")
    row = report["shapes"]["2 x 4 x 64"]
    assert len(row["baseline_ms"]) == len(row["now_ms"]) == 2 and report["baseline"] == "HEAD"


def test_rollback_cost_measures_every_way(tmp_path):
    report = run_scenario("rollback-cost", tmp_path, "--shapes", "qwen3_5_text (Qwen3.5-4B)", "--hidden-size", "64",
                          "--repeats", "1")
    settings = report["shapes"]["qwen3_5_text (Qwen3.5-4B)"]
    assert set(settings) == {"eager loop, batch 1", "fast path, batch 1", "fast path, batch 4"}
    assert settings["fast path, batch 4"]["kept_rows"] == [1, 5, 9, 16]
    assert settings["eager loop, batch 1"]["per_position_states_ms"] > 0
    assert settings["eager loop, batch 1"]["linear_layers_in_the_full_model"] == 24


def test_sampler_cost_forces_each_rule_in_whole_calls(pair, tmp_path):
    report = run_scenario("sampler-cost", tmp_path, *with_pair(pair, "--target", "--drafter", "--prompts"),
                          "--limit", "1", "--max-new-tokens", "6", "--rounds", "1", "--device", "cpu")
    assert set(report["rule_alone_ms"]) == set(report["sampled_step"]) == {"exponential race", "inverse CDF"}
    assert all(len(runs) == 1 and runs[0]["tau"] >= 1 for runs in report["sampled_step"].values())
    assert report["greedy_step"]["ms_per_step"] > 0 and report["plain_sampled_ms_per_token"] > 0


def test_sampling_rules_measures_each_rule_and_each_proposal(pair, tmp_path):
    report = run_scenario("sampling-rules", tmp_path, *with_pair(pair, "--target", "--drafter", "--prompts"),
                          "--limit", "2", "--max-new-tokens", "12", "--seeds", "1", "--overlaps", "--device", "cpu")
    assert set(report["tau"]) == {"rejection", "point_mass"} and all(t >= 1 for t in report["tau"].values())
    for proposal in report["proposals"].values():
        assert 0 <= proposal["first_row"] <= 1 and proposal["implied_tau"] >= 1


def test_draft_vocabulary_times_the_head_and_whole_calls(pair, tmp_path):
    from hf_dflash.training.data import RegeneratedData

    data = RegeneratedData.from_sequences([([5, 6, 7], [20, 21, 22, 20]), ([8, 9], [23, 20, 24])])
    regenerated = data.save(tmp_path / "regenerated.safetensors")
    report = run_scenario("draft-vocabulary", tmp_path, "--vocab", "512", "--hidden", "16", "--rows", "3", "--sizes",
                          "64", "--regenerated", str(regenerated), *with_pair(pair, "--target", "--drafter",
                                                                              "--prompts"),
                          "--limit", "1", "--max-new-tokens", "8", "--rounds", "2", "--device", "cpu")
    assert report["head"]["draft_head_64_ms"] > 0 and report["head"]["full_head_ms"] > 0
    entry = report["calls"]["sizes"]["64"]
    assert entry["coverage"] == 1.0 and len(entry["rounds"]) == 2
    assert all(r["outputs_identical"] for r in entry["rounds"])  # a draft vocabulary never changes greedy output


def test_quantized_compares_each_variant_with_its_own_greedy(pair, tmp_path):
    """On a target whose widths are multiples of 64, as bitsandbytes' 4-bit CPU kernels need (stories260K's MLP is
    172 wide), with stories260K's tokenizer for the prompts."""
    pytest.importorskip("bitsandbytes")
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = load_stories260k()
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    config = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=0)
    DFlashDraftModel(config).save_pretrained(tmp_path / "drafter")
    report = run_scenario("quantized", tmp_path, "--target", str(tmp_path / "target"), "--drafter",
                          str(tmp_path / "drafter"), "--prompts", pair["--prompts"], "--limit", "1",
                          "--max-new-tokens", "6", "--variants", "none", "nf4", "--device", "cpu")
    runs = {r["variant"]: r for r in report["runs"]}
    assert set(runs) == {"none", "nf4"} and runs["none"]["identical_to_plain_greedy"]
    assert runs["nf4"]["weights_mb"] < runs["none"]["weights_mb"]


def test_closeness_counts_no_difference_in_float32(pair, tmp_path):
    report = run_scenario("closeness", tmp_path, *with_pair(pair, "--target", "--drafter", "--prompts"), "--limit",
                          "1", "--max-new-tokens", "6", "--device", "cpu")
    assert report["differ_from_eager"] == {"dflash": 0, "static": 0} and report["outputs"] == 1


def test_soak_finds_no_problem(tmp_path):
    report = run_scenario("soak", tmp_path, "--calls", "6", "--warmup", "2", "--every", "3", "--device", "cpu")
    assert report["problems"] == [] and report["calls"] == 6 and [s["call"] for s in report["samples"]] == [2, 3, 6]


def test_training_curves_place_runs_and_points(tmp_path):
    log = tmp_path / "train_log.jsonl"
    log.write_text("\n".join(json.dumps({"step": s, "loss": 5 - s, "tau": 1 + s / 10, "anchor_blocks": 1000 * s,
                                         "wall_time_s": 6 * s}) for s in (1, 2, 3)))
    first = run_scenario("training-curves", tmp_path, "--run", f"run one={log}", "--offset", "run one=500@60",
                         "--tau", "run one=2.5@3500@78")
    assert first["runs"]["run one"]["anchor_blocks_m"] == [0.0015, 0.0025, 0.0035]
    assert first["runs"]["run one"]["gpu_minutes"] == [1.1, 1.2, 1.3]
    assert first["real_tau"] == [{"label": "run one", "tau": 2.5, "anchor_blocks_m": 0.0035, "gpu_minutes": 1.3}]
    second = run_scenario("training-curves", tmp_path, "--previous", str(tmp_path / "training-curves.json"), "--run",
                          f"run two={log}")
    assert set(second["runs"]) == {"run one", "run two"} and second["real_tau"] == first["real_tau"]


def test_training_throughput_runs_a_setting(tmp_path):
    report = run_scenario("training-throughput", tmp_path, "--shape", "tiny", "--device", "cpu", "--steps", "1",
                          "--warmup", "0", "--settings", "1", "--pool", "4", "--scale", "0.125")
    (row,) = report["training"]
    assert row["setting"] == "sparse loss, batch 16" and row["batch_size"] == 2 and row["anchor_blocks_per_s"] > 0
    assert "compiled_loss_check" not in report  # only a compiled setting checks the compiled loss


# The options a scenario cannot run without.
REQUIRED = {"accept-cost": ["--baseline", "HEAD"], "closeness": ["--prompts", "p.jsonl"]}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_scenarios_recorded_command_parses_back_to_its_arguments(name):
    """The command a report records spells out every option, defaults included (lists as one option with several
    values), so that running it again runs the same measurement whatever the defaults are then."""
    args = build_parser().parse_args(["bench", name, *REQUIRED.get(name, [])])
    again = build_parser().parse_args(shlex.split(harness.command_line(args))[1:])
    assert vars(again) == vars(args)


def test_quantized_refuses_4_bit_on_a_cpu_where_bitsandbytes_cannot_run_it(pair, tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    with pytest.raises(SystemExit) as refused:
        main(["bench", "quantized", *with_pair(pair, "--target", "--drafter", "--prompts"), "--variants", "none",
              "nf4", "--device", "cpu", "--out", str(tmp_path / "q.json")])
    assert refused.value.code == 2 and "intermediate_size 172; run on a GPU or pick int8" in capsys.readouterr().err
    assert not (tmp_path / "q.json").exists()


def test_dflash2_parts_times_each_part_of_both_drafters(tmp_path):
    report = run_scenario("dflash2-parts", tmp_path, "--rounds", "1", "--repeats", "1", "--context", "8",
                          "--block-size", "8")
    parts = report["parts_ms"]
    assert set(parts) == {"layers", "lm_head", "propose", "convolutions"}
    assert set(parts["convolutions"]) == {"DFlash2"}  # DFlash has none
    for part in ("layers", "lm_head", "propose"):
        assert set(parts[part]) == {"DFlash", "DFlash2"} and all(v[0] > 0 for v in parts[part].values())


def test_ragged_verify_times_padded_packed_and_cut_verifies(tmp_path, capsys):
    report = run_scenario("ragged-verify", tmp_path, "--shape", "tiny", "--patterns", "1,1,8", "2,3",
                          "--prompt-tokens", "40", "--rounds", "1")
    assert [row["pattern"] for row in report["rows"]] == ["1,1,8", "2,3"]
    for row in report["rows"]:
        assert all(row[f"{name}_ms"] > 0 for name in ("padded_widest", "padded_mean", "one_span", "cut"))
        assert row["spans"] >= 1 and row["key_positions"] >= 40
    for pattern, problem in (("1,0", "at least 1 row"), ("1,9", "the tiny shape's drafter verifies at most 8 rows")):
        with pytest.raises(SystemExit) as refused:
            main(["bench", "ragged-verify", "--shape", "tiny", "--patterns", pattern, "--out",
                  str(tmp_path / "bad.json")])
        assert refused.value.code == 2 and problem in capsys.readouterr().err


def test_engine_step_times_the_eager_and_the_static_step(tmp_path, capsys):
    report = run_scenario("engine-step", tmp_path, "--shape", "tiny", "--requests", "1", "3", "--steps", "2",
                          "--warmup", "2", "--prompt-tokens", "9", "--modes", "eager", "static", "policy")
    assert [row["requests"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["eager_ms_per_step"] > 0 and row["static_ms_per_step"] > 0 and row["policy_ms_per_step"] > 0
        assert all(1 <= row[f"{mode}_tokens_per_step"] <= 8 for mode in ("eager", "static", "policy"))
        assert row["policy_over_static_tokens_per_s"] > 0 and sum(row["policy_width_steps"].values()) == 4
        assert row["static_graphs"] == 0  # a CPU runs the padded step eagerly
        assert row["admit_alone_ms"] > 0 and row["admit_packed_ms"] > 0
    # three steps timed at each request count, largest first, as a batch shrinks
    for name in ("new_shapes", "recorded_ahead"):  # cold, then after record_shapes
        assert [row["requests"] for row in report[name]] == [3, 1]
        assert all(row[key] > 0 for row in report[name] for key in ("first_ms", "second_ms", "third_ms"))
    assert report["record_shapes_ms"] > 0
    with pytest.raises(SystemExit) as refused:
        main(["bench", "engine-step", "--warmup", "1", "--out", str(tmp_path / "bad.json")])
    assert refused.value.code == 2 and "--warmup must be at least 2" in capsys.readouterr().err
