"""The command line refuses bad arguments before any model loads: one line on stderr naming the fix, exit status 2.
Hub look-ups answer at once when the Hub is offline; `generate` says which path it takes and streams where its steps run
eagerly."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch

import hf_dflash.generate_cli
import hf_dflash.hub
from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash.cli import main
from hf_dflash.modeling import dflash_decoding
from tests.conftest import random_prompt, tiny_drafter, tiny_target

PUBLISHED = "z-lab/Qwen3-8B-DFlash-b16"


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any attempt to load a target or a drafter fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model loaded before the arguments were checked")

    monkeypatch.setattr(hf_dflash.generate_cli, "load_target", refuse)
    monkeypatch.setattr(DFlashDraftModel, "from_pretrained", refuse)


@pytest.fixture
def unreachable_hub(monkeypatch, tmp_path):
    """A Hub endpoint that refuses connections, an empty Hub cache, and offline mode not yet set."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for variable in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(variable, raising=False)
    hf_dflash.hub.use_offline_hub_when_unreachable.cache_clear()
    yield
    hf_dflash.hub.use_offline_hub_when_unreachable.cache_clear()


@pytest.fixture(scope="module")
def small_drafter(tmp_path_factory):
    """A saved drafter of block size 4 for stories260K (random weights; built from its config, without loading it)."""
    from hf_dflash.bundled_models import stories260k_config_and_tokenizer

    target_config, _ = stories260k_config_and_tokenizer()
    config = DFlashConfig.for_target(target_config, num_hidden_layers=1, block_size=4, mask_token_id=0)
    folder = tmp_path_factory.mktemp("drafter")
    DFlashDraftModel(config).save_pretrained(folder)
    return folder


