"""Errors a client can act on (issue 27): a request no engine could hold is OpenAI's
`400 context_length_exceeded` before dispatch, an engine's refusal is a 400 (not a 502),
overload is a 429 with Retry-After, HTTP the server cannot parse (oversized headers, a long URL)
gets OpenAI-shaped JSON, and `/health` says degraded while an engine is down.

The front end runs over `router_helpers.EchoDispatcher`; the oversized-header checks talk raw
HTTP to a router started by `server.serve` on a loopback port.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from evolving_infra import KvDirectory
from evolving_infra.ports import LOOPBACK, free_ports
from evolving_infra.router import api
from evolving_infra.router.app import build_app
from evolving_infra.router.branches import BranchTracker
from evolving_infra.router.dispatcher import EngineRejectedError, OverloadedError
from evolving_infra.router.metrics import RouterMetrics
from evolving_infra.router.server import serve
from evolving_infra.router.tokenize import ByteTokenizer
from router_helpers import PAGE, EchoDispatcher, Router, run_router


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


async def error_body(resp: Any, status: int, code: str) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str)
    return dict(body["error"])


def test_a_request_larger_than_the_context_is_context_length_exceeded() -> None:
    dispatcher = EchoDispatcher(context_tokens=200)

    async def test(r: Router) -> None:
        # The chat template adds 31 bytes: 150 content bytes and 100 out do not fit in 200.
        resp = await r.client.post("/v1/chat/completions", json=chat("x" * 150, max_tokens=100))
        err = await error_body(resp, 400, api.CONTEXT_LENGTH_EXCEEDED)
        assert err["param"] == "messages"
        assert err["type"] == "invalid_request_error"
        assert "maximum context length is 200 tokens" in err["message"]
        assert "100 in the completion" in err["message"]
        # The prompt alone too long, with no max_tokens: the same code.
        resp = await r.client.post("/v1/completions", json={"model": "m", "prompt": "y" * 200})
        err = await error_body(resp, 400, api.CONTEXT_LENGTH_EXCEEDED)
        assert err["param"] == "prompt"
        # max_tokens no context could hold is the field's own error.
        resp = await r.client.post("/v1/chat/completions", json=chat("hi", max_tokens=100000))
        err = await error_body(resp, 400, api.INVALID_VALUE)
        assert err["param"] == "max_tokens"
        assert dispatcher.seen == []  # nothing reached dispatch, no branch left behind
        assert r.tracker.anonymous_live == 0
        # What fits goes through, to the last token: 181 + 19 = 200.
        resp = await r.client.post("/v1/chat/completions", json=chat("x" * 150, max_tokens=19))
        assert resp.status == 200, await resp.text()
        resp = await r.client.post("/v1/chat/completions", json=chat("x" * 150, max_tokens=20))
        assert (
            "requested 201 tokens (181 in the messages, 20 in the completion)"
            in (await error_body(resp, 400, api.CONTEXT_LENGTH_EXCEEDED))["message"]
        )

    run_router(test, dispatcher=dispatcher)


def test_an_engines_refusal_is_a_400_and_overload_a_429_with_retry_after() -> None:
    dispatcher = EchoDispatcher()

    async def test(r: Router) -> None:
        dispatcher.fail = EngineRejectedError(
            "engine 1 refused the request: max_new_tokens", node=1
        )
        for stream in (False, True):
            resp = await r.client.post("/v1/chat/completions", json=chat("hi", stream=stream))
            err = await error_body(resp, 400, api.ENGINE_REJECTED)
            assert "max_new_tokens" in err["message"]
        dispatcher.fail = OverloadedError("decode room in ~12.2 s", retry_after_s=12.2)
        for stream in (False, True):
            resp = await r.client.post("/v1/chat/completions", json=chat("hi", stream=stream))
            err = await error_body(resp, 429, api.OVERLOADED)
            assert err["type"] == "rate_limit_error"
            assert resp.headers["Retry-After"] == "13"
        dispatcher.fail = OverloadedError("now", retry_after_s=0.01)
        resp = await r.client.post("/v1/chat/completions", json=chat("hi"))
        assert resp.headers["Retry-After"] == "1"  # whole seconds, at least one

    run_router(test, dispatcher=dispatcher)


def test_health_is_degraded_but_serving_while_an_engine_is_down() -> None:
    dispatcher = EchoDispatcher(degraded="1 of 4 engines down: [2]")

    async def test(r: Router) -> None:
        resp = await r.client.get("/health")
        body = await resp.json()
        assert resp.status == 200  # a load balancer keeps sending
        assert body["status"] == "degraded"
        assert body["reason"] == "1 of 4 engines down: [2]"

    run_router(test, dispatcher=dispatcher)


def test_models_lists_what_the_engines_serve_when_none_is_configured() -> None:
    async def test(r: Router) -> None:
        resp = await r.client.get("/v1/models")
        assert [m["id"] for m in (await resp.json())["data"]] == ["llama-3-8b"]
        # Listing is not enforcing: any name is served, as SGLang does.
        assert (await r.client.post("/v1/chat/completions", json=chat("hi"))).status == 200

    run_router(test, listed_models=["llama-3-8b"])


def _raw(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Sends `request` as is; the status, headers and body of the answer."""
    with socket.create_connection((LOOPBACK, port), timeout=5) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def test_oversized_headers_and_urls_get_openai_shaped_errors_and_are_counted() -> None:
    async def main() -> None:
        metrics = RouterMetrics()
        tracker = BranchTracker(KvDirectory(), ttl=3600.0)
        app = build_app(EchoDispatcher(), tracker, ByteTokenizer(), metrics, page_size=PAGE)
        (port,) = free_ports(1)
        serving = await serve(app, LOOPBACK, port)
        try:
            big = "a" * 9000
            cases = [
                (f"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n", 431),
                (f"GET /v1/{big} HTTP/1.1\r\nHost: x\r\n\r\n", 431),
                ("GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400),
            ]
            for request, status in cases:
                got, headers, body = await asyncio.to_thread(_raw, port, request.encode())
                assert got == status, body
                assert headers["content-type"].startswith("application/json")
                error = json.loads(body)["error"]
                code = api.HEADERS_TOO_LARGE if status == 431 else api.BAD_HTTP
                assert error["code"] == code
                assert error["type"] == "invalid_request_error"
            # The server keeps serving, and counted each.
            ok, _, body = await asyncio.to_thread(
                _raw, port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            assert ok == 200, body
            counted = {
                (s.labels["code"], s.value)
                for f in text_string_to_metric_families(metrics.render().decode())
                for s in f.samples
                if s.name == "evolving_errors_total"
            }
            assert counted == {(api.HEADERS_TOO_LARGE, 2.0), (api.BAD_HTTP, 1.0)}
        finally:
            await serving.stop(drain_s=1.0)

    asyncio.run(main())
