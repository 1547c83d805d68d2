"""`hf-dflash bench decode` end to end on the CPU: real stories260K target, every method that runs on a CPU, one
report."""

from __future__ import annotations

import json

import pytest
import torch

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash.bundled_models import load_stories260k
from hf_dflash.cli import main
from hf_dflash.modeling import dflash_decoding


def random_drafter_and_prompts(tmp_path, texts: list[str]) -> tuple[str, str]:
    """A random 1-layer drafter for stories260K saved under tmp_path, and a prompt file of `texts`."""
    target, _ = load_stories260k()
    torch.manual_seed(0)
    config = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=0)
    DFlashDraftModel(config).save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": text}) for text in texts))
    return str(tmp_path / "drafter"), str(prompts)


def test_bench_reports_every_method_side_by_side(tmp_path, monkeypatch):
    drafter, prompts = random_drafter_and_prompts(tmp_path, ["Once upon a time", "The dog ran", "Tom saw"])
    out = tmp_path / "report.json"
    engine_calls = []  # every DFlash generate call: (its batch, whether the engine's pool held the target's cache)
    decode_on_engine = dflash_decoding.decode_on_engine
    monkeypatch.setattr(
        dflash_decoding, "decode_on_engine",
        lambda *args: engine_calls.append((args[1].shape[0], args[6] is None)) or decode_on_engine(*args),
    )
    methods = ["plain", "plain-static", "dflash", "dflash-engine", "dflash-transformers-cache"]
    main([
        "bench", "decode", "--target", "stories260k", "--drafter", drafter, "--prompts", prompts,
        "--max-new-tokens", "12", "--batch-sizes", "1", "2", "--methods", *methods, "--out", str(out),
    ])
    report = json.loads(out.read_text())
    assert report["dtype"] == "fp32"  # the default on a CPU
    assert {"date", "machine", "versions", "command"} <= report.keys()
    rows = {(r["setting"].split()[-1], r["method"]): r for r in report["results"]}
    assert set(rows) == {(b, m) for b in ("b1", "b2") for m in methods}
    # per method, b1: a warm-up, then each prompt's timed and first-token calls; b2: batches of 2 and 1 prompts. The
    # pool serves `dflash` (its default on a CPU too) and `dflash-engine`, transformers' cache the last method.
    b1 = [(1, True)] * 14 + [(1, False)] * 7
    b2 = [(n, True) for n in (2, 2, 2, 1, 1)] * 2 + [(n, False) for n in (2, 2, 2, 1, 1)]
    assert engine_calls == b1 + b2
    for row in rows.values():
        assert row["prompts"] == 3 and 0 < row["new_tokens"] <= 36 and row["tokens_per_s"] > 0
        assert row["identical_to_plain"] == 1.0  # float32 on a CPU: every method gives plain greedy's tokens
    assert rows["b1", "dflash"]["tau"] >= 1 and rows["b1", "plain"]["tau"] == 1
    for batch in ("b1", "b2"):  # speedups are tokens/s ratios within one setting
        ours, plain = rows[batch, "dflash"], rows[batch, "plain"]
        assert ours["extra"]["speedup_over_plain"] == pytest.approx(ours["tokens_per_s"] / plain["tokens_per_s"])
        assert plain["extra"]["speedup_over_plain"] == 1