def refused(argv, capsys) -> str:
    """The one stderr line of a refused command (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["generate", "--drafter", "/nonexistent"], "--drafter /nonexistent: no such folder"),
        (["generate", "--target", "/nonexistent-model"], "--target /nonexistent-model: no such folder"),
        (["generate", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
        (["generate", "--max-new-tokens", "-5"], "--max-new-tokens must be at least 1, got -5"),
        (["generate", "--verify-rows", "0"], "--verify-rows must be at least 1"),
        (["generate", "--prompt", "  "], "--prompt is empty"),
        (["generate", "--threads", "0"], "--threads must be at least 1, got 0"),
        (["bench", "top-k-top-p", "--threads", "0"], "--threads must be at least 1, got 0"),
        (["serve", "--threads", "0"], "--threads must be at least 1, got 0"),
        (["train", "--target", "smollm2", "--out", "o", "--threads", "0"], "--threads must be at least 1, got 0"),
        (["eval", "--target", "smollm2", "--drafter", "d", "--threads", "0"], "--threads must be at least 1, got 0"),
        (["generate", "--device", "tpu9"], "is not a device; pass cpu, cuda or cuda:N"),
        (["generate", "--dtype", "fp8"], "invalid choice: 'fp8'"),
        (["generate", "--max-new-tokens", "many"], "invalid int value: 'many'"),
        (["bench", "decode", "--limit", "0"], "--limit must be at least 1"),
        (["bench", "decode", "--batch-sizes", "1", "0"], "--batch-sizes must be at least 1, got 0"),
        (["bench", "decode", "--prompts", "missing.jsonl"], "--prompts missing.jsonl: no such file"),
        (["bench", "decode", "--out", "."], "--out . is a folder"),
        (["bench", "decode", "--batch-size", "4"], "--batch-size applies to --random-weights runs"),
        (["bench", "decode", "--context-lengths", "2048"], "--context-lengths applies to --random-weights runs"),
        (["bench", "decode", "--random-weights", "qwen3-8b", "--batch-sizes", "4"], "--batch-sizes applies to prompt-set runs"),
        (["bench", "decode", "--random-weights", "qwen3-8b", "--drafter", "d"], "leave out --target and --drafter"),
        (["bench", "decode", "--random-weights", "qwen3-8b", "--target", "stories260k"], "leave out --target and --drafter"),
        (["bench", "decode", "--random-weights", "qwen3-8b", "--prompts", "humaneval"], "leave out --prompts and --limit"),
        (["bench", "decode", "--random-weights", "qwen3-8b", "--limit", "4"], "leave out --prompts and --limit"),
        (["train", "--target", "smollm2", "--out", "o", "--lr", "-1"], "--lr must be at least 0"),
        (["train", "--target", "smollm2", "--out", "o", "--steps", "0"], "--steps must be at least 1"),
        (["train", "--target", "smollm2", "--out", "o", "--draft-vocab-size", "0"],
         "--draft-vocab-size must be at least 1"),
        (["train", "--target", "smollm2", "--out", "o", "--block-size", "1"], "--block-size must be at least 2"),
        (["train", "--target", "smollm2", "--out", "o", "--warmup-ratio", "1"], "--warmup-ratio must be in [0, 1)"),
        (["train", "--target", "smollm2", "--out", "o", "--prompts", "sharegpt:0"], "N in sharegpt:N must be"),
        (["train", "--target", "smollm2", "--out", "o", "--target-layer-ids", "1,1"], "--target-layer-ids must be"),
        (["train", "--target", "smollm2", "--out", "o", "--resume", "/nowhere"], "no such checkpoint folder"),
        (["train", "--target", "smollm2", "--out", "o", "--resume"], "no checkpoint under o/checkpoints yet"),
        (["train", "--target", "smollm2", "--out", "o", "--log-every", "0"], "--log-every must be at least 1"),
        (["train", "--target", "smollm2", "--out", "o", "--distill-weight", "2"], "--distill-weight must be in [0, 1]"),
        (["train", "--target", "smollm2", "--out", "o", "--max-shard-size", "big"], "'big' is not a size"),
        (["train", "--target", "smollm2", "--out", "o", "--init-from", "/nowhere"], "/nowhere: no drafter there"),
        (["eval", "--target", "smollm2", "--drafter", "/nonexistent"], "--drafter /nonexistent: no such folder"),
        (["eval", "--target", "smollm2", "--drafter", "x", "--limit", "0"], "--limit must be at least 1"),
        (["convert", "/nonexistent", "out", "--to", "ours"], "/nonexistent is not a checkpoint folder"),
        (["push", "/nonexistent", "org/name"], "/nonexistent is not a drafter folder"),
        (["info", "/nonexistent"], "drafter /nonexistent: no such folder"),
    ],
)
def test_bad_argument_is_one_line_before_any_model_loads(argv, expected, capsys, no_model_loads, tmp_path,
                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = refused(argv, capsys)
    assert err.startswith(f"hf-dflash {argv[0]}: error: ") and expected in err, err


def test_verify_rows_above_the_block_size_reads_only_the_config(small_drafter, capsys, no_model_loads):
    err = refused(["generate", "--drafter", str(small_drafter), "--verify-rows", "99"], capsys)
    assert "--verify-rows 99 is more than the drafter's block size 4; pass 1 .. 4" in err


def test_a_target_folder_given_as_the_drafter_is_one_line(tmp_path, capsys, no_model_loads):
    """--verify-rows and --init-from read the drafter's config in the checks: a folder of another model (its
    config.json is no drafter's) is refused there in one line, not with a traceback."""
    tiny_target("llama").config.save_pretrained(tmp_path / "target")
    for argv in (["generate", "--target", "stories260k", "--drafter", str(tmp_path / "target"), "--verify-rows", "2"],
                 ["train", "--target", "stories260k", "--out", "o", "--init-from", str(tmp_path / "target")]):
        assert "(model_type 'llama') is not a DFlash drafter" in refused(argv, capsys)


def test_default_drafter_block_size_bounds_verify_rows(capsys, no_model_loads):
    block_size = json.loads((hf_dflash.generate_cli.DEFAULT_DRAFTER / "config.json").read_text())["block_size"]
    err = refused(["generate", "--verify-rows", str(block_size + 1)], capsys)
    assert f"block size {block_size}" in err


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the message of a CPU-only torch")
def test_init_from_refuses_options_that_would_change_its_shape(small_drafter, capsys, no_model_loads):
    """A drafter continued with --init-from keeps its block size, mask token and captured layers: an option that
    asks for others was accepted and left unread."""
    common = ["train", "--target", "stories260k", "--out", "o", "--init-from", str(small_drafter)]
    assert "leave out --block-size" in refused([*common, "--block-size", "8"], capsys)
    assert "leave out --target-layer-ids" in refused([*common, "--target-layer-ids", "0,1"], capsys)
    assert "leave out --init-from-target" in refused([*common, "--init-from-target"], capsys)
    # its block size 4 bounds --max-length, not the default 16 of a new drafter
    assert "--max-length must be at least 4 (one block), got 3" in refused([*common, "--max-length", "3"], capsys)


def test_eval_record_needs_a_training_record(small_drafter, capsys, no_model_loads):
    """--record writes into training_args.json: a drafter without one is refused before the measurement runs."""
    err = refused(["eval", "--target", "stories260k", "--drafter", str(small_drafter), "--record"], capsys)
    assert "has none (only hf-dflash train writes one); leave out --record" in err


