"""The front of router replicas (`router.front`): real router front ends (aiohttp on loopback, with
the echo dispatcher of `router_helpers`) behind a real front. Each agent tree stays on one
replica, forks follow their parent, streams pass through untouched, a replica that goes away
hands its trees to the others, and with none left the client gets 503 with Retry-After."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis
from aiohttp.test_utils import TestClient, TestServer

from evolving_infra import KvDirectory
from evolving_infra.router.app import build_app
from evolving_infra.router.branches import BranchTracker
from evolving_infra.router.dispatcher import NoEngineError, ShuttingDownError
from evolving_infra.router.front import Front, build_front, weight
from evolving_infra.router.metrics import RouterMetrics
from evolving_infra.router.tokenize import ByteTokenizer
from redis_helpers import redis_server
from router_helpers import PAGE, EchoDispatcher, parse_sse

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 2}


@dataclass
class Setup:
    client: TestClient[Any, Any]  # to the front
    front: Front
    replicas: list[TestServer]
    dispatchers: list[EchoDispatcher]

    def served_by(self, branch: str) -> list[int]:
        """Which replicas saw requests of `branch`."""
        return [
            i
            for i, d in enumerate(self.dispatchers)
            if any(r.branch_info and r.branch_info.branch == branch for r in d.seen)
        ]


def run_front(test: Callable[[Setup], Awaitable[None]], replicas: int = 2) -> None:
    async def main() -> None:
        servers, dispatchers = [], []
        for _ in range(replicas):
            d = EchoDispatcher()
            app = build_app(
                d, BranchTracker(KvDirectory()), ByteTokenizer(), RouterMetrics(), page_size=PAGE
            )
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            servers.append(server)
            dispatchers.append(d)
        front = Front([str(s.make_url("")) for s in servers])
        async with TestClient(TestServer(build_front(front), host="127.0.0.1")) as client:
            await test(Setup(client, front, servers, dispatchers))
        for s in servers:
            await s.close()

    asyncio.run(main())


async def chat(s: Setup, headers: dict[str, str], stream: bool = False) -> Any:
    resp = await s.client.post(
        "/v1/chat/completions", json={**CHAT, "stream": stream}, headers=headers
    )
    assert resp.status == 200, await resp.text()
    return await (resp.text() if stream else resp.json())


def test_each_agent_tree_stays_on_one_replica_and_trees_spread() -> None:
    async def test(s: Setup) -> None:
        roots = [f"agent-{i}" for i in range(24)]
        for root in roots:
            await chat(s, {"X-Agent-Branch": root})
            fork = {"X-Agent-Branch": f"{root}/sub", "X-Agent-Parent-Branch": root,
                    "X-Agent-Event": "fork"}  # fmt: skip
            await chat(s, fork)
            await chat(s, {"X-Agent-Branch": f"{root}/sub"})  # the child again, no parent
            await chat(s, {"X-Agent-Branch": root})
        homes = []
        for root in roots:
            [home] = s.served_by(root)
            assert s.served_by(f"{root}/sub") == [home]
            homes.append(home)
        assert set(homes) == {0, 1}  # the trees spread over both
        # The home is rendezvous hashing's pick.
        urls = [r.url for r in s.front.replicas]
        for root, home in zip(roots, homes, strict=True):
            assert max(range(2), key=lambda i: weight(urls[i], root)) == home
        # Session headers of an unmodified harness name the branch too.
        await chat(s, {"X-Claude-Code-Session-Id": "s1"})
        assert len(s.served_by("claude-code:s1")) == 1

    run_front(test)


def test_streams_and_errors_pass_through_untouched() -> None:
    async def test(s: Setup) -> None:
        text = await chat(s, {"X-Agent-Branch": "b"}, stream=True)
        events = parse_sse(text)
        assert events[-1] == "[DONE]"
        bad = await s.client.post("/v1/chat/completions", data=b"{", headers={
            "Content-Type": "application/json"})  # fmt: skip
        assert bad.status == 400
        assert (await bad.json())["error"]["code"] == "invalid_json"
        # A bad branch header is refused at the front as the router refuses it.
        conflict = await s.client.post(
            "/v1/chat/completions", json=CHAT,
            headers={"X-Agent-Branch": "b", "X-Agent-Parent-Branch": "b"},
        )  # fmt: skip
        assert conflict.status == 400
        models = await s.client.get("/v1/models")
        assert models.status == 200
        health = await (await s.client.get("/health")).json()
        assert health["status"] == "ok"
        assert len(health["replicas"]) == 2

    run_front(test)


def test_a_replica_that_goes_away_hands_its_trees_over_then_503() -> None:
    async def test(s: Setup) -> None:
        roots = [f"agent-{i}" for i in range(12)]
        for root in roots:
            await chat(s, {"X-Agent-Branch": root})
        gone = s.served_by(roots[0])[0]
        moved = [r for r in roots if s.served_by(r) == [gone]]
        await s.replicas[gone].close()
        for d in s.dispatchers:
            d.seen.clear()
        for root in roots:  # every request still answered: unreachable -> the next in rank
            await chat(s, {"X-Agent-Branch": root})
        assert all(s.served_by(r) == [1 - gone] for r in roots)
        metrics = (await (await s.client.get("/metrics")).read()).decode()
        assert "evolving_front_requests_total" in metrics
        assert 'outcome="unreachable"' in metrics
        assert moved  # some trees did live there
        await s.replicas[1 - gone].close()
        resp = await s.client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "2"
        assert (await resp.json())["error"]["code"] == "no_router"
        health = await s.client.get("/health")
        assert health.status == 503

    run_front(test)


def test_a_draining_replicas_refusal_goes_to_the_next_replica() -> None:
    """A replica that stops answers new requests 503 shutting_down (no engine saw them): the
    front sends them on to the next replica instead of failing them; another 503 is relayed."""

    async def test(s: Setup) -> None:
        roots = [f"agent-{i}" for i in range(8)]
        for root in roots:
            await chat(s, {"X-Agent-Branch": root})
        stopping = s.served_by(roots[0])[0]
        s.dispatchers[stopping].fail = ShuttingDownError("the router is stopping")
        for d in s.dispatchers:
            d.seen.clear()
        for root in roots:  # each answered 200 (`chat` checks), by the other replica
            await chat(s, {"X-Agent-Branch": root})
        assert all(1 - stopping in s.served_by(r) for r in roots)
        metrics = (await (await s.client.get("/metrics")).read()).decode()
        assert 'outcome="draining"' in metrics
        # Any other 503 (no engine up, say) is the client's answer, passed on as it was.
        for d in s.dispatchers:
            d.fail = NoEngineError("no decode engine is up")
        resp = await s.client.post("/v1/chat/completions", json=CHAT)
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] != "no_router"

    run_front(test)


def test_anonymous_requests_go_to_the_least_busy_replica() -> None:
    async def test(s: Setup) -> None:
        for d in s.dispatchers:
            d.delay = 0.05
        await asyncio.gather(*(chat(s, {}) for _ in range(6)))
        assert all(len(d.seen) >= 2 for d in s.dispatchers), [len(d.seen) for d in s.dispatchers]

    run_front(test)


def test_fronts_sharing_redis_send_a_child_to_its_tree_across_fronts_and_restarts() -> None:
    """Two fronts over the same replicas and one real Redis: a fork seen by one front sends
    the child's later requests through the other (and through a front started afresh) to its
    tree's replica; with Redis gone each front still answers from its own memory."""

    async def main() -> None:
        with redis_server() as server:
            servers, dispatchers = [], []
            for _ in range(3):
                d = EchoDispatcher()
                app = build_app(
                    d, BranchTracker(KvDirectory()), ByteTokenizer(), RouterMetrics(),
                    page_size=PAGE,
                )  # fmt: skip
                ts = TestServer(app, host="127.0.0.1")
                await ts.start_server()
                servers.append(ts)
                dispatchers.append(d)
            urls = [str(t.make_url("")) for t in servers]
            clients: list[aredis.Redis] = []

            def front() -> TestClient[Any, Any]:
                clients.append(aredis.from_url(server.url))
                front = Front(urls, coordination=clients[-1])
                return TestClient(TestServer(build_front(front)))

            def home(branch: str) -> list[int]:
                return [
                    i
                    for i, d in enumerate(dispatchers)
                    if any(r.branch_info and r.branch_info.branch == branch for r in d.seen)
                ]

            async def post(c: TestClient[Any, Any], headers: dict[str, str]) -> None:
                resp = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
                assert resp.status == 200, await resp.text()

            roots = [f"agent-{i}" for i in range(12)]
            async with front() as a, front() as b:
                for root in roots:
                    await post(a, {"X-Agent-Branch": root})
                    await post(a, {"X-Agent-Branch": f"{root}/sub", "X-Agent-Event": "fork",
                                   "X-Agent-Parent-Branch": root})  # fmt: skip
                    await post(b, {"X-Agent-Branch": f"{root}/sub"})  # through the other front
                    # A grandchild forked through the other front: still the root's tree.
                    await post(b, {"X-Agent-Branch": f"{root}/sub/x", "X-Agent-Event": "fork",
                                   "X-Agent-Parent-Branch": f"{root}/sub"})  # fmt: skip
                for root in roots:
                    [h] = home(root)
                    assert home(f"{root}/sub") == [h]
                    assert home(f"{root}/sub/x") == [h]
                # Children whose own id would hash elsewhere: the map, not luck, kept them home.
                assert any(
                    max(range(3), key=lambda i: weight(urls[i], f"{r}/sub")) != home(r)[0]
                    for r in roots
                )
            for d in dispatchers:
                d.seen.clear()
            async with front() as fresh:  # a front restarted: it knows nothing itself
                for root in roots:
                    await post(fresh, {"X-Agent-Branch": f"{root}/sub"})
                    await post(fresh, {"X-Agent-Branch": root})
                    assert home(f"{root}/sub") == home(root)
                server.kill()  # Redis gone: what this front learnt still holds, all answered
                for root in roots:
                    await post(fresh, {"X-Agent-Branch": f"{root}/sub"})
                    assert len(home(f"{root}/sub")) == 1
                await post(fresh, {"X-Agent-Branch": "new-root"})
            for t in servers:
                await t.close()
            for c in clients:
                await c.aclose()

    asyncio.run(main())
