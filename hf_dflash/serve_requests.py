"""The request checks `hf-dflash serve` puts in front of transformers serve's generation endpoints.

transformers serve already answers some bad requests with a 4xx JSON error (a body that is not JSON, an unknown
field, an empty conversation, and from 5.25 a prompt longer than the model's context), and others with a 500 or not
at all: a `messages` that is not a list of objects, a `max_tokens` of 0 or below (an empty answer, or at 5.17 a
crashed server), one larger than any request can hold (a request that never ends), a `temperature` that is not a
number (a 500 at 5.17, a bare Python message at 5.25). These checks add only what is missing: each refusal is a 400
whose JSON body names the field and what it takes, in transformers serve's own error shape (`{"detail": ...}`), and
the request never reaches the model.

Others ask for what continuous batching never applies, and transformers serve drops them without a word (or with a
line in the server's log only): a `stop` text, a `frequency_penalty` (which plain `generate` would apply as a
repetition penalty), `logit_bias`, `n` answers, log-probabilities, and `generation_config` settings other than the
token limit, eos and sampling. Each is refused the same way, naming the field (`UNAPPLIED_FIELDS`), so that no
client takes an answer for what it did not ask.

The checks read the request's JSON only (no tokenizing): the prompt's length is checked after its chat template, by
transformers serve (from 5.25) and by the manager, which refuses a request whose prompt and answer it can never
hold (`serve.refuse_what_never_fits`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

# A generation request's body is JSON text: one larger than this is refused before it is read whole (a 413).
MAX_BODY_BYTES = 32 * 1024 * 1024
# Endpoint -> (the field that holds its prompt, the fields that cap its answer)
CHECKED_ENDPOINTS = {
    "/v1/chat/completions": ("messages", ("max_tokens", "max_completion_tokens")),
    "/v1/completions": ("prompt", ("max_tokens",)),
    "/v1/responses": ("input", ("max_output_tokens",)),
}


@dataclass(frozen=True)
class RequestLimits:
    """What a served request may ask for.

    max_request_tokens: the most tokens one request can hold, prompt and answer (the target's context or
        `--max-model-len`, and the drafter's own context, whichever is smaller); None: no limit known.
    limited_by: what sets that limit, for the refusal's message.
    """

    max_request_tokens: int | None = None
    limited_by: str = ""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_whole_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _answer_cap_problem(name: str, value: Any, limits: RequestLimits) -> str | None:
    if not _is_whole_number(value):
        return f"`{name}` must be a whole number of tokens, got {json.dumps(value)}"
    if value < 1:
        return f"`{name}` must be at least 1, got {value}"
    cap = limits.max_request_tokens
    if cap is not None and value >= cap:
        return (
            f"`{name}` {value} is more than this server can hold: a request has at most {cap} tokens, prompt and "
            f"answer ({limits.limited_by}); ask for at most {cap - 1}"
        )
    return None


def _messages_problem(messages: Any) -> str | None:
    if not isinstance(messages, list):
        return f"`messages` must be a list of messages, got {type(messages).__name__}"
    if not messages:
        return "`messages` is empty; send at least one message"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"`messages[{index}]` must be an object with `role` and `content`, got {json.dumps(message)}"
        if not isinstance(message.get("role"), str):
            return f"`messages[{index}].role` must be a string such as \"user\""
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            return f"`messages[{index}].content` must be a string or a list of parts, got {type(content).__name__}"
    return None


def _sampling_problem(body: dict) -> str | None:
    temperature, top_p, seed = body.get("temperature"), body.get("top_p"), body.get("seed")
    if temperature is not None and not (_is_number(temperature) and temperature >= 0):
        return f"`temperature` must be a number from 0 (greedy), got {json.dumps(temperature)}"
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        return f"`top_p` must be a number in (0, 1], got {json.dumps(top_p)}"
    if seed is not None and not _is_whole_number(seed):
        return f"`seed` must be a whole number, got {json.dumps(seed)}"
    return None


# What transformers serve passes a continuous-batching request on with (to its manager or ours; hf-dflash serve
# always runs one): its token limit, its eos and its sampling settings. These OpenAI fields, which plain `generate`
# would honour or the answer would reflect, the manager never sees; each is refused unless it asks for nothing (its
# value -> whether it does). `generation_config` (a JSON object of generation settings) is checked key by key
# against APPLIED_SETTINGS.
UNAPPLIED_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "stop": (lambda value: value is None or value == [] or value == "", "cut the answer at the stop text yourself"),
    "frequency_penalty": (lambda value: value is None or value == 0, "leave it out"),
    "presence_penalty": (lambda value: value is None or value == 0, "leave it out"),
    "logit_bias": (lambda value: value is None or value == {}, "leave it out"),
    "n": (lambda value: value is None or value == 1, "send the request n times"),
    "best_of": (lambda value: value is None or value == 1, "leave it out"),
    "logprobs": (lambda value: value is None or value is False, "no log-probabilities are returned; leave it out"),
    "top_logprobs": (lambda value: value is None, "no log-probabilities are returned; leave it out"),
    "echo": (lambda value: value is None or value is False, "prepend the prompt yourself"),
}
APPLIED_SETTINGS = ("max_new_tokens", "eos_token_id", "do_sample", "temperature", "top_k", "top_p")


def _unapplied_problem(body: dict) -> str | None:
    for name, (asks_nothing, fix) in UNAPPLIED_FIELDS.items():
        if name in body and not asks_nothing(body[name]):
            return (
                f"`{name}` is not applied here: transformers serve's continuous batching, which serves every "
                f"request, passes a request on with only its token limit, eos and sampling settings; {fix}"
            )
    settings = body.get("generation_config")
    if settings is None:
        return None
    try:
        settings = json.loads(settings) if isinstance(settings, str) else None
    except json.JSONDecodeError:
        settings = None
    if not isinstance(settings, dict):
        return "`generation_config` must be a JSON object of generation settings, as a string"
    unapplied = sorted(set(settings) - set(APPLIED_SETTINGS))
    if unapplied:
        return (
            f"`generation_config` sets {', '.join(unapplied)}, which continuous batching does not apply; it applies "
            f"{', '.join(APPLIED_SETTINGS)}"
        )
    return None


def request_problem(path: str, body: Any, limits: RequestLimits) -> str | None:
    """What is wrong with a request `body` to the generation endpoint `path`, in one sentence; None if nothing."""
    if not isinstance(body, dict):
        return f"the request body must be a JSON object, got {type(body).__name__}"
    prompt_field, cap_fields = CHECKED_ENDPOINTS[path]
    if prompt_field not in body:
        return f"the request has no `{prompt_field}`"
    if prompt_field == "messages":
        problem = _messages_problem(body["messages"])
        if problem:
            return problem
    if "model" in body and body["model"] is not None and not isinstance(body["model"], str):
        return f"`model` must be a string, got {json.dumps(body['model'])}"
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        return f"`stream` must be true or false, got {json.dumps(body['stream'])}"
    for name in cap_fields:
        if body.get(name) is not None:
            problem = _answer_cap_problem(name, body[name], limits)
            if problem:
                return problem
    return _sampling_problem(body) or _unapplied_problem(body)


# ----------------------------------------------------------------------------------------------------------------
# The ASGI middleware that applies them
# ----------------------------------------------------------------------------------------------------------------

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class RequestChecks:
    """ASGI middleware: reads a generation request's body, answers a bad one with a 400, and hands a good one on
    with its body replayed. Other requests (and other methods) pass through untouched."""

    def __init__(self, app: Any, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in CHECKED_ENDPOINTS:
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":  # the client left before its request was read
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > MAX_BODY_BYTES:
                await _send_json(send, 413, {"detail": f"the request body is larger than {MAX_BODY_BYTES} bytes"})
                return
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            await _send_json(send, 400, {"detail": f"the request body is not valid JSON: {error}"})
            return
        problem = request_problem(scope["path"], body, self.limits)
        if problem is not None:
            await _send_json(send, 400, {"detail": problem})
            return

        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()  # after the body: the client's disconnect, which transformers serve watches

        await self.app(scope, replay, send)


async def _send_json(send: Send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


__all__ = ["CHECKED_ENDPOINTS", "MAX_BODY_BYTES", "RequestChecks", "RequestLimits", "request_problem"]
