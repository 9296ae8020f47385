"""The router's HTTP API as the replay speaks it: streamed completions of token ids, branch ends.

A client of the router over HTTP only: the header names are the router's documented API
(`X-Agent-Branch`, `X-Agent-Parent-Branch`, `X-Agent-Event`), repeated here rather than imported,
as any harness would (tests check they agree with `router.branches`).

`send` posts one `/v1/completions` request with `stream: true` and `include_usage`, and reads the
SSE stream to its end. It never raises for what the router or the network does: every request
becomes an `Outcome`, failed with a reason, one of a small fixed set so that `errors` stays
readable:
- `http_<status>:<code>`: an error status before the stream (`code` from the OpenAI error body);
- `stream_error:<code>`: an error object inside a started stream (the engine failed mid-way);
- `broken_stream`: the stream ended without `[DONE]`, or a chunk was not JSON;
- `no_usage`: `[DONE]` without the usage chunk (the hit rate could not count it);
- `timeout`: no complete answer within the request timeout;
- `connection_refused`: the router could not be reached (nothing was sent: a router restarting);
- `connection`: the connection failed or was dropped after it was made.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from evolving_infra.replay.summary import CONNECTION_REFUSED, Outcome

HEADER_BRANCH = "X-Agent-Branch"
HEADER_PARENT = "X-Agent-Parent-Branch"
HEADER_EVENT = "X-Agent-Event"
UNKNOWN_BRANCH = "unknown_branch"  # the router's error code for a fork of an unknown parent

_IDS = [str(i) for i in range(256)]  # prompt ids are bytes: format them once


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a request failed, and the router's message (for the first warning of its kind)."""

    reason: str
    message: str = ""


def completion_body(model: str, prompt: Sequence[int], max_tokens: int) -> bytes:
    """The request body. Written by hand because a 200k-token prompt is most of it, and joining
    pre-formatted ids is several times faster than `json.dumps` of the list."""
    head = json.dumps(
        {
            "model": model,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    ids = ",".join(_IDS[t] if t < 256 else str(t) for t in prompt)
    return f'{head[:-1]}, "prompt": [{ids}]}}'.encode()


async def send(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    answer: list[str] | None = None,
) -> tuple[Outcome, Failure | None]:
    """Posts one completion and reads its stream; the session's timeout bounds it. The
    completion's text pieces are appended to `answer` when one is given."""
    start = time.monotonic()
    try:
        return await _send(session, url, body, headers, start, answer)
    except TimeoutError:
        failure = Failure("timeout")
    except aiohttp.ClientPayloadError as e:
        failure = Failure("broken_stream", str(e))
    except aiohttp.ClientConnectorError as e:  # before anything was sent
        failure = Failure(CONNECTION_REFUSED, str(e) or type(e).__name__)
    except aiohttp.ClientError as e:  # reset, server disconnected
        failure = Failure("connection", str(e) or type(e).__name__)
    return Outcome.failure(failure.reason, time.monotonic() - start), failure


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    start: float,
    answer: list[str] | None,
) -> tuple[Outcome, Failure | None]:
    first: float | None = None
    usage: Mapping[str, Any] | None = None
    headers = {"Content-Type": "application/json", **headers}
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status >= 400:
            code, message = _error(await resp.read())
            failure = Failure(f"http_{resp.status}:{code}", message)
            return Outcome.failure(failure.reason, time.monotonic() - start), failure
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments
            data = line[5:].strip()
            if data == b"[DONE]":
                end = time.monotonic()
                if usage is None:
                    failure = Failure("no_usage", "the stream carried no usage chunk")
                    return Outcome.failure(failure.reason, end - start), failure
                return _completed(usage, start, first, end), None
            try:
                chunk = json.loads(data)
            except ValueError:
                failure = Failure("broken_stream", f"not JSON: {data[:100]!r}")
                return Outcome.failure(failure.reason, time.monotonic() - start), failure
            if "error" in chunk:
                error = chunk["error"] if isinstance(chunk["error"], dict) else {}
                failure = Failure(f"stream_error:{error.get('code')}", str(error.get("message")))
                return Outcome.failure(failure.reason, time.monotonic() - start), failure
            choices = chunk.get("choices") or ()
            texts = [t for c in choices if isinstance(t := c.get("text"), str) and t]
            if texts:
                if first is None:
                    first = time.monotonic()
                if answer is not None:
                    answer.extend(texts)
            if chunk.get("usage"):
                usage = chunk["usage"]
    failure = Failure("broken_stream", "the stream ended without [DONE]")
    return Outcome.failure(failure.reason, time.monotonic() - start), failure


def _completed(usage: Mapping[str, Any], start: float, first: float | None, end: float) -> Outcome:
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(
        ok=True,
        # No content chunk (an empty completion): the first token is the end of the stream.
        ttft=(first if first is not None else end) - start,
        e2e=end - start,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        # An engine that does not report cached tokens counts as no hit.
        cached_tokens=int(details.get("cached_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens") or 0),
    )


def _error(raw: bytes) -> tuple[str, str]:
    """The OpenAI error body's code and message ("unknown" when the body is not one)."""
    try:
        error = json.loads(raw)["error"]
        return str(error.get("code") or "unknown"), str(error.get("message") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        return "unknown", raw[:200].decode(errors="replace")


async def end_branch(session: aiohttp.ClientSession, router: str, branch: str) -> bool:
    """`POST /v1/branches/{id}/end`; False when the router did not know it (or failed)."""
    # Branch ids hold "/" (agent/branch): quoted, the route still sees one path segment.
    url = f"{router}/v1/branches/{quote(branch, safe='')}/end"
    try:
        async with session.post(url) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


@dataclass(frozen=True, slots=True)
class RouterInfo:
    page_size: int | None  # from /health (None: not reported)
    healthy: bool
    models: tuple[str, ...]  # served names from /v1/models (empty: any name accepted)


async def probe(session: aiohttp.ClientSession, router: str) -> RouterInfo:
    """What the router says of itself before the run: page size, health, model names."""
    async with session.get(f"{router}/health") as resp:
        health = await resp.json(content_type=None)
        healthy = resp.status == 200 and health.get("status") == "ok"
    async with session.get(f"{router}/v1/models") as resp:
        listed = await resp.json(content_type=None) if resp.status == 200 else {}
    page = health.get("page_size")
    models = tuple(str(m["id"]) for m in listed.get("data") or () if "id" in m)
    return RouterInfo(page if isinstance(page, int) else None, healthy, models)
