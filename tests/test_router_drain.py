"""A stopping router drains (`router/server.py`: `serve`, `Serving.stop`, `Drain`): requests in
flight finish, new connections are refused, a request on a kept-alive connection gets `503
shutting_down` in OpenAI's shape, and `cut()` ends the wait. A small app on the real server
stack: the front end's middleware is not needed for the drain itself, so errors are answered
by a stand-in that shapes `ApiError`s as the front end does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from evolving_infra.ports import free_ports
from evolving_infra.router import api
from evolving_infra.router.api import ApiError
from evolving_infra.router.server import Serving, serve


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Any]) -> Any:
    try:
        return await handler(request)
    except ApiError as e:
        return web.json_response(e.body(), status=e.status, headers=e.headers)


async def _started(seconds: float) -> tuple[Serving, str, asyncio.Event]:
    """A server whose /slow answers after `seconds`; the event is set when one has begun."""
    begun = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        begun.set()
        await asyncio.sleep(seconds)
        return web.json_response({"ok": True})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="m 1\n")

    app = web.Application(middlewares=[_errors])
    app.router.add_post("/slow", slow)
    app.router.add_get("/metrics", metrics)
    port = free_ports(1)[0]
    serving = await serve(app, "127.0.0.1", port)
    return serving, f"http://127.0.0.1:{port}", begun


def test_requests_in_flight_finish_and_new_ones_are_refused() -> None:
    async def main() -> None:
        serving, url, begun = await _started(1.0)
        async with aiohttp.ClientSession() as a, aiohttp.ClientSession() as b:
            # b's connection is kept alive from a first request, before the stop.
            async with b.get(f"{url}/metrics") as r:
                assert r.status == 200
            flight = asyncio.create_task(a.post(f"{url}/slow"))
            await begun.wait()
            stop = asyncio.create_task(serving.stop(30.0))
            await asyncio.sleep(0.1)
            # On the kept-alive connection: a typed 503 asking for the request again.
            async with b.post(f"{url}/slow") as r:
                assert r.status == 503
                assert r.headers["Retry-After"] == "1"
                assert (await r.json())["error"]["code"] == api.SHUTTING_DOWN
            # A new connection: nothing listens any more.
            async with aiohttp.ClientSession() as c:
                with pytest.raises(aiohttp.ClientConnectorError):
                    await c.post(f"{url}/slow")
            resp = await flight
            assert resp.status == 200
            assert await resp.json() == {"ok": True}
            assert await stop == 0  # none cut

    asyncio.run(main())


def test_cut_ends_the_drain_and_cuts_what_is_left() -> None:
    async def main() -> None:
        serving, url, begun = await _started(60.0)
        async with aiohttp.ClientSession() as a:
            flight = asyncio.create_task(a.post(f"{url}/slow"))
            await begun.wait()
            stop = asyncio.create_task(serving.stop(60.0))
            await asyncio.sleep(0.2)
            assert not stop.done()  # draining: the request has 60 s
            serving.drain.cut()
            assert await asyncio.wait_for(stop, 10) == 1
            with pytest.raises(aiohttp.ClientError):
                await flight

    asyncio.run(main())
