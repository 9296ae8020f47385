"""SGLang's PD request protocol on the wire: how the router sends one request to a prefill and
a decode engine (notes `sglang-0.5.23.md` §1.2, "Request contract").

Both engines get the same `/generate` body (`pd_bodies`) with the prefill engine's
`bootstrap_host`/`bootstrap_port` and a `bootstrap_room`; the decode engine pulls the KV from
the prefill engine and streams the tokens, the prefill engine's answer only ends its part.
`PdTransport` is the seam the dispatcher sends through: `HttpTransport` speaks SGLang's HTTP
API (aiohttp), and tests hand the dispatcher their own engines. A connection that fails, or a
stream that breaks before its first token, is an `UnreachableError` (the request may be retried
elsewhere); an engine's refusal of the request itself (a 4xx) is an `EngineRejectedError` (the
client's mistake, a 400 to it); any other error answer is an `EngineFailedError`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import aiohttp.payload
import orjson
from aiohttp.abc import AbstractStreamWriter

from evolving_infra import PagedPrompt
from evolving_infra.router.dispatcher import (
    BrokenStreamError,
    EngineFailedError,
    EngineRejectedError,
    Finished,
    GenerationEvent,
    PreparedRequest,
    TextPiece,
)
from evolving_infra.router.loads import EngineHandle

_JSON = {"Content-Type": "application/json"}


class PdTransport(Protocol):
    """Sends a request's two halves (`pd_bodies`) to its engines."""

    async def prefill(self, engine: EngineHandle, body: Body) -> None:
        """Until the prefill engine has answered (its KV handed over, or an error)."""
        ...

    def decode(self, engine: EngineHandle, body: Body) -> AsyncGenerator[GenerationEvent, None]:
        """The decode engine's stream: text pieces, then `Finished`."""
        ...


class UnreachableError(Exception):
    """An engine did not answer at the connection level (the request may be retried)."""

    def __init__(self, engine: EngineHandle, reason: str, *, gone: bool = True) -> None:
        super().__init__(reason)
        self.engine = engine
        self.reason = reason
        # False: it did not answer in time (overloaded, perhaps): try elsewhere, but leave
        # judging it down to the health loop, or a busy cluster's only decode node would be
        # taken out by its own load.
        self.gone = gone


@dataclass(frozen=True, slots=True)
class Body:
    """A `/generate` body as the pieces it is sent in, one after another (`pd_bodies`): a
    100k-token prompt's ids are ~600 KB of JSON, kept as ~25 KB pieces by the branch's
    `PagedPrompt` and lent to the request's two bodies as views, so no buffer the size of the
    prompt is written per request (two were ~0.4 ms at 100k tokens, mostly page faults)."""

    pieces: tuple[bytes | memoryview, ...]

    def __bytes__(self) -> bytes:
        return b"".join(self.pieces)

    def __len__(self) -> int:
        return sum(len(p) for p in self.pieces)


def ids_json(token_ids: Sequence[int]) -> list[bytes | memoryview]:
    """`token_ids` as the text of a JSON array without spaces, in pieces. A prompt is ~100k
    ids, written into the prefill and the decode body: `json.dumps` of the list was the
    router's largest CPU cost in the 200-agent soak's profile (~18 ms per 100k ids); orjson
    writes them in ~1 ms, and a `PagedPrompt` keeps its text (the branch's last turn's, but for
    what this turn added) and lends it in pieces, nothing copied."""
    if isinstance(token_ids, PagedPrompt):
        return [b"[", *[memoryview(t) for t in token_ids.text()], b"]"]
    return [orjson.dumps(token_ids if isinstance(token_ids, list | tuple) else list(token_ids))]


