"""Dispatch to prefill/decode engines with SGLang's PD request protocol (the live router's core).

For each request the routing policy (`evolving_infra.routing`, the same objects the simulator
drives) picks a prefill node and a decode node from the router's view of every engine
(`NodeLoad`s kept by `LoadTracker`) and the cluster directory. The request then goes to both at
once, as SGLang's gateway sends it (notes `sglang-0.5.23.md` §1.2, "Request contract"): the same
`/generate` body with `bootstrap_host`/`bootstrap_port` of the prefill engine and a random
`bootstrap_room`; the decode engine pulls the KV from the prefill engine and streams the tokens.
Only the decode stream reaches the client; the prefill answer only ends the prefill bookkeeping.

Load is tracked on the router side, from what it dispatched (as Dynamo's and SGLang's routers
do), so choosing a node needs no round trip: a request adds its predicted prefill seconds to its
prefill node until the prefill engine answers, and its KV blocks to its decode node until the
stream ends.

Failures: an engine that cannot be reached, or whose stream breaks before its first token (a
crashed engine), is marked down and the request is tried once more on other nodes, as long as
no token has reached the client; after that, or on an engine error answer, the request fails
with `EngineFailedError` (an SSE error event when streaming).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog

from evolving_infra._core import KvDirectory
from evolving_infra.planner.slices import Slices
from evolving_infra.router.admission import DecodeGate
from evolving_infra.router.dispatcher import (
    DispatcherHealth,
    EngineFailedError,
    Finished,
    GenerationEvent,
    NoEngineError,
    PreparedRequest,
    TextPiece,
)
from evolving_infra.router.loads import EngineHandle, EngineState, LoadTracker
from evolving_infra.routing.base import Router, RouteRequest
from evolving_infra.routing.common import NoNodeError
from evolving_infra.timing.model import IterationModel
from evolving_infra.types import Phase, blocks_for

log = structlog.get_logger("evolving_infra.router.pd")

# SGLang's gateway draws the room as `u64 & i64::MAX` (notes §1.2): a non-negative i64.
ROOM_MAX = (1 << 63) - 1
# How long a decode-side failure waits for the prefill side's answer, which says whether the
# prefill engine was the cause (then the request is retried elsewhere).
PREFILL_VERDICT_S = 2.0
_JSON = {"Content-Type": "application/json"}


@functools.cache
def _id_texts() -> list[str]:
    """Token ids' JSON texts, looked up rather than formatted (see `ids_json`). 2**17 entries
    (~8 MiB) cover byte ids and 128k-token vocabularies; built on first use, not at import:
    every CLI process imports this module."""
    return [str(i) for i in range(1 << 17)]


def ids_json(token_ids: Sequence[int]) -> bytes:
    """`token_ids` as the text of a JSON array (`json.dumps(list(token_ids))` less the spaces).

    A prompt is ~100k ids: `json.dumps` of the list for the prefill body and again for the
    decode body was the router's largest CPU cost in the 200-agent soak's profile (~18 ms each
    per 100k ids, against ~6 ms for one join of looked-up texts). NOTE: ids are non-negative, as
    `PreparedRequest` promises (the front end checks client ids, a tokenizer makes no others):
    a negative index would read the table from its end."""
    if not token_ids:
        return b"[]"
    texts = _id_texts()
    look = texts.__getitem__ if max(token_ids) < len(texts) else str
    return b"[" + ",".join(map(look, token_ids)).encode() + b"]"


@dataclass(frozen=True, slots=True)
class _Placement:
    prefill: EngineHandle
    decode: EngineHandle
    prefill_s: float
    uncached: int
    decode_blocks: int


class _UnreachableError(Exception):
    """An engine did not answer at the connection level (the request may be retried)."""

    def __init__(self, engine: EngineHandle, reason: str, *, gone: bool = True) -> None:
        super().__init__(reason)
        self.engine = engine
        self.reason = reason
        # False: it did not answer in time (overloaded, perhaps): try elsewhere, but leave
        # judging it down to the health loop, or a busy cluster's only decode node would be
        # taken out by its own load.
        self.gone = gone


class PdDispatcher:
    """`Dispatcher` over prefill and decode engines (see the module docstring)."""

    def __init__(
        self,
        engines: Sequence[EngineHandle],
        directory: KvDirectory,
        router: Router,
        model: IterationModel,
        *,
        page_size: int,
        session: aiohttp.ClientSession,
        default_max_tokens: int = 256,
        request_timeout_s: float = 600.0,
        seed: int | None = None,
        admission: bool = True,
    ) -> None:
        self.engines: dict[int, EngineHandle] = {e.node: e for e in engines}
        self.directory = directory
        self.router = router
        self.model = model
        self.page_size = page_size
        self.session = session
        self.default_max_tokens = default_max_tokens
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=5.0)
        self.loads = LoadTracker()
        # The planner's window, when a planner runs: arrivals and decoded tokens are counted here.
        self.slices: Slices | None = None
        # Told each request's router overhead (arrival to leaving for the engines), in seconds.
        self.on_dispatch: Callable[[float], None] | None = None
        # Told how long each request was held by the decode-KV gate, in seconds.
        self.on_admitted: Callable[[float], None] | None = None
        self._rng = random.Random(seed)
        # Requests in flight per engine (their tasks), so that an engine found dead can have
        # its requests pulled back at once instead of at their timeouts.
        self._inflight: dict[int, set[asyncio.Task[Any]]] = {}
        self._aborted: dict[asyncio.Task[Any], tuple[int, str]] = {}
        # Requests wait here until a decode engine has room for their KV (`router.admission`).
        self.gate = (
            DecodeGate(self._decode_space, max_wait_s=request_timeout_s) if admission else None
        )

    # -- engine states (the daemon's discovery and health loops call these) ---------------------

    def add_engine(self, engine: EngineHandle) -> None:
        """An engine that joined after start, or came back (perhaps on other ports)."""
        self.engines[engine.node] = engine
        self._room_changed()

    def abort_engine(self, node: int, reason: str) -> int:
        """Pulls back every request in flight on `node` (an engine that stopped answering):
        those that sent the client nothing are retried elsewhere, the others end with an error.
        Returns how many were in flight."""
        tasks = self._inflight.get(node, set())
        for task in tasks:
            if task not in self._aborted and not task.done():
                self._aborted[task] = (node, reason)
                task.cancel()
        if tasks:
            log.warning("engine_requests_aborted", node=node, requests=len(tasks), reason=reason)
        return len(tasks)

    def set_state(self, node: int, state: EngineState, reason: str = "") -> None:
        e = self.engines[node]
        if e.state != state:
            log.info("engine_state", node=node, old=e.state, new=state, reason=reason)
        e.state, e.reason = state, reason
        self._room_changed()

    def set_phase(self, node: int, phase: Phase) -> None:
        self.engines[node].phase = phase
        self._room_changed()

    def _room_changed(self) -> None:
        if self.gate is not None:
            self.gate.notify()

    def _up_decode(self) -> list[EngineHandle]:
        """The decode engines that take requests now."""
        return [e for e in self.engines.values() if e.phase == "decode" and e.state == "up"]

    def _decode_space(self) -> dict[int, tuple[int, int]]:
        """The up decode engines' KV capacity and blocks in use by the router's count."""
        return {
            e.node: (e.kv_capacity_blocks, self.loads.used_blocks(e.node))
            for e in self._up_decode()
        }

    def _route(self, req: PreparedRequest) -> RouteRequest:
        max_out = req.sampling.max_tokens or self.default_max_tokens
        return RouteRequest(
            hashes=list(req.block_hashes),
            prompt_tokens=len(req.token_ids),
            expected_output_tokens=max_out,
            branch=str(req.branch),
        )

    def _choose_decode(self, route: RouteRequest, extra: Mapping[int, int]) -> int:
        """The decode engine the policy picks for `route` with the gate's commitments counted
        (the gate queues the request there); -1 if none is up."""
        try:
            return self.router.choose_decode(route, self.loads.view(self._up_decode(), extra))
        except NoNodeError:
            return -1

    def health(self) -> DispatcherHealth:
        up = [e for e in self.engines.values() if e.state == "up"]
        phases = {e.phase for e in up}
        detail = {
            str(e.node): {"phase": e.phase, "state": e.state, "reason": e.reason}
            for e in self.engines.values()
        }
        missing = [p for p in ("prefill", "decode") if p not in phases]
        if missing:
            return DispatcherHealth(False, f"no {' or '.join(missing)} engine up", detail)
        return DispatcherHealth(True, "", detail)

    # -- dispatch -----------------------------------------------------------------------------

    def _place(
        self,
        req: PreparedRequest,
        excluded: set[int],
        decode: int | None = None,
        route: RouteRequest | None = None,
    ) -> _Placement:
        """The request's engines: prefill by the policy on current loads; decode `decode` (the
        engine whose room the gate gave it) while it is an up decode engine, else the policy's."""
        engines = [e for e in self.engines.values() if e.node not in excluded]
        nodes = self.loads.view(engines, self.gate.extra() if self.gate is not None else None)
        if route is None:
            route = self._route(req)
        # Matched now, once, for the policy and the prefill's size below: a request the gate
        # held has waited while the directory changed, and the ingestion threads may change it
        # again in between.
        route = dataclasses.replace(route, match=self.directory.match(route.hashes))
        try:
            placed = self.router.choose_prefill(route, nodes)
            given = self.engines.get(decode) if decode is not None else None
            if given is not None and given.phase == "decode" and given.state == "up":
                d = given.node
            else:
                d = self.router.choose_decode(route, nodes)
        except NoNodeError as e:
            raise NoEngineError(f"{e}; engines: {self._states()}") from None
        t = route.prompt_tokens
        uncached = max(t - min(placed.cached_blocks * self.page_size, t), 1)
        seconds = self.model.predict_prefill_one(uncached, t - uncached)
        blocks = self._decode_blocks(req)
        return _Placement(self.engines[placed.node], self.engines[d], seconds, uncached, blocks)

    def _decode_blocks(self, req: PreparedRequest) -> int:
        """KV blocks the router counts for `req` on its decode node: prompt and `max_tokens`
        (the gate asks for the same room the placement then takes)."""
        max_out = req.sampling.max_tokens or self.default_max_tokens
        return blocks_for(len(req.token_ids) + max_out, self.page_size)

    def _states(self) -> str:
        return (
            ", ".join(
                f"{e.node}={e.phase}/{e.state}"
                for e in sorted(self.engines.values(), key=lambda e: e.node)
            )
            or "none"
        )

    def _bodies(
        self, req: PreparedRequest, place: _Placement, room: int, attempt: int
    ) -> tuple[bytes, bytes]:
        """The `/generate` bodies of the prefill and the decode engine, as JSON bytes: the same
        request, streamed to the decode side only, its token ids encoded once for both."""
        s = req.sampling
        params: dict[str, Any] = {"max_new_tokens": s.max_tokens or self.default_max_tokens}
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
            "bootstrap_host": place.prefill.bootstrap_host,
            "bootstrap_port": place.prefill.bootstrap_port,
            "bootstrap_room": room,
        }
        ids = ids_json(req.token_ids)
        start = json.dumps(head)[:-1].encode() + b', "input_ids": ' + ids + b', "stream": '
        return start + b"false}", start + b"true}"

    async def generate(self, request: PreparedRequest) -> AsyncIterator[GenerationEvent]:
        held_s = 0.0
        decode: int | None = None
        # Built once: the gate's decode choice and the placement read the same request.
        route = self._route(request)
        if self.gate is not None:
            # The room is taken by `_run` (`add_decode`) with no `await` in between.
            start = time.monotonic()
            decode = await self.gate.wait(
                self._decode_blocks(request), lambda extra: self._choose_decode(route, extra)
            )
            held_s = time.monotonic() - start
            if self.on_admitted is not None:
                self.on_admitted(held_s)
        excluded: set[int] = set()
        for attempt in range(2):
            place = self._place(request, excluded, decode if attempt == 0 else None, route)
            streamed = False
            try:
                async for event in self._run(request, place, attempt, held_s):
                    streamed = True
                    yield event
                return
            except asyncio.CancelledError:
                aborted = self._take_abort()
                if aborted is None:
                    raise  # the client went away, or the router stops
                node, why = aborted[0], f"stopped answering: {aborted[1]}"
            except _UnreachableError as e:
                node, why = e.engine.node, f"unreachable: {e.reason}"
                if e.gone:
                    self.set_state(node, "down", e.reason)
            # Only failures reach here (a finished request returned above).
            if streamed or attempt == 1:
                raise EngineFailedError(f"engine {node} {why}", node=node, unavailable=True)
            excluded.add(node)
            log.warning("retry", request=request.request_id, down=node)

    def _take_abort(self) -> tuple[int, str] | None:
        """The abort (node, reason) behind the current task's cancellation, consumed, or None
        when the cancellation came from elsewhere."""
        task = asyncio.current_task()
        aborted = self._aborted.pop(task, None) if task is not None else None
        if aborted is not None and task is not None:
            task.uncancel()
        return aborted

    async def _run(
        self, req: PreparedRequest, place: _Placement, attempt: int, held_s: float = 0.0
    ) -> AsyncIterator[GenerationEvent]:
        room = self._rng.randint(0, ROOM_MAX)
        prefill_body, decode_body = self._bodies(req, place, room, attempt)
        p, d = place.prefill, place.decode
        me = asyncio.current_task()
        assert me is not None
        for node in {p.node, d.node}:
            self._inflight.setdefault(node, set()).add(me)
        prompt = blocks_for(len(req.token_ids), self.page_size)
        self.loads.add_prefill(p.node, place.prefill_s, place.uncached, prompt)
        self.loads.add_decode(d.node, place.decode_blocks, len(req.token_ids), prompt)
        if self.slices is not None:
            t = len(req.token_ids)
            self.slices.arrival(
                t, place.uncached, t - place.uncached, req.block_hashes, time.monotonic()
            )
        prefill_open = True

        def prefill_done(_: object = None) -> None:
            nonlocal prefill_open
            if prefill_open:
                prefill_open = False
                self.loads.done_prefill(p.node, place.prefill_s, place.uncached, prompt)

        if self.on_dispatch is not None and attempt == 0:
            # The router's own cost: the time held by the gate is queueing, not overhead.
            self.on_dispatch(time.monotonic() - req.arrival - held_s)
        prefill = asyncio.create_task(self._prefill(p, prefill_body))
        prefill.add_done_callback(prefill_done)
        stream = self._decode(d, decode_body)
        del prefill_body, decode_body  # megabytes: only their requests hold them, until sent
        first: asyncio.Future[GenerationEvent] = asyncio.ensure_future(anext(stream))
        try:
            # Until the decode side streams, a failed prefill must end the request: the decode
            # engine would otherwise wait for KV that never comes (SGLang's decode side learns
            # it from the bootstrap server; here the router knows first).
            legs: set[asyncio.Future[Any]] = {prefill, first}
            await asyncio.wait(legs, return_when=asyncio.FIRST_COMPLETED)
            failed = None if first.done() or prefill.cancelled() else prefill.exception()
            if failed is not None:
                raise failed
            try:
                event: GenerationEvent | None = await first
            except EngineFailedError:
                # The decode side gave up before streaming: when its prefill side failed, that
                # is the cause (e.g. a prefill engine that began draining), and it is retryable.
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(prefill), PREFILL_VERDICT_S)
                failed = None if not prefill.done() or prefill.cancelled() else prefill.exception()
                if failed is not None:
                    raise failed from None
                raise
            while event is not None:
                if self.slices is not None and isinstance(event, TextPiece):
                    self.slices.tokens(event.tokens)
                elif (
                    self.slices is not None
                    and isinstance(event, Finished)
                    and event.cached_tokens is not None
                ):
                    # What the prefill really found cached (the decode side reports it).
                    t = len(req.token_ids)
                    self.slices.prefilled(t, t - min(event.cached_tokens, t))
                yield event
                event = await anext(stream, None)
            # The decode side had the KV once it streamed: the prefill answer only confirms it,
            # and the client has its whole answer, so a late prefill error is only logged.
            try:
                await prefill
            except (_UnreachableError, EngineFailedError) as e:
                log.warning("prefill_answer_failed", request=req.request_id, reason=str(e))
        finally:
            for task in (first, prefill):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            await stream.aclose()
            prefill_done()
            self.loads.done_decode(d.node, place.decode_blocks, len(req.token_ids), prompt)
            self._room_changed()
            for node in {p.node, d.node}:
                self._inflight[node].discard(me)

    async def _prefill(self, engine: EngineHandle, body: bytes) -> None:
        post = self._post(engine, body)
        del body  # `post` sends it and lets it go
        async with post as resp:
            await self._check(engine, resp)
            await resp.read()

    async def _decode(
        self, engine: EngineHandle, body: bytes
    ) -> AsyncGenerator[GenerationEvent, None]:
        text, tokens = "", 0
        post = self._post(engine, body)
        del body  # `post` sends it and lets it go
        async with post as resp:
            await self._check(engine, resp)
            try:
                async for chunk in _sse(resp):
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
                    raise _UnreachableError(engine, f"broke the stream: {e}") from None
                raise EngineFailedError(
                    f"engine {engine.node} broke the stream: {e}", node=engine.node
                ) from None
        raise EngineFailedError(f"engine {engine.node} ended the stream early", node=engine.node)

    def _post(self, engine: EngineHandle, body: bytes) -> _Request:
        return _Request(self.session, engine, body, self.timeout)

    async def _check(self, engine: EngineHandle, resp: aiohttp.ClientResponse) -> None:
        if resp.status == 200:
            return
        detail = (await resp.text())[:500]
        if resp.status == 503:
            # Draining or overloaded: another node can take the request.
            raise _UnreachableError(engine, f"HTTP 503: {detail}")
        raise EngineFailedError(
            f"engine {engine.node} answered HTTP {resp.status}: {detail}", node=engine.node
        )


