"""The OpenAI-compatible wire format: requests parsed into frozen records, errors, responses.

No I/O here: `app.py` reads bodies and writes responses, this module only turns JSON values into
records (or a typed `ApiError`) and records into JSON values. Parsing is strict about the types of
the fields it knows and lenient about fields it does not know: harnesses send vendor extensions
(`tools`, `reasoning_effort`, ...) that the router forwards nowhere, and rejecting them would make
the router unusable with those harnesses. A known field of the wrong type is always a 400.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from evolving_infra.types import TOKEN_ID_LIMIT, token_ids_valid

FinishReason = Literal["stop", "length"]
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_SEQUENCES = 4  # as OpenAI


# Error codes (the `code` of an error body, the `code` label of `evolving_errors_total`).
# A fixed set, so that metric labels stay bounded.
INVALID_JSON = "invalid_json"
INVALID_CONTENT_TYPE = "invalid_content_type"
INVALID_VALUE = "invalid_value"
MISSING_FIELD = "missing_field"
UNSUPPORTED = "unsupported"
BRANCH_CONFLICT = "branch_conflict"
UNKNOWN_BRANCH = "unknown_branch"
BRANCH_EXISTS = "branch_exists"
UNKNOWN_MODEL = "model_not_found"
NOT_FOUND = "not_found"
METHOD_NOT_ALLOWED = "method_not_allowed"
TOO_LARGE = "request_too_large"
NO_ENGINE = "no_engine"
OVERLOADED = "overloaded"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code, which harnesses act on
HEADERS_TOO_LARGE = "headers_too_large"
BAD_HTTP = "bad_http"
ENGINE_REJECTED = "engine_rejected"
ENGINE_FAILED = "engine_failed"
SHUTTING_DOWN = "shutting_down"  # 503 + Retry-After: the router drains for a stop or restart
INTERNAL = "internal_error"

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "internal_error",
    502: "engine_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An error answered to the client as OpenAI error JSON, with an HTTP status.

    `type` is OpenAI's coarse class (derived from the status unless given), `code` one of this
    module's fixed codes, `param` the offending request field (dotted path) when there is one.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = error_type or _TYPES.get(status, "invalid_request_error")
        self.headers = dict(headers or {})  # sent with the error (e.g. Retry-After)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.code!r}, {self.message!r}, param={self.param!r})"


def invalid(message: str, param: str | None = None, code: str = INVALID_VALUE) -> ApiError:
    return ApiError(400, message, code=code, param=param)


def shutting_down(message: str) -> ApiError:
    """The 503 of a stopping router for a request it did not take: the client sends it again
    after `Retry-After` (to another replica, or here once the router is back)."""
    return ApiError(503, message, code=SHUTTING_DOWN, headers={"Retry-After": "1"})


# ---------------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message; `content` is the text of every text part, joined (None: no content)."""

    role: str
    content: str | None
    name: str | None = None
    # JSON text of the assistant's `tool_calls` (canonical: sorted keys), so that the prompt a
    # branch sends again hashes to the same blocks; None when the message has none.
    tool_calls: str | None = None
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int | None = None  # None: the engine's own limit
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams
    # Canonical JSON of the `tools` array (sorted keys), rendered into the prompt: an agent's
    # tool definitions are part of the context it shares with its other requests.
    tools: str | None = None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    user: str | None = None
    agent: Mapping[str, Any] | None = None  # the raw `agent` field; `branches` validates it
    # Leading messages not in `messages`: byte for byte those of the branch's last request,
    # which the router did not decode again (`bodies.decode_chat`); `messages` are the rest.
    kept: int = 0


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]  # text, or token ids (then used as they are)
    sampling: SamplingParams
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    agent: Mapping[str, Any] | None = None
    # Leading token ids not in `prompt`: byte for byte those of the branch's last request, which
    # the router did not decode again (`bodies.decode_ids`); `prompt` is the rest.
    kept: int = 0


def _type_name(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), "null" if value is None else "number"
    )


def _get_str(body: Mapping[str, Any], key: str, *, required: bool = False) -> str | None:
    value = body.get(key)
    if value is None:
        if required:
            raise invalid(f"'{key}' is required", key, MISSING_FIELD)
        return None
    if not isinstance(value, str):
        raise invalid(f"'{key}' must be a string, got {_type_name(value)}", key)
    return value


