"""The router's HTTP front end (aiohttp): OpenAI API, branch API, `/health`, `/metrics`.

`build_app` wires a `Dispatcher`, a `BranchTracker`, a `Tokenizer` and `RouterMetrics` into an
`aiohttp.web.Application`. A completion request goes: body (size, content type, JSON) -> record
(`api`) -> branch info (`branches`) -> token ids and block hashes (`turns`: only what the branch's
last turn did not have is tokenized and hashed; in a worker thread, so that a long prompt does not
stall the event loop) -> `tracker.begin` -> `dispatcher.generate` -> JSON
or SSE. `tracker.finish` runs in a `finally`, so a failed, cancelled or disconnected request never
leaves a live anonymous branch behind.

Every error, from a handler or from aiohttp itself (unknown route, method, body too large), is
answered as OpenAI error JSON by one middleware, which also counts and logs each request. An
unexpected exception is a logged 500: the server never dies on a request.

Client disconnects: run the app with `handler_cancellation=True` (as `server.serve` does) and the
handler is cancelled as soon as the client goes, which stops the dispatch at once; without it, the
next write fails and the stream stops there.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import structlog
from aiohttp import web

from evolving_infra import logs
from evolving_infra.router import api
from evolving_infra.router.api import ApiError, ChatRequest, CompletionRequest, Usage
from evolving_infra.router.auth import ApiKeys
from evolving_infra.router.bodies import KeptBody
from evolving_infra.router.branches import (
    BranchError,
    BranchEvent,
    BranchExistsError,
    BranchInfo,
    BranchLease,
    BranchTracker,
    parse_branch_info,
)
from evolving_infra.router.branches import check_branch_id as _check_branch_id
from evolving_infra.router.dispatcher import (
    Dispatcher,
    DispatchError,
    EngineFailedError,
    EngineRejectedError,
    Finished,
    GenerationEvent,
    NoEngineError,
    OverloadedError,
    PreparedRequest,
    ShuttingDownError,
)
from evolving_infra.router.metrics import CONTENT_TYPE, RouterMetrics
from evolving_infra.router.server import ON_BAD_HTTP
from evolving_infra.router.sessions import session_branch
from evolving_infra.router.tokenize import Tokenizer
from evolving_infra.router.turns import DEFAULT_BUDGET_MIB, Encoded, Turn, TurnCache

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Call:
    """Per-request state the middleware shares with the handler (through `_CALL`)."""

    request_id: str
    status: int | None = None  # the status to record when the response itself says 200


# A context variable rather than request storage: the handler runs in the middleware's task,
# and aiohttp's typed request keys exist only in recent versions.
_CALL: ContextVar[_Call] = ContextVar("evolving_router_call")

CLIENT_GONE = 499  # nginx's status for "client closed the request": only in metrics and logs
_ROUTE_OTHER = "other"  # metric label of requests that matched no route


def _branch_error(e: BranchError) -> ApiError:
    """The tracker's refusal as the client sees it: 409 for a branch that exists, else 404."""
    if isinstance(e, BranchExistsError):
        return ApiError(409, str(e), code=api.BRANCH_EXISTS, param=e.param)
    return ApiError(404, str(e), code=api.UNKNOWN_BRANCH, param=e.param)


def configure_json_logging(level: logs.Level = "info") -> None:
    """JSON lines on stderr: one object per event, with ISO UTC time, level and bound context."""
    logs.configure(json=True, level=level)


_CLIENT_MAX = web.AppKey("client_max_size", int)  # the body limit, for the 413 message
_QUIET = frozenset({"/health", "/metrics"})  # polled paths: their request lines are debug


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(data, status=status, headers=headers)


