"""`hf-dflash serve` without a server: what it refuses before anything loads (one line, exit status 2), the options
it passes to transformers serve, the request checks it adds, and the drafter's attachment to a target's
continuous batching. The server itself is tested in test_serve.py."""

from __future__ import annotations

import asyncio
import inspect
import json

import pytest
import torch
from transformers.cli import serve as transformers_serve
from transformers.cli.serving import model_manager, server

import hf_dflash.serve
import uvicorn
from hf_dflash import DFlashDraftModel, serve_transformers
from hf_dflash.cli import build_parser, main
from hf_dflash.serve import ServedTarget, attach_drafter, drafter_in_transformers_serve, served_state
from hf_dflash.serve_cli import transformers_options
from hf_dflash.serve_requests import MAX_BODY_BYTES, RequestChecks, RequestLimits, request_problem
from tests.conftest import tiny_target
from tests.serve_helpers import ENGINE_TAKES_DRAFTER, WAITING_FOR_ENGINE, save_served_model


@pytest.fixture(scope="module")
def served_model(tmp_path_factory):
    return save_served_model(tmp_path_factory.mktemp("served"))


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_drafter_for_another_target_is_refused_before_anything_loads(served_model, capsys, monkeypatch):
    target, _ = served_model

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the drafter was checked")

    monkeypatch.setattr(hf_dflash.serve, "run_serve", no_weights)
    monkeypatch.setattr(DFlashDraftModel, "from_pretrained", no_weights)
    # No --drafter: the shipped drafter, trained for SmolLM2 (width 576, vocabulary 49152), not for stories260K.
    err = refused(["serve", str(target)], capsys)
    assert "does not fit the target" in err and "target hidden states of width 576" in err
    assert "Pass --drafter with a drafter trained for this target" in err


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--no-continuous-batching"], "the drafter speculates inside continuous batching"),
        (["--graceful-shutdown-seconds", "0"], "--graceful-shutdown-seconds must be greater than 0"),
        (["--port", "many"], "invalid int value: 'many'"),
    ],
)
def test_bad_options_are_refused(served_model, capsys, extra, expected):
    target, drafter = served_model
    assert expected in refused(["serve", str(target), "--drafter", str(drafter), *extra], capsys)


def test_remote_code_runs_only_with_trust_remote_code(tmp_path, capsys):
    """A target whose config is custom code: refused without --trust-remote-code, and its code never ran."""
    ran = tmp_path / "custom code ran"
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "hf-dflash-custom", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}
    ))
    (tmp_path / "configuration_custom.py").write_text(
        f"open({str(ran)!r}, 'w').close()\nfrom transformers import PretrainedConfig\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'hf-dflash-custom'\n"
    )
    err = refused(["serve", str(tmp_path)], capsys)
    assert "runs only with --trust-remote-code" in err
    assert not ran.exists()


def test_defaults_bind_localhost_with_continuous_batching_and_pass_every_option_on():
    args = build_parser().parse_args(["serve"])
    options = transformers_options(args)
    assert args.target == "smollm2"
    assert options["host"] == "127.0.0.1" and options["continuous_batching"] is True
    assert options["trust_remote_code"] is False
    # Every parameter of the installed transformers' Serve is an option, with transformers serve's own default.
    parameters = inspect.signature(transformers_serve.Serve.__init__).parameters
    defaults = {name: p.default for name, p in parameters.items() if name not in ("self", "force_model")}
    assert set(options) == set(defaults)
    ours = {"host", "continuous_batching"}
    assert {name: options[name] for name in defaults if name not in ours} == {
        name: default for name, default in defaults.items() if name not in ours
    }
    args = build_parser().parse_args(["serve", "--port", "8123", "--host", "0.0.0.0", "--cb-num-blocks", "64",
                                      "--trust-remote-code", "--reasoning", "off", "some/model"])
    options = transformers_options(args)
    assert (options["port"], options["host"], options["cb_num_blocks"]) == (8123, "0.0.0.0", 64)
    assert options["trust_remote_code"] is True and options["reasoning"] == transformers_serve.ReasoningMode.OFF
    assert args.target == "some/model"


# --------------------------------------------------------------------------------------------------
# The request checks
# --------------------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Once upon a time"}]
LIMITS = RequestLimits(1024, "the drafter's context")