class _Request:
    """`session.post(...)` whose connection failures become `_UnreachableError`."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        engine: EngineHandle,
        body: bytes,
        timeout: aiohttp.ClientTimeout,
    ) -> None:
        self.session, self.engine, self.body, self.timeout = session, engine, body, timeout
        self.resp: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> aiohttp.ClientResponse:
        try:
            body, self.body = self.body, b""  # sent once: not held for the whole stream
            self.resp = await self.session.post(
                f"{self.engine.http_url}/generate", data=body, headers=_JSON, timeout=self.timeout
            )
        except TimeoutError as e:  # aiohttp's connection timeouts are TimeoutErrors too
            reason = str(e) or type(e).__name__
            raise _UnreachableError(self.engine, reason, gone=False) from None
        except aiohttp.ClientConnectionError as e:
            raise _UnreachableError(self.engine, str(e) or type(e).__name__) from None
        return self.resp

    async def __aexit__(self, *exc: object) -> None:
        if self.resp is not None:
            self.resp.release()


async def _sse(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of an SSE stream (`data: {...}` lines) up to `data: [DONE]`."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            chunk = json.loads(_without_output_ids(data))
        except json.JSONDecodeError:
            raise EngineFailedError(f"malformed stream chunk: {data[:200]!r}") from None
        if isinstance(chunk, dict):
            yield chunk


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