def _error_response(e: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return _json(e.body(), status=e.status, headers=headers)


def _from_http(e: web.HTTPException, request: web.Request) -> tuple[ApiError, dict[str, str]]:
    """aiohttp's own errors (routing, body size) as API errors, keeping their headers."""
    if isinstance(e, web.HTTPNotFound):
        return ApiError(404, f"no route {request.path}", code=api.NOT_FOUND), {}
    if isinstance(e, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(e.allowed_methods))
        message = f"method {request.method} not allowed on {request.path} (allowed: {allowed})"
        return ApiError(405, message, code=api.METHOD_NOT_ALLOWED), {"Allow": allowed}
    if isinstance(e, web.HTTPRequestEntityTooLarge):
        return _too_large(request), {}
    code = api.NOT_FOUND if e.status == 404 else api.INVALID_VALUE
    return ApiError(e.status, e.reason, code=code), {}


def _too_large(request: web.Request) -> ApiError:
    limit = request.app[_CLIENT_MAX]
    return ApiError(413, f"request body larger than {limit} bytes", code=api.TOO_LARGE)


def _dispatch_error(e: DispatchError) -> ApiError:
    if isinstance(e, NoEngineError):
        return ApiError(503, f"no engine available: {e.reason}", code=api.NO_ENGINE)
    if isinstance(e, OverloadedError):
        # Whole seconds, at least one: what OpenAI's SDK and most HTTP clients read.
        retry = {"Retry-After": str(max(math.ceil(e.retry_after_s), 1))}
        return ApiError(429, f"overloaded: {e.reason}", code=api.OVERLOADED, headers=retry)
    if isinstance(e, ShuttingDownError):
        return api.shutting_down(e.reason)
    if isinstance(e, EngineRejectedError):
        return ApiError(400, e.reason, code=api.ENGINE_REJECTED)
    return ApiError(e.status, f"engine failed: {e.reason}", code=api.ENGINE_FAILED)


def _branch(headers: Mapping[str, str], agent: Mapping[str, Any] | None) -> BranchInfo | None:
    """The router's own branch API first; else the session headers harnesses already send."""
    return parse_branch_info(headers, agent) or session_branch(headers)


def _route_label(request: web.Request) -> str:
    route = request.match_info.route
    if isinstance(route, web.ResourceRoute):
        return route.resource.canonical if route.resource is not None else _ROUTE_OTHER
    return _ROUTE_OTHER


async def _close(events: AsyncIterator[GenerationEvent]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


class FrontEnd:
    """The handlers, over the parts `build_app` hands in."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        tracker: BranchTracker,
        tokenizer: Tokenizer,
        metrics: RouterMetrics,
        *,
        page_size: int,
        models: Sequence[str],
        listed: Sequence[str] = (),
        keys: ApiKeys | None = None,
        clock: Callable[[], float] = time.monotonic,
        turn_cache_bytes: int = DEFAULT_BUDGET_MIB << 20,
    ) -> None:
        self.dispatcher = dispatcher
        self.keys = keys or ApiKeys()
        self.tracker = tracker
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.page_size = page_size
        self.models = tuple(models)
        self.listed = tuple(listed) or self.models
        self.clock = clock
        self.started = int(time.time())
        self.turns = TurnCache(tokenizer, page_size, turn_cache_bytes)
        tracker.on_event = lambda event: metrics.branch_events.labels(event).inc()
        tracker.on_end = self.turns.drop
        metrics.watch_turn_cache(lambda: (len(self.turns), self.turns.nbytes))
        metrics.watch_branches(lambda: (tracker.live, tracker.anonymous_live))

    # -- middleware ------------------------------------------------------------------------

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        start = self.clock()
        rid = request.headers.get("X-Request-Id", "")
        if not (0 < len(rid) <= 128 and rid.isprintable()):
            rid = uuid.uuid4().hex
        call = _Call(rid)
        _CALL.set(call)
        route = _route_label(request)
        status = 500
        with structlog.contextvars.bound_contextvars(request_id=rid):
            try:
                self.keys.check(request)
                response: web.StreamResponse = await handler(request)
                status = call.status or response.status
            except ApiError as e:
                status = e.status
                challenge = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
                response = self._fail(request, e, challenge)
            except BranchError as e:
                error = _branch_error(e)
                status = error.status
                response = self._fail(request, error)
            except web.HTTPException as e:
                error, headers = _from_http(e, request)
                status = error.status
                response = self._fail(request, error, headers)
            except asyncio.CancelledError:
                status = CLIENT_GONE
                self.metrics.disconnects.inc()
                log.info("client disconnected", path=request.path)
                raise
            except Exception:
                log.exception("unexpected error", path=request.path, method=request.method)
                status = 500
                error = ApiError(500, "internal error (logged)", code=api.INTERNAL)
                response = self._fail(request, error)
            finally:
                self.metrics.requests.labels(route, str(status)).inc()
                (log.debug if request.path in _QUIET else log.info)(
                    "request",
                    method=request.method,
                    path=request.path,
                    status=status,
                    seconds=round(self.clock() - start, 6),
                )
            if not response.prepared:  # a stream has sent its headers already
                response.headers.setdefault("X-Request-Id", rid)
            return response

    def bad_http(self, e: ApiError) -> None:
        """A request aiohttp could not parse (`server.py` answered it): counted and logged as
        every failed request is."""
        self.metrics.requests.labels(_ROUTE_OTHER, str(e.status)).inc()
        self.metrics.errors.labels(e.type, e.code).inc()
        log.warning("request failed", status=e.status, code=e.code, error=e.message)

    def _fail(
        self, request: web.Request, e: ApiError, headers: dict[str, str] | None = None
    ) -> web.Response:
        self.metrics.errors.labels(e.type, e.code).inc()
        # A server fault is an error; a client's mistake, a shed request or one refused while
        # the router drains is the client's to act on, a warning here.
        fault = e.status >= 500 and e.code != api.SHUTTING_DOWN
        level = log.error if fault else log.warning
        level("request failed", status=e.status, code=e.code, error=e.message, param=e.param)
        return _error_response(e, {**e.headers, **(headers or {})})

    # -- plain routes ------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        h = self.dispatcher.health()
        # Degraded is still a 200: the router serves, and a load balancer should keep sending.
        status = "unavailable" if not h.ready else "degraded" if h.degraded else "ok"
        body = {
            "status": status,
            "reason": (h.reason or h.degraded) or None,
            "tokenizer": self.tokenizer.name,
            "page_size": self.page_size,
            "branches": {"named": self.tracker.live, "anonymous": self.tracker.anonymous_live},
            # Prompt and completion tokens one request may have (None: no limit known).
            "context_tokens": self.dispatcher.limits().context_tokens,
            "dispatcher": dict(h.detail),
        }
        return _json(body, status=200 if h.ready else 503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def list_models(self, request: web.Request) -> web.Response:
        return _json(api.models_response(self.listed, self.started))

    async def end_branch(self, request: web.Request) -> web.Response:
        branch = _check_branch_id(request.match_info["branch"], "branch")
        was_live = self.tracker.end(branch)
        log.info("branch ended", branch=branch, was_live=was_live)
        return _json({"branch": branch, "ended": True, "was_live": was_live})

    # -- completions ---------------------------------------------------------------------------

    async def _read_body(self, request: web.Request) -> bytes:
        if request.content_type != "application/json":
            raise ApiError(
                400,
                f"Content-Type must be application/json, got {request.content_type!r}",
                code=api.INVALID_CONTENT_TYPE,
            )
        limit = request.app[_CLIENT_MAX]
        if request.content_length is not None and request.content_length > limit:
            raise _too_large(request)  # before reading a byte of it
        # Read as chunks joined once (`request.read()` copies a body twice: ~0.05 ms at 100k
        # tokens of ids); one chunk is the body itself.
        chunks: list[bytes] = []
        size = 0
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > limit:  # a chunked body says no length up front
                raise _too_large(request)
            chunks.append(chunk)
        return b"".join(chunks)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "completion")

    async def _complete(
        self, request: web.Request, kind: Literal["chat", "completion"]
    ) -> web.StreamResponse:
        arrival = self.clock()
        raw = await self._read_body(request)
        req, info, last, kept = self._parse(kind, raw, request.headers)
        # NOTE: a long prompt is megabytes in each form (JSON bytes, record, token ids): each is
        # dropped once the next exists (the branch's turn keeps a chat body, once), so a request
        # in flight holds its ids once (the router's memory scales with the requests in flight).
        del raw
        if self.models and req.model not in self.models:
            raise ApiError(
                404,
                f"model {req.model!r} is not served (served: {', '.join(self.models)})",
                code=api.UNKNOWN_MODEL,
                param="model",
            )
        if TurnCache.light(req):  # less work than a worker thread's hop (`turns.INLINE_CHARS`)
            encoded = self._encode(req, info, last, kept)
        else:
            encoded = await asyncio.to_thread(self._encode, req, info, last, kept)
        ids, hashes = encoded.ids, encoded.hashes
        self.metrics.prompt_tokens_tokenized.inc(encoded.tokenized)
        self.metrics.prompt_tokens_reused.inc(encoded.reused)
        del encoded
        field = "messages" if kind == "chat" else "prompt"
        if not ids:
            raise api.invalid("the prompt is empty", field)
        self._check_fits(len(ids), req.sampling.max_tokens, field)
        include_usage = req.include_usage
        lease = self.tracker.begin(info, hashes)
        try:
            rid = _CALL.get().request_id
            prepared = PreparedRequest(
                request_id=rid,
                kind=kind,
                model=req.model,
                token_ids=ids,
                block_hashes=hashes,
                page_size=self.page_size,
                branch=lease.key,
                branch_info=info,
                sampling=req.sampling,
                stream=req.stream,
                arrival=arrival,
                user=req.user,
                think_s=lease.think_s,
            )
            del req, ids, hashes
            log.debug(
                "dispatch",
                kind=kind,
                prompt_tokens=len(prepared.token_ids),
                blocks=len(prepared.block_hashes),
                branch=str(lease.key),
                branch_event=info.event if info else None,
            )
            self.metrics.prompt_tokens.inc(len(prepared.token_ids))
            events = self.dispatcher.generate(prepared)
            try:
                if prepared.stream:
                    return await self._stream(request, prepared, include_usage, events)
                return await self._collect(prepared, events)
            finally:
                await _close(events)
        finally:
            self._finish(lease)

    def _check_fits(self, prompt: int, max_tokens: int | None, field: str) -> None:
        """OpenAI's 400s for a request that no engine could ever hold, before anything is
        dispatched: a harness compacts its context on `context_length_exceeded`."""
        limit = self.dispatcher.limits().context_tokens
        if limit is None:
            return
        if max_tokens is not None and max_tokens >= limit:
            raise api.invalid(
                f"max_tokens is too large: {max_tokens}. This model's context holds at most"
                f" {limit} tokens, prompt and completion together.",
                "max_tokens",
            )
        out = max_tokens or 1  # with no max_tokens, the completion takes the room that is left
        if prompt + out > limit:
            raise api.invalid(
                f"This model's maximum context length is {limit} tokens. However, you requested"
                f" {prompt + out} tokens ({prompt} in the {field}, {out} in the completion)."
                f" Please reduce the length of the {field} or completion.",
                field,
                code=api.CONTEXT_LENGTH_EXCEEDED,
            )

    def _finish(self, lease: BranchLease) -> None:
        if lease.info is not None and lease.end_after:
            log.info("branch ended", branch=lease.info.branch, by="event")
        self.tracker.finish(lease)

    def _parse(
        self, kind: Literal["chat", "completion"], raw: bytes, headers: Mapping[str, str]
    ) -> tuple[ChatRequest | CompletionRequest, BranchInfo | None, Turn | None, KeptBody | None]:
        """The request, its branch, the branch's last turn (a fork's first: its parent's) and
        the body to keep. The body is read against that turn's (`TurnCache.read_chat`,
        `read_completion`): the messages or token ids it repeats byte for byte are not decoded
        again."""
        read: Callable[
            [bytes, Turn | None, bool], tuple[ChatRequest | CompletionRequest, KeptBody | None]
        ]
        read = self.turns.read_chat if kind == "chat" else self.turns.read_completion
        try:  # the branch as the headers name it, to read the body against
            named = _branch(headers, None)
        except ApiError:
            named = None  # named again below, with the body's `agent`, for the error
        last = self._last(named)
        req, kept = read(raw, last, named is not None)  # an anonymous body is kept by no branch
        info = _branch(headers, req.agent)
        if info != named:  # the body's `agent` names another branch: read against its turn
            last = self._last(info)
            req, kept = read(raw, last, info is not None)
        return req, info, last, kept

    def _last(self, info: BranchInfo | None) -> Turn | None:
        if info is None:
            return None
        return self.turns.last(info.branch, info.parent if info.event is BranchEvent.FORK else None)

    def _encode(
        self,
        req: ChatRequest | CompletionRequest,
        info: BranchInfo | None,
        last: Turn | None,
        body: KeptBody | None,
    ) -> Encoded:
        """Token ids and page hashes, from the branch's last turn where it still holds (a fork's
        first turn: from its parent's)."""
        return self.turns.encode(req, None if info is None else info.branch, last, body)

    def _response_id(self, prepared: PreparedRequest) -> str:
        return f"{'chatcmpl' if prepared.kind == 'chat' else 'cmpl'}-{prepared.request_id}"

    def _observe(self, prepared: PreparedRequest, done: Finished, first: float | None) -> Usage:
        now = self.clock()
        self.metrics.ttft.labels(prepared.kind).observe((first or now) - prepared.arrival)
        self.metrics.e2e.labels(prepared.kind).observe(now - prepared.arrival)
        self.metrics.completion_tokens.inc(done.completion_tokens)
        if done.cached_tokens is not None:
            self.metrics.cached_tokens.inc(done.cached_tokens)
        return Usage(len(prepared.token_ids), done.completion_tokens, done.cached_tokens)

    async def _collect(
        self, prepared: PreparedRequest, events: AsyncIterator[GenerationEvent]
    ) -> web.Response:
        parts: list[str] = []
        first: float | None = None
        done: Finished | None = None
        try:
            async for event in events:
                if isinstance(event, Finished):
                    done = event
                    break
                if first is None:
                    first = self.clock()
                parts.append(event.text)
        except DispatchError as e:
            raise _dispatch_error(e) from e
        if done is None:
            raise _dispatch_error(_truncated())
        usage = self._observe(prepared, done, first)
        build = api.chat_response if prepared.kind == "chat" else api.completion_response
        rid = self._response_id(prepared)
        text = "".join(parts)
        body = build(rid, prepared.model, int(time.time()), text, done.finish_reason, usage)
        return _json(body, headers={"X-Request-Id": prepared.request_id})

    async def _stream(
        self,
        request: web.Request,
        prepared: PreparedRequest,
        include_usage: bool,
        events: AsyncIterator[GenerationEvent],
    ) -> web.StreamResponse:
        it = aiter(events)
        # The first event comes before the headers, so that a dispatch that fails at once (no
        # engine) is an HTTP error status, not a 200 stream that carries an error.
        try:
            event = await anext(it)
        except StopAsyncIteration:
            raise _dispatch_error(_truncated()) from None
        except DispatchError as e:
            raise _dispatch_error(e) from e
        chunks = api.ChunkBuilder(
            self._response_id(prepared),
            prepared.model,
            int(time.time()),
            chat=prepared.kind == "chat",
            include_usage=include_usage,
        )
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": prepared.request_id,
            }
        )
        try:
            await response.prepare(request)
        except ConnectionResetError:  # gone before the headers (aiohttp's is a subclass)
            return self._gone(request, response)
        first = self.clock()
        try:
            if chunks.chat:
                await response.write(api.sse(chunks.role()))
            while True:
                if isinstance(event, Finished):
                    usage = self._observe(prepared, event, first)
                    await response.write(api.sse(chunks.finish(event.finish_reason)))
                    if include_usage:
                        await response.write(api.sse(chunks.usage(usage)))
                    break
                if event.text:
                    await response.write(api.sse(chunks.text(event.text)))
                try:
                    event = await anext(it)
                except StopAsyncIteration:
                    raise _truncated() from None
        except DispatchError as e:
            # Headers are sent: the error goes in the stream, as an OpenAI error object, then
            # [DONE] (what vLLM and SGLang do; OpenAI clients raise on the error object).
            error = _dispatch_error(e)
            _CALL.get().status = error.status
            self._fail(request, error)
            with contextlib.suppress(ConnectionResetError):
                await response.write(api.sse(error.body()))
        except ConnectionResetError:
            return self._gone(request, response)
        try:
            await response.write(api.SSE_DONE)
            await response.write_eof()
        except ConnectionResetError:
            return self._gone(request, response)
        return response

    def _gone(self, request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
        _CALL.get().status = CLIENT_GONE
        self.metrics.disconnects.inc()
        log.info("client disconnected mid-stream", path=request.path)
        return response

    async def _expire_loop(self, interval: float) -> NoReturn:
        while True:
            await asyncio.sleep(interval)
            try:
                self.tracker.expire()
            except Exception:  # the loop must outlive a bug in one pass
                log.exception("branch expiry failed")


def _truncated() -> DispatchError:
    return EngineFailedError("the generation ended without a finish")


def build_app(
    dispatcher: Dispatcher,
    tracker: BranchTracker,
    tokenizer: Tokenizer,
    metrics: RouterMetrics,
    *,
    page_size: int,
    models: Sequence[str] = (),
    listed_models: Sequence[str] = (),
    max_body_bytes: int = 32 * 2**20,
    expire_interval: float | None = None,
    api_keys: ApiKeys | None = None,
    turn_cache_bytes: int = DEFAULT_BUDGET_MIB << 20,
) -> web.Application:
    """The router's aiohttp application (not started: see `serve`, or aiohttp's test utils).

    `models`: the names served (a request for another is a 404; empty: any name is taken, as
    SGLang does); `listed_models`: what `/v1/models` lists when `models` is empty (the names the
    engines report). `expire_interval`: seconds between branch-expiry passes (default: a
    quarter of the TTL, at most a minute). `turn_cache_bytes`: what the branches' last prompts
    may hold (`turns.TurnCache`; 0 tokenizes every prompt whole).
    """
    front = FrontEnd(
        dispatcher,
        tracker,
        tokenizer,
        metrics,
        page_size=page_size,
        models=models,
        listed=listed_models,
        keys=api_keys,
        turn_cache_bytes=turn_cache_bytes,
    )
    app = web.Application(middlewares=[front.middleware], client_max_size=max_body_bytes)
    app[_CLIENT_MAX] = max_body_bytes
    app[ON_BAD_HTTP] = front.bad_http
    app.router.add_post("/v1/chat/completions", front.chat)
    app.router.add_post("/v1/completions", front.completions)
    app.router.add_get("/v1/models", front.list_models)
    app.router.add_post("/v1/branches/{branch}/end", front.end_branch)
    app.router.add_get("/health", front.health)
    app.router.add_get("/metrics", front.metrics_page)
    interval = expire_interval or min(tracker.ttl / 4, 60.0)

    async def expiry(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(front._expire_loop(interval))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(expiry)
    return app