@pytest.mark.parametrize(
    "path, body, expected",
    [
        (CHAT, [1, 2], "must be a JSON object"),
        (CHAT, {"model": "m"}, "has no `messages`"),
        (CHAT, {"messages": "hello"}, "`messages` must be a list of messages, got str"),
        (CHAT, {"messages": []}, "`messages` is empty"),
        (CHAT, {"messages": ["hi"]}, "`messages[0]` must be an object"),
        (CHAT, {"messages": [{"content": "hi"}]}, "`messages[0].role` must be a string"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "`messages[0].content` must be a string or a list"),
        (CHAT, {"messages": MESSAGES, "max_tokens": 0}, "`max_tokens` must be at least 1, got 0"),
        (CHAT, {"messages": MESSAGES, "max_tokens": "many"}, "`max_tokens` must be a whole number"),
        (CHAT, {"messages": MESSAGES, "max_tokens": 2.5}, "`max_tokens` must be a whole number"),
        (CHAT, {"messages": MESSAGES, "max_completion_tokens": 1024}, "a request has at most 1024 tokens"),
        (CHAT, {"messages": MESSAGES, "temperature": "hot"}, "`temperature` must be a number"),
        (CHAT, {"messages": MESSAGES, "temperature": -1}, "`temperature` must be a number from 0"),
        (CHAT, {"messages": MESSAGES, "top_p": 0}, "`top_p` must be a number in (0, 1]"),
        (CHAT, {"messages": MESSAGES, "seed": 1.5}, "`seed` must be a whole number"),
        (CHAT, {"messages": MESSAGES, "stream": "yes"}, "`stream` must be true or false"),
        (CHAT, {"messages": MESSAGES, "model": 3}, "`model` must be a string"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, "`max_tokens` must be a whole number"),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 5000}, "`max_output_tokens` 5000 is more than"),
        # what continuous batching would drop without a word
        (CHAT, {"messages": MESSAGES, "stop": ["\n"]}, "`stop` is not applied here"),
        ("/v1/completions", {"prompt": "Hi", "stop": "."}, "`stop` is not applied here"),
        (CHAT, {"messages": MESSAGES, "frequency_penalty": 0.5}, "`frequency_penalty` is not applied"),
        (CHAT, {"messages": MESSAGES, "presence_penalty": -1}, "`presence_penalty` is not applied"),
        (CHAT, {"messages": MESSAGES, "logit_bias": {"5": 10}}, "`logit_bias` is not applied"),
        (CHAT, {"messages": MESSAGES, "n": 2}, "send the request n times"),
        (CHAT, {"messages": MESSAGES, "logprobs": True}, "no log-probabilities are returned"),
        ("/v1/completions", {"prompt": "Hi", "echo": True}, "`echo` is not applied"),
        (CHAT, {"messages": MESSAGES, "generation_config": '{"repetition_penalty": 1.3, "top_k": 5}'},
         "`generation_config` sets repetition_penalty, which continuous batching does not apply"),
        ("/v1/responses", {"input": "Hi", "generation_config": "[1]"}, "must be a JSON object"),
    ],
)
def test_request_problems_name_the_field(path, body, expected):
    assert expected in request_problem(path, body, LIMITS)


def test_good_requests_pass_the_checks():
    assert request_problem(CHAT, {"model": "m", "messages": MESSAGES, "max_tokens": 1023, "temperature": 0,
                                  "top_p": 1, "seed": 3, "stream": True}, LIMITS) is None
    tool_turn = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": []}]
    assert request_problem(CHAT, {"messages": tool_turn}, LIMITS) is None
    assert request_problem("/v1/completions", {"prompt": "Hi", "max_tokens": 5}, RequestLimits()) is None
    assert request_problem("/v1/responses", {"input": [{"role": "user", "content": "Hi"}]}, LIMITS) is None
    # the fields continuous batching does not apply pass where they ask for nothing
    asks_nothing = {"stop": None, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "n": 1,
                    "logprobs": False, "top_logprobs": None, "generation_config": '{"temperature": 0.5, "top_k": 4}'}
    assert request_problem(CHAT, {"messages": MESSAGES, **asks_nothing}, LIMITS) is None


def test_the_limit_is_the_smaller_of_the_target_and_drafter_contexts(served_model):
    target, drafter = served_model
    assert ServedTarget.for_serving(str(target), None).limits == RequestLimits(2048, "the target's context")
    assert ServedTarget.for_serving(str(target), str(drafter)).limits == RequestLimits(1024, "the drafter's context")
    limits = ServedTarget.for_serving(str(target), None, max_model_len=512).limits
    assert limits == RequestLimits(512, "--max-model-len")