def _get_bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"'{key}' must be a boolean, got {_type_name(value)}", key)
    return value


def _get_int(body: Mapping[str, Any], key: str, *, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"'{key}' must be an integer, got {_type_name(value)}", key)
    if value < minimum:
        raise invalid(f"'{key}' must be >= {minimum}, got {value}", key)
    return value


def _get_float(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"'{key}' must be a number, got {_type_name(value)}", key)
    if not (math.isfinite(value) and low <= value <= high):
        raise invalid(f"'{key}' must be in [{low:g}, {high:g}], got {value}", key)
    return float(value)


def parse_sampling(body: Mapping[str, Any]) -> SamplingParams:
    max_tokens = _get_int(body, "max_tokens", minimum=1)
    max_completion = _get_int(body, "max_completion_tokens", minimum=1)
    # Both given and different is ambiguous: refuse rather than pick one silently.
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise invalid(
            f"'max_tokens' ({max_tokens}) and 'max_completion_tokens' ({max_completion}) differ;"
            " give one",
            "max_completion_tokens",
        )
    if body.get("logprobs") not in (None, False, 0):
        raise invalid("'logprobs' is not supported", "logprobs", UNSUPPORTED)
    n = _get_int(body, "n", minimum=1)
    if n is not None and n != 1:
        raise invalid(f"'n' must be 1 (one choice per request), got {n}", "n", UNSUPPORTED)
    stop = body.get("stop")
    stops: tuple[str, ...]
    if stop is None:
        stops = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise invalid("'stop' must be a string or an array of strings", "stop")
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        raise invalid(f"'stop' takes 1 to {MAX_STOP_SEQUENCES} non-empty strings", "stop")
    return SamplingParams(
        max_tokens=max_completion if max_completion is not None else max_tokens,
        temperature=_get_float(body, "temperature", 0.0, 2.0),
        top_p=_get_float(body, "top_p", 0.0, 1.0),
        stop=stops,
        seed=_get_int(body, "seed", minimum=-(2**63)),
    )