def test_bench_runs_our_methods_with_one_verify_policy_each(tmp_path, monkeypatch):
    """`--adaptive`: each of our methods passes one `VerifyPolicy` to all its calls, which verifies the widths it
    chose; the setting says so, and the tokens stay plain greedy's."""
    import hf_dflash.bench.decode as decode

    policies = []

    class Recording(decode.VerifyPolicy):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.steps_recorded = 0
            policies.append(self)

        def record(self, *args, **kwargs):
            self.steps_recorded += 1
            super().record(*args, **kwargs)

    monkeypatch.setattr(decode, "VerifyPolicy", Recording)
    drafter, prompts = random_drafter_and_prompts(tmp_path, ["Once upon a time", "Tom saw"])
    out = tmp_path / "adaptive.json"
    main(["bench", "decode", "--target", "stories260k", "--drafter", drafter, "--prompts", prompts,
          "--max-new-tokens", "12", "--methods", "plain", "dflash-engine", "dflash-transformers-cache", "--adaptive",
          "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert all(row["setting"].endswith("adaptive b1") and row["identical_to_plain"] == 1.0 for row in rows)
    assert len(policies) == 2 and all(policy.steps_recorded > 0 for policy in policies)


def test_bench_samples_with_a_family_preset_and_runs_prompts_at_their_own_lengths(tmp_path):
    drafter, prompts = random_drafter_and_prompts(tmp_path, ["Once upon a time there was", "Tom saw"])
    common = ["bench", "decode", "--target", "stories260k", "--drafter", drafter, "--prompts", prompts,
              "--max-new-tokens", "10", "--batch-sizes", "1", "--methods", "plain", "dflash", "--dtype", "fp32"]
    reports = []
    for run in range(2):  # seeded: the same sampled tokens twice
        out = tmp_path / f"sampled{run}.json"
        main(common + ["--sampling", "qwen3", "--own-lengths", "--out", str(out)])
        reports.append(json.loads(out.read_text())["results"])
    rows = {r["method"]: r for r in reports[0]}
    assert all("qwen3-sampling own-lengths" in r["setting"] for r in reports[0])
    assert rows["plain"]["identical_to_plain"] is None  # sampled tokens are compared in distribution, not here
    assert [r["new_tokens"] for r in reports[0]] == [r["new_tokens"] for r in reports[1]]
    assert [r["tau"] for r in reports[0]] == [r["tau"] for r in reports[1]]


def test_bench_refuses_own_lengths_with_batches(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "decode", "--target", "stories260k", "--batch-sizes", "1", "4", "--own-lengths",
              "--out", str(tmp_path / "r.json")])
    assert exit_.value.code == 2
    assert "--own-lengths" in capsys.readouterr().err


def test_native_tau_counts_every_token_and_larger_batches_skip_it(tmp_path, monkeypatch):
    """transformers' DFlash loop verifies its first draft with the prefill, so each of its new tokens is committed by
    one of its verify steps (a random drafter gives tau 1, not less); it runs batch 1 only, so a batch-2 setting skips
    it and says so instead of failing after the batch-1 setting ran. Tokens are compared with plain's whatever the
    order of --methods."""
    monkeypatch.chdir(tmp_path)
    drafter, prompts = random_drafter_and_prompts(tmp_path, ["Once upon a time", "The dog ran", "Tom saw"])
    out = tmp_path / "report.json"
    main([
        "bench", "decode", "--target", "stories260k", "--drafter", drafter, "--prompts", prompts, "--max-new-tokens", "8",
        "--batch-sizes", "1", "2", "--methods", "dflash", "native", "plain", "--out", str(out),
    ])
    assert str(tmp_path) not in out.read_text()  # paths under the working directory are written relative
    report = json.loads(out.read_text())
    rows = {(r["setting"].split()[-1], r["method"]): r for r in report["results"]}
    assert set(rows) == {("b1", "plain"), ("b1", "native"), ("b1", "dflash"), ("b2", "plain"), ("b2", "dflash")}
    assert report["skipped"] == ["stories260k prompts b2 native: transformers' DFlash loop runs batch 1 only"]
    assert rows["b1", "native"]["tau"] >= 1
    assert rows["b1", "native"]["steps"] <= rows["b1", "native"]["new_tokens"] - rows["b1", "native"]["prompts"]
    for key, row in rows.items():
        assert row["identical_to_plain"] == 1.0, key


def test_new_tokens_run_to_the_first_eos_not_to_the_pad_id():
    """A --random-weights run pads with id 0, which a random target may also write as text: a row's new tokens end
    at its first eos (none here), not at the first token that equals the pad id."""
    from hf_dflash.bench.decode import run_method
    from tests.conftest import random_prompt, tiny_drafter, tiny_target

    target = tiny_target("llama")
    target.generation_config.eos_token_id = None
    batch = {"input_ids": random_prompt(6), "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    text = target.generate(**batch, max_new_tokens=10, do_sample=False)[0, 6:].tolist()
    measurement, outputs = run_method("plain", target, tiny_drafter(target), [batch], 10, "tiny", text[2])
    assert outputs == [text] and measurement.new_tokens == 10


def test_time_to_first_token_is_per_call_not_per_prompt():
    """A batch of 4 prompts waits for its first tokens as long as one call takes, not a quarter of that."""
    from hf_dflash.bench.decode import Measurement, format_row

    batch_of_four = Measurement("s", "plain", prompts=4, batches=1, new_tokens=40, seconds=1.0, ttft_s=0.2, steps=9,
                                peak_memory_gb=None, tau=1.0)
    assert "ttft   200.0 ms" in format_row(batch_of_four)


def test_a_new_shapes_setup_lands_in_the_call_not_in_the_first_token_time(monkeypatch):
    """Under --own-lengths each prompt is a new shape, and its one-time setup must count in the timed call of every
    method: the first-token call of a batch is timed after its full call, on the shape that call has set up."""
    from hf_dflash.bench.decode import run_method
    from tests.conftest import random_prompt, tiny_drafter, tiny_target

    target = tiny_target("llama")
    generate, calls = target.generate, []

    def recorded(**kwargs):
        calls.append((kwargs["input_ids"].shape[1], kwargs["max_new_tokens"]))
        return generate(**kwargs)

    monkeypatch.setattr(target, "generate", recorded)
    batches = [{"input_ids": random_prompt(n, seed=n), "attention_mask": torch.ones(1, n, dtype=torch.long)}
               for n in (5, 7)]
    run_method("plain", target, tiny_drafter(target), batches, 6, "tiny", 0)
    assert calls == [(5, 6), (5, 6), (5, 1), (7, 6), (7, 1)]  # the warm-up, then each prompt: full call, first token