@pytest.mark.parametrize("command", ["eval", "bench"])
def test_a_prompt_file_of_other_objects_fails_before_the_models_load(command, small_drafter, tmp_path, capsys,
                                                                    no_model_loads, monkeypatch):
    monkeypatch.delenv("HF_DFLASH_DEBUG", raising=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"text": "hello"}) + "\n")
    extra = ["--out", str(tmp_path / "r.json")] if command == "bench" else []
    words = ["bench", "decode"] if command == "bench" else [command]
    err = refused([*words, "--target", "stories260k", "--drafter", str(small_drafter), "--prompts", str(prompts),
                   *extra], capsys)
    assert f'--prompts {prompts} line 2 is not a {{"prompt": ...}} object' in err, err


def test_cuda_on_a_cpu_only_torch(capsys, no_model_loads):
    err = refused(["generate", "--device", "cuda"], capsys)
    assert "CPU-only build" in err and "--device cpu" in err


def test_flex_attention_training_without_a_gpu(capsys, no_model_loads, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = refused(["train", "--target", "stories260k", "--out", "o", "--attention", "flex"], capsys)
    assert "--attention flex trains on a GPU only" in err


def test_cuda_index_beyond_the_gpus(capsys, no_model_loads, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    err = refused(["generate", "--device", "cuda:5"], capsys)
    assert "has 2 GPU(s), cuda:0 .. cuda:1" in err


def test_missing_gguf_names_the_extra(capsys, no_model_loads, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    err = refused(["generate", "--target", "stories260k"], capsys)
    assert 'pip install "hf-dflash[local]"' in err


def test_gguf_import_error_after_the_checks_names_the_extra():
    from hf_dflash.cli_checks import describe_failure

    error = ImportError("Please install torch and gguf>=0.10.0 to load a GGUF checkpoint in PyTorch.")
    assert 'pip install "hf-dflash[local]"' in describe_failure(error)


def test_convert_to_speculators_needs_the_target(small_drafter, capsys, tmp_path):
    err = refused(["convert", str(small_drafter), str(tmp_path / "out"), "--to", "speculators"], capsys)
    assert "pass --target" in err
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_target_it_would_not_read(small_drafter, capsys, tmp_path):
    argv = ["convert", str(small_drafter), str(tmp_path / "out"), "--to", "zlab", "--target", "org/model"]
    err = refused(argv, capsys)
    assert "--to zlab reads nothing of the target" in err and not (tmp_path / "out").exists()


def test_convert_refuses_a_folder_that_holds_no_drafter_before_reading_its_weights(tmp_path, capsys, monkeypatch):
    import hf_dflash.convert

    tiny_target("llama").config.save_pretrained(tmp_path / "target")
    monkeypatch.setattr(hf_dflash.convert, "read_folder", lambda *a, **k: pytest.fail("weights read before the check"))
    err = refused(["convert", str(tmp_path / "target"), str(tmp_path / "out"), "--to", "ours"], capsys)
    assert "(model_type 'llama') is not a DFlash drafter in any known layout" in err


def test_push_to_a_bad_repository_id(small_drafter, capsys):
    assert "not a Hub repository id" in refused(["push", str(small_drafter), "no slash here"], capsys)


def test_unknown_hub_id_while_offline_is_refused_at_once(capsys, no_model_loads, unreachable_hub):
    start = time.perf_counter()
    err = refused(["generate", "--target", "someone/no-such-model"], capsys)
    assert time.perf_counter() - start < 5
    assert "not in the local Hugging Face cache, and the Hub is offline" in err and "127.0.0.1:9" in err


def test_hf_hub_offline_is_honoured_without_a_connection(monkeypatch, unreachable_hub):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_dflash.hub.socket, "create_connection", lambda *a, **k: pytest.fail("probed the Hub"))
    assert hf_dflash.hub.use_offline_hub_when_unreachable() == "HF_HUB_OFFLINE is set"


def test_a_hub_that_does_not_answer_switches_to_offline_mode(monkeypatch, unreachable_hub):
    """A firewall that drops packets: the probe's timeout decides, and later look-ups are offline at once."""
    from huggingface_hub import constants

    def silent(address, timeout):
        assert timeout == hf_dflash.hub.HUB_CONNECT_TIMEOUT_S
        raise TimeoutError("timed out")

    monkeypatch.setattr(hf_dflash.hub.socket, "create_connection", silent)
    assert hf_dflash.hub.use_offline_hub_when_unreachable() == "127.0.0.1:9 cannot be reached: timed out"
    assert constants.is_offline_mode()


@pytest.mark.parametrize("proxy", ["http://proxy.example:3128", "proxy.example:3128"])
def test_the_probe_goes_to_the_proxy_written_with_or_without_a_scheme(monkeypatch, unreachable_hub, proxy):
    """Behind a proxy the Hub is reached through it: the probe connects to the proxy, not to the Hub's own host."""
    probed = []
    monkeypatch.setenv("http_proxy", proxy)
    monkeypatch.setattr(hf_dflash.hub.socket, "create_connection", lambda address, timeout: probed.append(address)
                        or socket.socket())
    assert hf_dflash.hub.use_offline_hub_when_unreachable() is None
    assert probed == [("proxy.example", 3128)]


def test_info_on_a_published_drafter_answers_at_once_offline(capsys, unreachable_hub):
    start = time.perf_counter()
    assert main(["info", PUBLISHED]) == 0
    assert time.perf_counter() - start < 5, "the Hub look-up retried instead of answering from hub_configs/"
    out = capsys.readouterr().out
    assert "target      Qwen/Qwen3-8B" in out and "block       16, mask token 151669" in out
    assert f"https://huggingface.co/{PUBLISHED}/blob/main/config.json" in out and "find_string" not in out


def test_info_prints_the_target_recorded_in_training_args(small_drafter, tmp_path, capsys):
    folder = tmp_path / "drafter"
    folder.mkdir()
    config = json.loads((small_drafter / "config.json").read_text())
    config.pop("target_model", None)
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["info", str(folder)]) == 0
    assert "target      not recorded" in capsys.readouterr().out
    (folder / "training_args.json").write_text(json.dumps({"target": "org/target-model"}))
    assert main(["info", str(folder)]) == 0
    assert "target      org/target-model (recorded in training_args.json)" in capsys.readouterr().out


def test_failure_after_loading_is_one_line(small_drafter, tmp_path, capsys, monkeypatch):
    """Weights that cannot be read show up only once the drafter loads, after the target: still one line, exit 1."""
    monkeypatch.delenv("HF_DFLASH_DEBUG", raising=False)
    broken = tmp_path / "drafter"
    broken.mkdir()
    (broken / "config.json").write_text((small_drafter / "config.json").read_text())
    (broken / "model.safetensors").write_bytes((small_drafter / "model.safetensors").read_bytes()[:100])
    code = main(["generate", "--target", "stories260k", "--drafter", str(broken), "--max-new-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("hf-dflash generate: error: ") and "HF_DFLASH_DEBUG=1" in err[-1]
    assert not any("Traceback" in line for line in err)


def test_generate_streams_on_a_cpu_and_keeps_its_comparison(tmp_path, capsys):
    from hf_dflash.bundled_models import load_stories260k

    target, _ = load_stories260k()
    torch.manual_seed(0)
    config = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=0)
    DFlashDraftModel(config).save_pretrained(tmp_path / "drafter")
    assert main(["generate", "--target", "stories260k", "--drafter", str(tmp_path / "drafter"),
                 "--prompt", "Once upon a time", "--max-new-tokens", "12"]) == 0
    captured = capsys.readouterr()
    assert "loading the target stories260k" in captured.err and "warming up" in captured.err
    assert "DFlash decodes on the engine's step (eager on a CPU)" in captured.err
    assert "streams as it is committed" in captured.err
    assert "[identical to plain greedy generate: True]" in captured.out
    assert "DFlash on the engine's step" in captured.out and "timings exclude" in captured.out
    # the streamed text is the decoded DFlash output: the words between the prompt line and the verdict
    streamed = captured.out.split("Once upon a time\n", 1)[1].split("[identical", 1)[0]
    assert streamed.strip(), "no text was streamed"


def test_generate_computes_with_the_threads_asked(tmp_path, capsys, monkeypatch):
    from hf_dflash.bundled_models import load_stories260k

    target, _ = load_stories260k()
    config = DFlashConfig.for_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=0)
    DFlashDraftModel(config).save_pretrained(tmp_path / "drafter")
    threads = torch.get_num_threads()
    seen = []
    # the decoding itself runs with the threads asked for, not only the summary line
    monkeypatch.setattr(hf_dflash.generate_cli, "encode", lambda *args, _encode=hf_dflash.generate_cli.encode: (
        seen.append(torch.get_num_threads()), _encode(*args))[1])
    try:
        assert main(["generate", "--target", "stories260k", "--drafter", str(tmp_path / "drafter"),
                     "--prompt", "Once upon a time", "--max-new-tokens", "4", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert seen and set(seen) == {1}
    assert "| cpu float32, 1 thread | DFlash on the engine's step" in out


def test_warm_up_names_the_path_and_why_the_fast_path_is_not_taken(monkeypatch):
    """The warm-up asks for the engine's step and reports the blocker when there is one. The step also runs on a CPU
    (without a CUDA graph), so the GPU's branches are exercised here with the device name alone."""
    target = tiny_target("llama")
    drafter = tiny_drafter(target)
    prompt = {"input_ids": random_prompt(5), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    monkeypatch.setattr(hf_dflash.generate_cli, "encode", lambda tokenizer, text, device: prompt)
    warm_up = hf_dflash.generate_cli.warm_up
    assert warm_up(target, drafter, None, "cuda", {}) == "CUDA-graph fast path"
    assert warm_up(target, drafter, None, "cuda", {"dflash_verify_rows": 2}) == (
        "CUDA-graph fast path, each step in recorded parts (its width chosen on the host between them)"
    )
    assert warm_up(target, drafter, None, "cpu", {}) == "engine's step (eager on a CPU)"
    monkeypatch.setattr(dflash_decoding, "fast_path_blocker", lambda *args: "a reason the engine cannot serve it")
    assert warm_up(target, drafter, None, "cpu", {}) == (
        "engine's step over transformers' cache: a reason the engine cannot serve it"
    )


def test_a_bfloat16_difference_is_reported_and_a_float32_one_stops_the_job():
    """bf16 rounds the block verify and the 1-token steps differently, so `generate` (bf16 by default on a GPU) may
    part from plain greedy without a bug: it says so and carries on. In float32 a difference is a bug."""
    verdict = hf_dflash.generate_cli.identity_verdict
    same, other = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 2, 4]])
    assert verdict(same, same.clone(), torch.bfloat16) == "[identical to plain greedy generate: True]"
    line = verdict(same, other, torch.bfloat16)
    assert line.startswith("[identical to plain greedy generate: False") and "--dtype float32" in line
    with pytest.raises(SystemExit, match="please report this as a bug"):
        verdict(same, other, torch.float32)


def test_eval_fails_on_a_float32_difference_only(small_drafter, tmp_path, monkeypatch, capsys):
    """eval's exit status says whether DFlash gave plain greedy's tokens where it must: in float32. On a GPU eval runs
    bfloat16, where README measures outputs parting at near ties without a bug."""
    import hf_dflash.training.cli as training_cli
    from hf_dflash.training.evaluate import TauReport

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    monkeypatch.setattr(training_cli, "measure_tau", lambda *args: TauReport(2.0, [2.0], 3, matches_greedy=False))
    argv = ["eval", "--target", "stories260k", "--drafter", str(small_drafter), "--prompts", str(prompts)]
    for dtype, code in ((torch.float32, 1), (torch.bfloat16, 0)):
        monkeypatch.setattr(training_cli, "load_target", lambda spec, device, dtype=dtype: (
            tiny_target("llama").to(dtype), None))
        assert main(argv) == code
        assert '"matches_greedy": false' in capsys.readouterr().out


def test_generate_and_bench_encode_a_chat_prompt_as_train_and_eval_do():
    """A chat template that writes the BOS itself (Llama 3's does) gets no second one from the tokenizer: generate and
    bench encode prompts as train and eval do (`encode_prompt`)."""
    from hf_dflash.bundled_models import load_stories260k
    from hf_dflash.training.data import encode_prompt

    _, tokenizer = load_stories260k()
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    ids = hf_dflash.generate_cli.encode(tokenizer, "Once upon a time", "cpu")["input_ids"][0].tolist()
    assert ids == encode_prompt(tokenizer, "Once upon a time") and ids.count(tokenizer.bos_token_id) == 1


def test_info_counts_sharded_weights_in_the_hub_cache(unreachable_hub, tmp_path):
    """A drafter saved in shards is cached once its index and every shard it lists are; one shard missing is not."""
    from hf_dflash.hub_cli import _weights_cached
    from tests.test_hub import _populate_cache

    index = json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    files = {"model.safetensors.index.json": index.encode(), "model-00001-of-00002.safetensors": b"x"}
    _populate_cache(tmp_path / "hub", "org/sharded", files)
    assert not _weights_cached("org/sharded")
    _populate_cache(tmp_path / "hub", "org/sharded-all", {**files, "model-00002-of-00002.safetensors": b"y"})
    assert _weights_cached("org/sharded-all")
    _populate_cache(tmp_path / "hub", "org/single", {"model.safetensors": b"z"})
    assert _weights_cached("org/single") and not _weights_cached("org/absent")
