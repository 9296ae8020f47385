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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from evolving_infra.router import api
from evolving_infra.router.api import ApiError

log = structlog.get_logger("evolving_infra.router.server")

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


async def serve(
    app: web.Application, host: str, port: int, shutdown_timeout: float = 5.0
) -> web.AppRunner:
    """Start `app` on host:port; the caller awaits forever, then `runner.cleanup()`, which
    gives requests in flight `shutdown_timeout` seconds before cutting them."""
    # handler_cancellation: a client that goes away cancels its handler, so dispatch stops at
    # once instead of at the next write. access_log=None: the middleware logs each request.
    runner = _Runner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout
    )
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("router listening", host=host, port=port)
    return runner
