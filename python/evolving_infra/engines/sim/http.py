"""The simulated engine's HTTP data API: SGLang 0.5.23's shapes, served by aiohttp.

- `POST /generate`: `text` or `input_ids`, `sampling_params` (`max_new_tokens`, default 128 as
  in SGLang; the other sampling fields are accepted and ignored), `stream`, `rid`, and the PD
  fields `bootstrap_host`, `bootstrap_port`, `bootstrap_room`. `text` is tokenized as its UTF-8
  bytes. The reply is `{"text", "output_ids", "meta_info": {"id", "finish_reason",
  "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency", ...}}`; streamed, SGLang's
  default (non-incremental) form: `data: {...}\\n\\n` with the text and ids so far, then
  `data: [DONE]\\n\\n` (`entrypoints/http_server.py`, `managers/tokenizer_manager.py`).
  `e2e_latency` is in simulated seconds.
- `POST /v1/chat/completions`: the OpenAI shape, streamed as `chat.completion.chunk`s. Messages
  are rendered in a fixed simple format (`<|role|>\\ncontent<|end|>\\n`..., then
  `<|assistant|>\\n`) and tokenized as bytes, like the router's fallback tokenizer.
- `GET /health` (200 while serving, else 503), `GET /server_info` (and the deprecated
  `/get_server_info`), `GET /v1/models`.
- `GET /_sim/kv/{room}?timeout=S`, `GET /_sim/kv/{room}/blocks?timeout=S` (with a pool: the
  blocks offered there) and `POST /_sim/kv/{room}/release`: the simulated KV bootstrap between
  a prefill and a decode engine (see `core.py`); the prefill engine's bootstrap port is its
  HTTP port.
- `POST /_sim/held` (`{"hashes": [...]}` -> `{"held": n}`): how many leading blocks of the chain
  this node holds in L1 or L2, for a peer's `TransferKV` from this node's L2 that the pool's
  copy lags (`service.py`).
Errors are `{"error": {"message"}}` with status 400 (bad input), 503 (overloaded or draining:
retry elsewhere), 502/504 (the KV pull failed); a handler's bug is a 500, never a dead server.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import structlog
from aiohttp import web

from evolving_infra.engines.sim.requests import (
    BadRequestError,
    Bootstrap,
    GenerateError,
    GenerateSpec,
    LiveRequest,
    token_text,
)
from evolving_infra.engines.sim.service import SimEngine
from evolving_infra.types import token_ids_valid

log = structlog.get_logger("evolving_infra.engines.sim")
ENGINE = web.AppKey("engine", SimEngine)
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's `SamplingParams.max_new_tokens` default
MAX_BODY_BYTES = 64 * 2**20  # long prompts as input_ids: ~8 bytes of JSON per token
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except GenerateError as e:
        return error_response(e.status, e.message)
    except web.HTTPException:
        raise
    except Exception as e:  # a bug: answer it, log it, keep serving
        log.exception("http_handler_failed", path=request.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}")


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except ValueError as e:  # orjson.JSONDecodeError, invalid UTF-8 included
        raise BadRequestError(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequestError("the body must be a JSON object")
    return body


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequestError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _bootstrap(body: dict[str, Any]) -> Bootstrap | None:
    host, port, room = (body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
    if host is None and room is None:
        return None
    if not isinstance(host, str) or not host or port is None or room is None:
        raise BadRequestError("PD needs bootstrap_host, bootstrap_port and bootstrap_room")
    return Bootstrap(host, _int(port, "bootstrap_port", 1, 65535), _int(room, "room", 0, 2**63 - 1))


def _max_new_tokens(params: Any, key: str = "max_new_tokens") -> int:
    if params is None:
        return DEFAULT_MAX_NEW_TOKENS
    if not isinstance(params, dict):
        raise BadRequestError("sampling_params must be an object")
    value = params.get(key)
    return DEFAULT_MAX_NEW_TOKENS if value is None else _int(value, key, 0, 2**31 - 1)


def _rid(body: dict[str, Any]) -> str:
    rid = body.get("rid")
    if rid is None:
        return uuid.uuid4().hex
    if not isinstance(rid, str) or not rid:
        raise BadRequestError("rid must be a non-empty string (batches are not supported)")
    return rid


def _input_ids(body: dict[str, Any]) -> list[int]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequestError("give exactly one of text and input_ids")
    if text is not None:
        if not isinstance(text, str):
            raise BadRequestError("text must be a string (batches are not supported)")
        return list(text.encode("utf-8"))
    if not isinstance(ids, list) or not token_ids_valid(ids):
        raise BadRequestError("input_ids must be a list of token ids (unsigned 32-bit)")
    return ids


def _meta(live: LiveRequest, engine: SimEngine, done: bool) -> dict[str, Any]:
    n = len(live.output_ids)
    meta: dict[str, Any] = {
        "id": live.rid,
        "finish_reason": {"type": "length", "length": n} if done else None,
        "prompt_tokens": live.prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": n,
        "cached_tokens": live.cached_tokens,
    }
    if done:
        meta["e2e_latency"] = live.finished_at - live.arrival
    return meta


def _generate_out(live: LiveRequest, engine: SimEngine, n: int, done: bool) -> dict[str, Any]:
    ids = live.output_ids[:n]
    return {"text": token_text(ids), "output_ids": ids, "meta_info": _meta(live, engine, done)}


async def _sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    return response


async def _send(response: web.StreamResponse, payload: Any) -> None:
    # orjson: a cumulative chunk carries every output id so far (SGLang's default stream), and
    # json.dumps of them was a fifth of a decode engine's CPU.
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    await response.write(b"data: " + data + b"\n\n")


async def _stream(
    request: web.Request, live: LiveRequest, chunk: Callable[[int, bool], list[Any]]
) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    try:
        # Inside the try: a client may leave before the headers are even sent.
        response = await _sse(request)
        try:
            async for n, done in live.updates():
                for payload in chunk(n, done):
                    await _send(response, payload)
        except GenerateError as e:
            # After the headers: the error travels as an event, as SGLang does.
            await _send(response, {"error": {"message": e.message, "code": e.status}})
        await _send(response, "[DONE]")
        await response.write_eof()
    except (ConnectionResetError, ConnectionError):
        # The client went away; the engine still finishes the request (see docs).
        log.info("client_gone", rid=live.rid)
    # Nothing reaches a client that left before the headers; aiohttp wants a response all the same.
    return response if response is not None else web.Response(status=499)


def _accept(request: web.Request, spec: GenerateSpec) -> LiveRequest:
    return request.app[ENGINE].accept(spec)


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _body(request)
    spec = GenerateSpec(
        _rid(body), _input_ids(body), _max_new_tokens(body.get("sampling_params")), _bootstrap(body)
    )
    live = _accept(request, spec)
    if body.get("stream"):
        return await _stream(request, live, lambda n, d: [_generate_out(live, engine, n, d)])
    await live.wait()
    return web.json_response(_generate_out(live, engine, len(live.output_ids), True))


def _render_chat(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequestError("each message needs a role")
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise BadRequestError("message content must be a string or a list of parts")
        out.append(f"<|{m['role']}|>\n{content}<|end|>\n")
    return "".join(out) + "<|assistant|>\n"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _body(request)
    ids = list(_render_chat(body.get("messages")).encode("utf-8"))
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    n_max = DEFAULT_MAX_NEW_TOKENS if limit is None else _int(limit, "max_tokens", 0, 2**31 - 1)
    live = _accept(request, GenerateSpec(_rid(body), ids, n_max, _bootstrap(body)))
    model = body.get("model") or engine.settings.deployment.model.name
    created, cid = int(time.time()), f"chatcmpl-{live.rid}"

    def usage() -> dict[str, Any]:
        n = len(live.output_ids)
        return {
            "prompt_tokens": live.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": live.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": live.cached_tokens},
        }

    if not body.get("stream"):
        await live.wait()
        message = {"role": "assistant", "content": token_text(live.output_ids)}
        return web.json_response({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "length"}],
            "usage": usage(),
        })  # fmt: skip
    opts = body.get("stream_options")
    include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
    sent = [-1]  # tokens sent so far; -1: not even the role yet

    def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {
            "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }  # fmt: skip

    def chunks(n: int, done: bool) -> list[Any]:
        out: list[Any] = []
        if sent[0] < 0:
            out.append(chunk({"role": "assistant", "content": ""}, None))
            sent[0] = 0
        if n > sent[0]:
            out.append(chunk({"content": token_text(live.output_ids[sent[0] : n])}, None))
            sent[0] = n
        if done:
            out.append(chunk({}, "length"))
            if include_usage:
                out.append({**chunk({}, None), "choices": [], "usage": usage()})
        return out

    return await _stream(request, live, chunks)


async def health(request: web.Request) -> web.Response:
    h = await request.app[ENGINE].health()
    body = {"state": h.state, "phase": h.phase, "reason": h.reason}
    return web.json_response(body, status=200 if h.state == "serving" else 503)


async def server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    s, info = engine.settings, await engine.get_info()
    d = s.deployment
    body: dict[str, Any] = {
        "model_path": d.model.name,
        "served_model_name": d.model.name,
        "backend": "sim",
        "node_id": s.node_id,
        "disaggregation_mode": engine.phase,
        "disaggregation_bootstrap_port": request.url.port,
        "page_size": s.page_size,
        "tp_size": d.tp,
        "gpu": d.gpu.name,
        "chunked_prefill_size": s.chunk_tokens,
        "max_total_num_tokens": info.l1_capacity_blocks * s.page_size,
        "time_scale": s.time_scale,
        "kv_events_endpoint": s.kv_events_endpoint,
        "kv_replay_endpoint": s.kv_replay_endpoint,
        "samples_endpoint": s.samples_endpoint,
        "internal_states": [engine.state()],
        "pool": None if engine.pool is None else engine.pool.info(),
        "version": info.version,
    }
    return web.json_response(body)


async def models(request: web.Request) -> web.Response:
    name = request.app[ENGINE].settings.deployment.model.name
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "evolving-infra"}]
    return web.json_response({"object": "list", "data": data})


def _room(request: web.Request) -> int:
    try:
        return int(request.match_info["room"])
    except ValueError:
        raise BadRequestError("the room must be an integer") from None


def _poll_timeout(request: web.Request) -> float:
    """A long poll's `timeout` query parameter, seconds (default 60)."""
    try:
        timeout = float(request.query.get("timeout", "60"))
    except ValueError:
        raise BadRequestError("timeout must be a number of seconds") from None
    if not 0 < timeout <= 3600:
        raise BadRequestError("timeout must be in (0, 3600] seconds")
    return timeout