def pd_bodies(
    req: PreparedRequest, prefill: EngineHandle, room: int, attempt: int, max_tokens: int
) -> tuple[Body, Body]:
    """The `/generate` bodies of the prefill and the decode engine, JSON in pieces: the same
    request with the prefill engine's bootstrap address and the `room` both sides meet in,
    streamed to the decode side only, its token ids encoded once for both. `max_tokens`: the
    router's default when the request gives none."""
    s = req.sampling
    params: dict[str, Any] = {"max_new_tokens": s.max_tokens or max_tokens}
    if s.temperature is not None:
        params["temperature"] = s.temperature
    if s.top_p is not None:
        params["top_p"] = s.top_p
    if s.stop:
        params["stop"] = list(s.stop)
    if s.seed is not None:
        params["sampling_seed"] = s.seed
    head = {
        # A retry is a new request to the engines: the failed attempt may still be winding
        # down on one of them under the old id.
        "rid": req.request_id if attempt == 0 else f"{req.request_id}.{attempt}",
        "sampling_params": params,
        "bootstrap_host": prefill.bootstrap_host,
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": room,
    }
    start = json.dumps(head)[:-1].encode() + b', "input_ids": '
    ids = ids_json(req.token_ids)
    return Body((start, *ids, b', "stream": false}')), Body((start, *ids, b', "stream": true}'))


class HttpTransport:
    """`PdTransport` over SGLang's HTTP `/generate`, on one aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, *, request_timeout_s: float = 600.0) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=5.0)

    async def prefill(self, engine: EngineHandle, body: Body) -> None:
        post = self._post(engine, body)
        del body  # `post` sends it and lets it go
        async with post as resp:
            await self._check(engine, resp)
            await resp.read()

    async def decode(
        self, engine: EngineHandle, body: Body
    ) -> AsyncGenerator[GenerationEvent, None]:
        text, tokens = "", 0
        last = b""  # the latest chunk as sent: its cumulative output ids, should the stream break
        post = self._post(engine, body)
        del body  # `post` sends it and lets it go
        async with post as resp:
            await self._check(engine, resp)
            try:
                async for chunk, raw in _sse(resp):
                    last = raw
                    if chunk.get("error"):
                        raise EngineFailedError(
                            f"engine {engine.node}: {chunk['error']}", node=engine.node
                        )
                    meta = chunk.get("meta_info") or {}
                    # SGLang streams the cumulative text unless --incremental-streaming-output.
                    new_text = str(chunk.get("text", ""))
                    delta = new_text[len(text) :] if new_text.startswith(text) else new_text
                    n = int(meta.get("completion_tokens", tokens))
                    if delta or n > tokens:
                        yield TextPiece(delta, max(n - tokens, 0))
                    text, tokens = new_text, max(n, tokens)
                    finish = meta.get("finish_reason")
                    if finish:
                        reason = finish.get("type") if isinstance(finish, dict) else finish
                        cached = meta.get("cached_tokens")
                        yield Finished(
                            "stop" if reason in ("stop", "eos") else "length",
                            tokens,
                            int(cached) if cached is not None else None,
                        )
                        return
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as e:
                if not tokens and not text:
                    # Nothing reached the client yet (an engine that crashed, typically): the
                    # request can start over on another node.
                    raise UnreachableError(engine, f"broke the stream: {e}") from None
                raise BrokenStreamError(
                    f"engine {engine.node} broke the stream: {e}",
                    node=engine.node,
                    output_ids=_output_ids(last, tokens),
                ) from None
        raise EngineFailedError(f"engine {engine.node} ended the stream early", node=engine.node)

    def _post(self, engine: EngineHandle, body: Body) -> _Request:
        return _Request(self.session, engine, body, self.timeout)

    async def _check(self, engine: EngineHandle, resp: aiohttp.ClientResponse) -> None:
        if resp.status == 200:
            return
        detail = (await resp.text())[:500]
        if resp.status in (429, 503):
            # Draining or overloaded: another node can take the request.
            raise UnreachableError(engine, f"HTTP {resp.status}: {detail}")
        if 400 <= resp.status < 500 and resp.status != 408:
            # The request itself (a length no engine takes, a sampling value it refuses): the
            # same on every engine, so not retried, and the client's to fix, not a 502.
            raise EngineRejectedError(
                f"engine {engine.node} refused the request: {_message(detail)}", node=engine.node
            )
        raise EngineFailedError(
            f"engine {engine.node} answered HTTP {resp.status}: {detail}", node=engine.node
        )


def _message(detail: str) -> str:
    """An engine's error text: the message of an OpenAI- or SGLang-shaped JSON error, else the
    text as it came."""
    try:
        body = json.loads(detail)
    except ValueError:
        return detail
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return detail


_SENT = Body(())


class _Pieces(aiohttp.payload.Payload):
    """A `Body` sent piece by piece, its length known (no chunked encoding)."""

    _value: Body
    _size: int  # set from the body: never unknown
    _autoclose = True  # bytes and views: nothing to close

    def __init__(self, body: Body) -> None:
        super().__init__(body, content_type=_JSON["Content-Type"])
        self._size = len(body)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return bytes(self._value).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        # A Content-Length below the body's cuts it, as aiohttp's own payloads do.
        left = self._size if content_length is None else content_length
        for piece in self._value.pieces:
            if left <= 0:
                return
            await writer.write(piece[:left] if len(piece) > left else piece)
            left -= len(piece)


class _Request:
    """`session.post(...)` whose connection failures become `UnreachableError`."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        engine: EngineHandle,
        body: Body,
        timeout: aiohttp.ClientTimeout,
    ) -> None:
        self.session, self.engine, self.body, self.timeout = session, engine, body, timeout
        self.resp: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> aiohttp.ClientResponse:
        try:
            body, self.body = self.body, _SENT  # sent once: not held for the whole stream
            self.resp = await self.session.post(
                f"{self.engine.http_url}/generate",
                data=_Pieces(body),
                headers=_JSON,
                timeout=self.timeout,
            )
        except TimeoutError as e:  # aiohttp's connection timeouts are TimeoutErrors too
            reason = str(e) or type(e).__name__
            raise UnreachableError(self.engine, reason, gone=False) from None
        except aiohttp.ClientConnectionError as e:
            raise UnreachableError(self.engine, str(e) or type(e).__name__) from None
        return self.resp

    async def __aexit__(self, *exc: object) -> None:
        if self.resp is not None:
            self.resp.release()