def _common(body: Any) -> tuple[Mapping[str, Any], str, bool, bool, Mapping[str, Any] | None]:
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {_type_name(body)}")
    model = _get_str(body, "model", required=True)
    assert model is not None
    stream = _get_bool(body, "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("'stream_options' must be an object", "stream_options")
        if not stream:
            raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
        include_usage = _get_bool(options, "include_usage")
    agent = body.get("agent")
    if agent is not None and not isinstance(agent, dict):
        raise invalid(f"'agent' must be an object, got {_type_name(agent)}", "agent")
    return body, model, stream, include_usage, agent


def _content(value: object, param: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(f"'content' must be a string or an array of parts, got {_type_name(value)}")
    texts = []
    for j, part in enumerate(value):
        where = f"{param}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid("a content part must be an object with a string 'type'", where)
        if part["type"] != "text":
            raise invalid(
                f"content parts of type {part['type']!r} are not supported (text only)",
                f"{where}.type",
                UNSUPPORTED,
            )
        if not isinstance(part.get("text"), str):
            raise invalid("a text part needs a string 'text'", f"{where}.text")
        texts.append(part["text"])
    return "".join(texts)


def _message(value: object, i: int) -> ChatMessage:
    param = f"messages[{i}]"
    if not isinstance(value, dict):
        raise invalid(f"a message must be an object, got {_type_name(value)}", param)
    role = value.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid(f"'role' must be one of {', '.join(sorted(ROLES))}", f"{param}.role")
    if "content" not in value and role != "assistant":
        raise invalid("'content' is required", f"{param}.content", MISSING_FIELD)
    content = _content(value.get("content"), f"{param}.content")
    tool_calls = value.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise invalid("'tool_calls' must be an array", f"{param}.tool_calls")
    if content is None and role != "assistant":
        raise invalid("'content' may be null only for an assistant", f"{param}.content")
    return ChatMessage(
        role=role,
        content=content,
        name=_get_str(value, "name"),
        tool_calls=json.dumps(tool_calls, sort_keys=True) if tool_calls else None,
        tool_call_id=_get_str(value, "tool_call_id"),
    )


def parse_chat(body: Any, kept: int = 0) -> ChatRequest:
    """A `/v1/chat/completions` body (already JSON-decoded) as a record, or a 400 `ApiError`.
    `kept`: the body's `messages` leave out that many leading messages, checked already."""
    body, model, stream, include_usage, agent = _common(body)
    messages = body.get("messages")
    if messages is None:
        raise invalid("'messages' is required", "messages", MISSING_FIELD)
    if not isinstance(messages, list) or not (messages or kept):
        raise invalid("'messages' must be a non-empty array", "messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid(f"'tools' must be an array, got {_type_name(tools)}", "tools")
    return ChatRequest(
        model=model,
        messages=tuple(_message(m, i) for i, m in enumerate(messages, kept)),
        sampling=parse_sampling(body),
        tools=json.dumps(tools, sort_keys=True) if tools else None,
        stream=stream,
        include_usage=include_usage,
        user=_get_str(body, "user"),
        agent=agent,
        kept=kept,
    )


def _token_ids(value: Sequence[object]) -> tuple[int, ...]:
    # The loop below runs only to name the bad id (`token_ids_valid` checks in C first).
    if token_ids_valid(value):
        return tuple(value)  # type: ignore[arg-type]  # checked just above
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < TOKEN_ID_LIMIT:
            raise invalid(f"token ids must be integers in [0, 2^32), got {t!r}", "prompt")
    return tuple(value)  # type: ignore[arg-type]  # checked just above


def parse_completion(body: Any, kept: int = 0) -> CompletionRequest:
    """A `/v1/completions` body as a record. One prompt per request: a string, an array of one
    string, or an array of token ids (an array of several prompts is a batch: unsupported).
    `kept`: the body's `prompt` is token ids that leave out that many leading ids, checked
    already."""
    body, model, stream, include_usage, agent = _common(body)
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("'prompt' is required", "prompt", MISSING_FIELD)
    raw = body["prompt"]
    prompt: str | tuple[int, ...]
    if kept and isinstance(raw, list):  # the rest of an array of ids
        prompt = _token_ids(raw)
    elif isinstance(raw, str):
        prompt = raw
    elif isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        prompt = raw[0]
    elif isinstance(raw, list) and raw and all(isinstance(p, str | list) for p in raw):
        raise invalid("one prompt per request (batched prompts are not supported)", "prompt")
    elif isinstance(raw, list) and raw:
        prompt = _token_ids(raw)
    else:
        raise invalid("'prompt' must be a string or a non-empty array of token ids", "prompt")
    for unsupported in ("suffix", "best_of"):
        if body.get(unsupported) not in (None, 1):
            raise invalid(f"'{unsupported}' is not supported", unsupported, UNSUPPORTED)
    if body.get("echo"):
        raise invalid("'echo' is not supported", "echo", UNSUPPORTED)
    return CompletionRequest(
        model=model,
        prompt=prompt,
        sampling=parse_sampling(body),
        stream=stream,
        include_usage=include_usage,
        user=_get_str(body, "user"),
        agent=agent,
        kept=kept,
    )


# ---------------------------------------------------------------------------------------------
# Responses


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None  # prompt tokens served from KV cache, when the engine says

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return out


def chat_response(
    response_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: FinishReason,
    usage: Usage,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage.to_json(),
    }


def completion_response(
    response_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: FinishReason,
    usage: Usage,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage.to_json(),
    }


@dataclass(frozen=True, slots=True)
class ChunkBuilder:
    """Streamed chunks of one response, in OpenAI's format.

    With `include_usage`, every chunk carries `"usage": null` and `usage_chunk` makes the extra
    last chunk (empty `choices`, the usage), as OpenAI does.
    """

    id: str
    model: str
    created: int
    chat: bool
    include_usage: bool

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def role(self) -> dict[str, Any]:
        """The first chat chunk: the assistant role, no text yet."""
        delta = {"role": "assistant", "content": ""}
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])

    def text(self, text: str) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        return self._chunk([{**choice, "finish_reason": None}])

    def finish(self, reason: FinishReason) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None}
        else:
            choice = {"index": 0, "text": "", "logprobs": None}
        return self._chunk([{**choice, "finish_reason": reason}])

    def usage(self, usage: Usage) -> dict[str, Any]:
        out = self._chunk([])
        out["usage"] = usage.to_json()
        return out


def sse(data: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying `data` as compact JSON."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def models_response(models: Sequence[str], created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": m, "object": "model", "created": created, "owned_by": "evolving-infra"}
            for m in models
        ],
    }