async def kv_poll(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.json_response(await engine.wait_prefilled(_room(request), _poll_timeout(request)))


async def kv_blocks(request: web.Request) -> web.Response:
    blocks = await request.app[ENGINE].wait_offered(_room(request), _poll_timeout(request))
    return web.json_response({"pool_blocks": blocks})


async def held(request: web.Request) -> web.Response:
    body = await _body(request)
    hashes = body.get("hashes")
    if not isinstance(hashes, list) or not all(type(h) is int for h in hashes):
        raise BadRequestError("hashes must be a list of block hashes (ints)")
    try:
        n = request.app[ENGINE].held_blocks(hashes)
    except (ValueError, OverflowError) as e:  # a hash outside the signed 64-bit range
        raise BadRequestError(f"hashes: {e}") from None
    return web.json_response({"held": n})


async def kv_release(request: web.Request) -> web.Response:
    released = request.app[ENGINE].release_room(_room(request))
    return web.json_response({"released": released}, status=200 if released else 404)


def build_app(engine: SimEngine) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app[ENGINE] = engine
    app.router.add_route("POST", "/generate", generate)
    app.router.add_route("PUT", "/generate", generate)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/_sim/kv/{room}", kv_poll)
    app.router.add_get("/_sim/kv/{room}/blocks", kv_blocks)
    app.router.add_post("/_sim/kv/{room}/release", kv_release)
    app.router.add_post("/_sim/held", held)
    return app