async def _sse(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[dict[str, Any], bytes]]:
    """The JSON payloads of an SSE stream (`data: {...}` lines) up to `data: [DONE]`, each with
    its bytes."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            chunk = orjson.loads(_without_output_ids(data))
        except orjson.JSONDecodeError:
            raise EngineFailedError(f"malformed stream chunk: {data[:200]!r}") from None
        if isinstance(chunk, dict):
            yield chunk, data


def _output_ids(chunk: bytes, tokens: int) -> tuple[int, ...]:
    """The `tokens` output ids a cumulative stream chunk holds; empty when it holds another
    count (an incremental stream, or none at all): the request cannot go on exactly then."""
    try:
        ids = orjson.loads(chunk).get("output_ids")
    except (ValueError, AttributeError):
        return ()
    if not isinstance(ids, list) or len(ids) != tokens or not all(type(i) is int for i in ids):
        return ()
    return tuple(ids)


_OUTPUT_IDS = b'"output_ids":['


def _without_output_ids(data: bytes) -> bytes:
    """A stream chunk with its `output_ids` array replaced by null, unparsed.

    SGLang's stream is cumulative: every chunk repeats all the output ids so far, so parsing
    them costs O(n^2) per request (a 4,000-token answer: ~8M ids), and the router never reads
    them (the text and `meta_info` say everything). Cut by byte search, which is exact: the
    key's closing quote cannot occur unescaped inside a JSON string, and the array holds only
    numbers, so its first `]` ends it. Any other spelling (spaces) is parsed whole."""
    i = data.find(_OUTPUT_IDS)
    if i < 0:
        return data
    j = data.find(b"]", i + len(_OUTPUT_IDS))
    return data if j < 0 else data[:i] + b'"output_ids":null' + data[j + 1 :]