# --------------------------------------------------------------------------------------------------
# The attachment
# --------------------------------------------------------------------------------------------------


def test_drafter_in_transformers_serve_replaces_three_names_and_restores_them():
    loader_name, _ = serve_transformers.REPLACED_LOADER
    before = (getattr(model_manager, loader_name), server.build_server, uvicorn.Config)
    served = ServedTarget("m")
    with pytest.raises(KeyError):
        with drafter_in_transformers_serve(served, graceful_shutdown_seconds=3):
            assert getattr(model_manager, loader_name) is serve_transformers.REPLACED_LOADER[1]
            assert server.build_server is not before[1]
            assert uvicorn.Config(app=None).timeout_graceful_shutdown == 3
            raise KeyError("a failure inside")
    assert (getattr(model_manager, loader_name), server.build_server, uvicorn.Config) == before


def test_attach_without_a_drafter_keeps_transformers_manager_and_refuses_what_never_fits():
    target = tiny_target("llama")
    attachment = attach_drafter(target, None, RequestLimits(64, "the target's context"))
    manager = target.init_continuous_batching()
    assert type(manager).__module__.startswith("transformers.")
    assert set(attachment.managers) == {manager}
    with pytest.raises(ValueError, match=r"come to 70 tokens, more than a request can hold here: 64"):
        manager.add_request([1] * 60, max_new_tokens=10)
    assert served_state(target) == {"drafter": False, "requests_running": 0, "requests_waiting": 0}


@pytest.mark.skipif(not ENGINE_TAKES_DRAFTER, reason=WAITING_FOR_ENGINE)
def test_attach_with_a_drafter_starts_the_engine_with_it(served_model):
    from transformers import AutoModelForCausalLM

    target_folder, drafter_folder = served_model
    target = AutoModelForCausalLM.from_pretrained(target_folder)
    drafter = DFlashDraftModel.from_pretrained(drafter_folder)
    attach_drafter(target, drafter)
    manager = target.init_continuous_batching()
    manager.start()
    try:
        request_id = manager.add_request([1, 403, 407, 261, 378], max_new_tokens=8, top_k=1)
        output = manager.get_result(request_id, timeout=60)
        assert output is not None and output.error is None and len(output.generated_tokens) == 8
        state = served_state(target)
        assert state["drafter"] is True and state["drafter_pages_used"] == state["target_pages_used"] == 0
    finally:
        manager.stop(block=True, timeout=30)
    with torch.no_grad():
        plain = target.generate(torch.tensor([[1, 403, 407, 261, 378]]), max_new_tokens=8, do_sample=False)
    assert output.generated_tokens == plain[0, 5:].tolist()


def asgi_exchange(middleware_limits: RequestLimits, body_chunks: list[bytes]) -> tuple[list[dict], list[dict]]:
    """Runs RequestChecks over a fake app: (what the app received, what was sent back)."""
    received_by_app: list[dict] = []
    sent: list[dict] = []
    incoming = [{"type": "http.request", "body": chunk, "more_body": i < len(body_chunks) - 1}
                for i, chunk in enumerate(body_chunks)] + [{"type": "http.disconnect"}]

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        received_by_app.append(await receive())
        received_by_app.append(await receive())  # after the body: the client's disconnect reaches the app

    scope = {"type": "http", "method": "POST", "path": CHAT}
    asyncio.run(RequestChecks(app, middleware_limits)(scope, receive, send))
    return received_by_app, sent


def test_the_checks_answer_a_bad_request_and_hand_a_good_one_on_with_its_body():
    good = json.dumps({"messages": MESSAGES, "max_tokens": 5}).encode()
    received, sent = asgi_exchange(LIMITS, [good[:10], good[10:]])
    assert sent == [] and received[0] == {"type": "http.request", "body": good, "more_body": False}
    assert received[1] == {"type": "http.disconnect"}

    received, sent = asgi_exchange(LIMITS, [json.dumps({"messages": []}).encode()])
    assert received == [] and sent[0]["status"] == 400
    assert json.loads(sent[1]["body"]) == {"detail": "`messages` is empty; send at least one message"}

    received, sent = asgi_exchange(LIMITS, [b"x" * (MAX_BODY_BYTES // 2)] * 3)
    assert received == [] and sent[0]["status"] == 413
