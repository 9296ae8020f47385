"""The front of router replicas (issue 29): one address for clients, each agent tree on one replica.

Clients talk to the front as to a router; it passes each request on, body and streamed answer
untouched, to one of the router replicas (`--routers`). Which one: the replica that rendezvous
hashing (highest random weight) ranks first for the request's *root branch*, among those whose
`/health` answers. The branch is read from the headers the router itself reads (`X-Agent-Branch`,
or the session headers harnesses send, `sessions.py`); a fork's child (`X-Agent-Event: fork` with
its parent) is mapped to its parent's root, so that a whole agent tree, parent and sub-agents,
lives on the replica that knows its branches. The child -> root map (`Roots`) is in memory,
bounded (`MAX_ROOTS`, oldest out), and with `--coordination` (the replicas' Redis) also in
Redis (`ROOT_TTL_S`), so that a restarted front, or a second front before the same replicas
(clients spread over both, or a load balancer in front of them), sends a child to its tree's
replica too. A branch Redis names no root for is remembered as a root for `ROOT_MISS_S` only:
its fork may have gone through another front a moment before. Without Redis, or while it
cannot be reached (logged once), the memory map alone answers; a child it does not know hashes
on its own id, and its replica adopts it (`branch_adopted`). Requests without a branch go to
the replica with the fewest requests in flight through this front. A branch given only in the
body's `agent` field is not read (the front does not parse bodies): such requests count as
anonymous here, and work, without the tree's affinity.

Rendezvous hashing moves only the trees of a replica that goes down (each to the replica that
ranks next for it) and moves them back when it returns. A replica that cannot be reached, or
that answers `503 shutting_down` (it drains for a stop or a restart and took nothing: its answer
says no engine saw the request), is skipped for the next in rank while nothing has been sent to
the client; the health poll (`HEALTH_INTERVAL_S`) takes it out for everyone. With no replica
left: `503 no_router` with `Retry-After`. A request whose replica dies mid-stream ends there, as
it would without a front.

The front's own `/health` (its view of the replicas) and `/metrics` (`evolving_front_*`); each
replica keeps its own `/metrics` at its own address.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from redis.exceptions import RedisError

from evolving_infra.router import api
from evolving_infra.router.api import ApiError
from evolving_infra.router.branches import BranchEvent, BranchInfo, parse_branch_info
from evolving_infra.router.metrics import CONTENT_TYPE
from evolving_infra.router.replicas import Outage
from evolving_infra.router.sessions import session_branch

log = structlog.get_logger(__name__)

HEALTH_INTERVAL_S = 1.0
MAX_ROOTS = 1_000_000  # child -> root entries kept (~200 bytes each)
ROOT_TTL_S = 86_400  # a child -> root entry in Redis lasts a day after its fork
ROOT_MISS_S = 5.0  # a branch Redis names no root for is taken for a root this long
ROOT_PREFIX = "evolving:front:root:"
RETRY_AFTER_S = 2
# Not passed on: hop-by-hop headers (RFC 9110 §7.6.1), and what aiohttp sets itself.
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
    )
)  # fmt: skip


@dataclass
class Replica:
    url: str  # http://host:port, no trailing slash
    up: bool = True  # as the last health poll found it (optimistic until the first)
    in_flight: int = 0


def weight(replica: str, key: str) -> int:
    """Rendezvous hashing's weight of `replica` for `key`."""
    digest = hashlib.blake2b(f"{replica}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Roots:
    """Each forked branch's root branch: in memory (bounded, oldest out), and in Redis when
    `client` (a `redis.asyncio.Redis`) is given, shared with other fronts and restarts."""

    def __init__(
        self,
        max_roots: int = MAX_ROOTS,
        client: Any = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_roots = max_roots
        self.client = client
        self.clock = clock
        # branch -> (root, until): until is None for what a fork taught, else when a miss in
        # Redis ("a root") is to be asked again.
        self._known: OrderedDict[str, tuple[str, float | None]] = OrderedDict()
        self._outage = Outage("front_roots_unreachable", "front")

    async def root(self, info: BranchInfo | None) -> str | None:
        """The root branch of `info`'s tree, learning it from a fork (None: anonymous)."""
        if info is None:
            return None
        if info.event is BranchEvent.FORK and info.parent is not None:
            root = await self._lookup(info.parent)
            self._remember(info.branch, root, None)
            await self._share(info.branch, root)
            return root
        return await self._lookup(info.branch)

    async def _lookup(self, branch: str) -> str:
        hit = self._known.get(branch)
        if hit is not None and (hit[1] is None or hit[1] > self.clock()):
            self._known.move_to_end(branch)
            return hit[0]
        if self.client is None:
            return branch
        try:
            shared = await self.client.get(ROOT_PREFIX + branch)
        except (RedisError, OSError) as e:
            self._outage.failed(e)
            return branch
        self._outage.ended()
        if shared is None:
            self._remember(branch, branch, self.clock() + ROOT_MISS_S)
            return branch
        root = bytes(shared).decode()
        self._remember(branch, root, None)
        return root

    def _remember(self, branch: str, root: str, until: float | None) -> None:
        self._known[branch] = (root, until)
        self._known.move_to_end(branch)
        while len(self._known) > self.max_roots:
            self._known.popitem(last=False)

    async def _share(self, branch: str, root: str) -> None:
        if self.client is None:
            return
        try:
            await self.client.set(ROOT_PREFIX + branch, root, ex=ROOT_TTL_S)
        except (RedisError, OSError) as e:
            self._outage.failed(e)
        else:
            self._outage.ended()


class Front:
    """The replicas, their health, the roots of forked branches, and the proxy handler."""

    def __init__(
        self, routers: Sequence[str], *, max_roots: int = MAX_ROOTS, coordination: Any = None
    ) -> None:
        """`coordination`: a `redis.asyncio.Redis` to share the roots in (`Roots`)."""
        if not routers:
            raise ValueError("the front needs at least one router replica")
        self.replicas = [Replica(u.rstrip("/")) for u in routers]
        self.roots = Roots(max_roots, coordination)
        self.session: aiohttp.ClientSession | None = None
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "evolving_front_requests",
            "Requests passed on, by replica and outcome (answered: the replica answered, with"
            " any status; unreachable: it could not be reached, draining: it answered 503"
            " shutting_down; both: the next replica was tried)",
            ["replica", "outcome"],
            registry=r,
        )
        self.no_router = Counter(
            "evolving_front_no_router",
            "Requests answered 503 because no replica could be reached",
            registry=r,
        )
        up = Gauge("evolving_front_replicas_up", "Replicas whose /health answers", registry=r)
        up.set_function(lambda: sum(x.up for x in self.replicas))

    # -- choosing a replica -----------------------------------------------------------------

    def ranked(self, key: str | None) -> list[Replica]:
        """The replicas to try, in order: up ones first (by weight for `key`, or fewest in
        flight without one), then those the health poll found down (it may be stale)."""

        def rank(r: Replica) -> tuple[bool, int]:
            return (not r.up, -weight(r.url, key) if key is not None else r.in_flight)

        return sorted(self.replicas, key=rank)

    # -- the proxy ---------------------------------------------------------------------------

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        try:
            info = parse_branch_info(request.headers, None) or session_branch(request.headers)
        except ApiError as e:  # the router would refuse it the same way
            return web.json_response(e.body(), status=e.status)
        key = await self.roots.root(info)
        body = await request.read()
        headers = _passed(request.headers)
        assert self.session is not None, "the front's session starts with the app"
        for replica in self.ranked(key):
            url = f"{replica.url}{request.rel_url}"
            replica.in_flight += 1
            try:
                try:
                    upstream = await self.session.request(
                        request.method, url, data=body, headers=headers, allow_redirects=False
                    )
                except aiohttp.ClientConnectionError as e:  # nothing sent yet: the next one
                    replica.up = False
                    self.requests.labels(replica.url, "unreachable").inc()
                    log.warning("front_replica_unreachable", replica=replica.url, error=str(e))
                    continue
                async with upstream:
                    # A 503 is read whole: a drain's is taken by nobody, and the next replica
                    # takes it; any other (no engine up...) is the client's answer.
                    refused = await upstream.read() if upstream.status == 503 else None
                    if refused is not None and _draining(refused):
                        replica.up = False
                        self.requests.labels(replica.url, "draining").inc()
                        continue
                    self.requests.labels(replica.url, "answered").inc()
                    if refused is not None:
                        return self._answer(upstream, refused)
                    # From here a failure ends the answer, as it would without a front.
                    return await self._relay(request, upstream)
            finally:
                replica.in_flight -= 1
        self.no_router.inc()
        error = ApiError(503, "no router replica can be reached", code="no_router")
        return web.json_response(
            error.body(), status=503, headers={"Retry-After": str(RETRY_AFTER_S)}
        )

    def _answer(self, upstream: aiohttp.ClientResponse, body: bytes) -> web.Response:
        """An answer already read (a 503 that was not a drain's), passed on as it was."""
        return web.Response(status=upstream.status, body=body, headers=_passed(upstream.headers))

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        out = web.StreamResponse(
            status=upstream.status,
            reason=upstream.reason,
            headers=_passed(upstream.headers),
        )
        if upstream.content_length is not None:
            out.content_length = upstream.content_length
        await out.prepare(request)
        async for chunk in upstream.content.iter_any():
            await out.write(chunk)
        await out.write_eof()
        return out

    # -- the front's own routes ----------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        up = sum(r.up for r in self.replicas)
        return web.json_response(
            {
                "status": "ok" if up == len(self.replicas) else "degraded" if up else "down",
                "replicas": {r.url: "up" if r.up else "down" for r in self.replicas},
            },
            status=200 if up else 503,
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE}
        )

    async def poll_health(self, interval: float = HEALTH_INTERVAL_S) -> None:
        """Every `interval`: each replica is up when its `/health` answers 200."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=max(interval, 0.5))
        while True:
            await asyncio.gather(*(self._check(r, timeout) for r in self.replicas))
            await asyncio.sleep(interval)

    async def _check(self, r: Replica, timeout: aiohttp.ClientTimeout) -> None:
        assert self.session is not None
        try:
            async with self.session.get(f"{r.url}/health", timeout=timeout) as resp:
                up = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            up = False
        if up != r.up:
            log.info("front_replica_up" if up else "front_replica_down", replica=r.url)
        r.up = up


def _passed(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers passed on, either way: all but the hop-by-hop ones."""
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


def _draining(body: bytes) -> bool:
    """Whether a replica's 503 is its drain's `shutting_down` (OpenAI error JSON)."""
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == api.SHUTTING_DOWN


def build_front(front: Front, *, max_body_bytes: int = 32 * 2**20) -> web.Application:
    """The front's aiohttp app: `/health`, `/metrics`, everything else passed on."""
    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_get("/health", front.health)
    app.router.add_get("/metrics", front.metrics)
    app.router.add_route("*", "/{tail:.*}", front.proxy)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        # No total timeout: an answer streams for as long as its generation runs.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=2.0)
        front.session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        poll = asyncio.create_task(front.poll_health())
        yield
        poll.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poll
        await front.session.close()

    app.cleanup_ctx.append(lifecycle)
    return app
