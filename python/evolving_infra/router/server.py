"""Running the router's aiohttp app on a socket, with HTTP-level errors in OpenAI's shape.

aiohttp answers a request it cannot parse (a header or URL over its 8,190-byte line limit, a
malformed request line) itself, before any middleware runs: a plain-text `400 Bad Request`, with
a traceback in the log, not counted. Clients of an OpenAI-compatible server expect the error JSON
every other failure gets, and operators expect it in the metrics. `serve` therefore runs the app
with a connection handler whose `handle_error` answers parse errors as `api.ApiError`s
(`431 headers_too_large` for a line over the limit, `400 bad_http` otherwise), tells the app
(`ON_BAD_HTTP`: the front end counts and logs it) and leaves every other error to aiohttp.

aiohttp has no public hook for this: the handler class is swapped on the server the runner
builds (`_JsonErrorServer`). tests/test_router_http_limits.py sends raw oversized requests, so
an aiohttp whose internals moved fails there rather than in production.

Stopping (`Serving.stop`) drains: the listening socket closes at once (a new client is refused
and may try another replica, or again after the restart); the requests in flight, those still
waiting for decode room included, run to their end for up to the drain timeout, and only what
is left then is cut. A request that comes on a kept-alive connection meanwhile is answered
`503 shutting_down` with `Retry-After` and `Connection: close`, as is every answer that was
not streamed; after the drain the router goes on answering so for `LINGER_S` before it closes
the connections left (closing a kept-alive connection under a client races its next request
on it: the client sees a dropped connection, not an answer). A restart under load therefore
fails none of the requests it had taken (`tests/test_faults.py`, `evolving-infra soak`'s
router restart). `Drain.cut` ends the wait early (a second Ctrl-C).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from evolving_infra.router import api
from evolving_infra.router.api import ApiError

log = structlog.get_logger("evolving_infra.router.server")

# After the drain, how long new requests on kept-alive connections are still answered (503)
# before the connections close: a closed-loop client sends its next request at once.
LINGER_S = 0.5
# After the drain, what still runs is cut: aiohttp's own wait only has to let the cancellations
# land (their handlers answer the client with an error event and return).
CUT_GRACE_S = 1.0

# Told of each request aiohttp could not parse (the error as answered), for metrics and logs.
BadHttpHook = Callable[[ApiError], None]
ON_BAD_HTTP: web.AppKey[BadHttpHook] = web.AppKey("on_bad_http")


def parse_error(exc: BaseException | None, status: int) -> ApiError:
    """aiohttp's parse error as the API error the client gets."""
    if isinstance(exc, LineTooLong):
        return ApiError(
            431,
            f"request header fields or URL too large: {exc.message}",
            code=api.HEADERS_TOO_LARGE,
        )
    message = exc.message if isinstance(exc, BadHttpMessage) else "malformed HTTP request"
    return ApiError(status, f"malformed HTTP request: {message}", code=api.BAD_HTTP)


class _JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering parse errors as OpenAI error JSON."""

    on_bad_http: Callable[[ApiError], None] | None = None

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, BadHttpMessage) or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        error = parse_error(exc, status)
        if self.on_bad_http is not None:
            self.on_bad_http(error)
        response = web.json_response(error.body(), status=error.status)
        response.force_close()  # the rest of the connection's bytes cannot be trusted
        return response


class _JsonErrorServer(web.Server):
    on_bad_http: Callable[[ApiError], None] | None = None

    def __call__(self) -> RequestHandler:
        handler = _JsonErrorHandler(self, loop=self._loop, **self._kwargs)
        handler.on_bad_http = self.on_bad_http
        return handler


class _Runner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer
        assert isinstance(server, _JsonErrorServer)
        server.on_bad_http = self.app.get(ON_BAD_HTTP)
        return server


# Paths a draining router still answers: the scrape sees the drain to its end.
_WHILE_DRAINING = frozenset({"/metrics"})


class Drain:
    """The requests in flight, counted by a middleware, so that a stopping router can wait for
    them to finish; once `draining`, new ones are refused with a 503."""

    def __init__(self) -> None:
        self.active = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._cut = asyncio.Event()

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        if self.draining and request.path not in _WHILE_DRAINING:
            error = api.shutting_down(
                "the router is shutting down: send the request again (to another replica, or"
                " here once the router is back)"
            )
            refused = web.json_response(error.body(), status=error.status, headers=error.headers)
            refused.force_close()  # `Connection: close`: the client's next request reconnects
            return refused
        self.active += 1
        self._idle.clear()
        try:
            response: web.StreamResponse = await handler(request)
            if self.draining and not response.prepared:
                # `Connection: close`: the client's next request reconnects rather than go on
                # a connection about to close. (A stream has said keep-alive already: its
                # client's next request gets the 503 above, which closes it.)
                response.force_close()
            return response
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    def cut(self) -> None:
        """Ends a drain now: what is still in flight is cut."""
        self._cut.set()

    async def wait(self, timeout_s: float) -> None:
        """Until nothing is in flight, `timeout_s` have passed, or `cut()`."""
        waits = [asyncio.ensure_future(e.wait()) for e in (self._idle, self._cut)]
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()


@dataclass
class Serving:
    """The app on its socket; `stop` drains it (see the module docstring)."""

    runner: web.AppRunner
    drain: Drain = field(default_factory=Drain)

    @property
    def addresses(self) -> list[Any]:
        return self.runner.addresses

    async def stop(self, drain_s: float) -> int:
        """Stops taking connections, gives the requests in flight up to `drain_s` seconds to
        finish, then cuts the rest; returns how many were cut."""
        self.drain.draining = True
        for site in self.runner.sites:
            await site.stop()
        if self.drain.active:
            log.info("router_draining", in_flight=self.drain.active, timeout_s=drain_s)
            started = asyncio.get_running_loop().time()
            await self.drain.wait(drain_s)
            log.info(
                "router_drained",
                in_flight=self.drain.active,
                seconds=round(asyncio.get_running_loop().time() - started, 2),
            )
        cut = self.drain.active
        if cut:
            log.warning("router_stop_cut_requests", in_flight=cut)
        else:
            await asyncio.sleep(LINGER_S)
        await self.runner.cleanup()
        return cut


async def serve(app: web.Application, host: str, port: int) -> Serving:
    """Start `app` on host:port; the caller awaits forever, then `Serving.stop`."""
    drain = Drain()
    app.middlewares.append(drain.middleware)
    # handler_cancellation: a client that goes away cancels its handler, so dispatch stops at
    # once instead of at the next write. access_log=None: the middleware logs each request.
    runner = _Runner(app, handler_cancellation=True, access_log=None, shutdown_timeout=CUT_GRACE_S)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("router listening", host=host, port=port)
    return Serving(runner, drain)
