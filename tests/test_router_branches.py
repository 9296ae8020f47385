"""The branch API: headers and the body field `agent` -> the directory's branch counts (R_b).

Exact expectations on `KvDirectory.refcount` after each request. The dispatcher is the
deterministic stand-in of `router_helpers` (the real dispatch core comes after the front end);
server, client and directory are real.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from evolving_infra import KvDirectory, block_hashes
from evolving_infra.router import api
from evolving_infra.router.api import ApiError
from evolving_infra.router.branches import (
    MAX_BRANCH_ID,
    BranchEvent,
    BranchInfo,
    BranchTracker,
    parse_branch_info,
)
from router_helpers import PAGE, EchoDispatcher, Router, run_router

# Prompts as completion text (byte tokenizer: one token per byte, pages of PAGE bytes).
BASE = "system prompt, tools..."  # 23 bytes: 5 full pages
LONGER = BASE + " user: fix the bug"
COMPACTED = "summary of it all, then more"


def hashes(prompt: str) -> list[int]:
    return block_hashes(list(prompt.encode()), PAGE)


def counts(d: KvDirectory, prompt: str) -> list[int]:
    return [d.refcount(h) for h in hashes(prompt)]


def headers(branch: str, parent: str | None = None, event: str | None = None) -> dict[str, str]:
    out = {"X-Agent-Branch": branch}
    if parent is not None:
        out["X-Agent-Parent-Branch"] = parent
    if event is not None:
        out["X-Agent-Event"] = event
    return out


async def complete(
    r: Router, prompt: str, hdrs: Mapping[str, str] | None = None, **body: Any
) -> tuple[int, Any]:
    resp = await r.client.post(
        "/v1/completions", json={"model": "m", "prompt": prompt, **body}, headers=hdrs
    )
    return resp.status, await resp.json()


# -- parsing -----------------------------------------------------------------------------------


def test_branch_info_from_headers_or_body() -> None:
    assert parse_branch_info({}, None) is None
    assert parse_branch_info({}, {}) is None
    info = BranchInfo("b", "a", BranchEvent.FORK)
    assert parse_branch_info(headers("b", "a", "fork"), None) == info
    assert parse_branch_info({}, {"branch": "b", "parent": "a", "event": "fork"}) == info
    # Merged field by field; equal values in both places are fine.
    assert parse_branch_info(headers("b"), {"branch": "b", "parent": "a", "event": "FORK"}) == info
    end = BranchInfo("b", None, BranchEvent.END)
    assert parse_branch_info(headers("b", event="end"), None) == end


@pytest.mark.parametrize(
    ("hdrs", "agent", "code", "param"),
    [
        (headers("b"), {"branch": "c"}, api.BRANCH_CONFLICT, "agent.branch"),
        (headers("b", "a"), {"parent": "z"}, api.BRANCH_CONFLICT, "agent.parent"),
        (headers("b", event="end"), {"event": "fork"}, api.BRANCH_CONFLICT, "agent.event"),
        ({}, {"parent": "a"}, api.INVALID_VALUE, "agent.branch"),
        ({"X-Agent-Event": "end"}, None, api.INVALID_VALUE, "agent.branch"),
        (headers("b", event="fork"), None, api.INVALID_VALUE, "agent.parent"),
        (headers("b", event="merge"), None, api.INVALID_VALUE, "agent.event"),
        (headers("b", "b"), None, api.INVALID_VALUE, "agent.parent"),
        (headers(""), None, api.INVALID_VALUE, "agent.branch"),
        (headers("x" * (MAX_BRANCH_ID + 1)), None, api.INVALID_VALUE, "agent.branch"),
        ({}, {"branch": "a\nb"}, api.INVALID_VALUE, "agent.branch"),
        ({}, {"branch": 7}, api.INVALID_VALUE, "agent.branch"),
        ({}, {"branch": "b", "kind": "fork"}, api.INVALID_VALUE, "agent.kind"),
    ],
)
def test_bad_branch_info_is_400(
    hdrs: dict[str, str], agent: dict[str, Any] | None, code: str, param: str
) -> None:
    with pytest.raises(ApiError) as e:
        parse_branch_info(hdrs, agent)
    assert (e.value.status, e.value.code, e.value.param) == (400, code, param)


def test_repeated_header_with_different_values_is_400() -> None:
    async def test(r: Router) -> None:
        resp = await r.client.post(
            "/v1/completions",
            json={"model": "m", "prompt": BASE},
            headers=[("X-Agent-Branch", "a"), ("X-Agent-Branch", "b")],
        )
        assert resp.status == 400
        body = await resp.json()
        assert body["error"]["code"] == api.BRANCH_CONFLICT
        assert r.tracker.live == 0

    run_router(test)


def test_header_body_conflict_over_http_is_400_and_changes_nothing() -> None:
    async def test(r: Router) -> None:
        status, body = await complete(r, BASE, headers("main"), agent={"branch": "other"})
        assert status == 400
        assert body["error"]["code"] == api.BRANCH_CONFLICT
        assert "X-Agent-Branch" in body["error"]["message"]
        assert counts(r.directory, BASE) == [0] * 5
        assert r.tracker.live == 0
        assert r.dispatcher.seen == []

    run_router(test)


# -- directory counts over HTTP ----------------------------------------------------------------


def test_requests_on_a_branch_set_its_context() -> None:
    async def test(r: Router) -> None:
        d = r.directory
        assert (await complete(r, BASE, headers("main")))[0] == 200
        assert counts(d, BASE) == [1] * 5
        assert r.dispatcher.seen[0].branch == "main"
        assert r.dispatcher.seen[0].branch_info == BranchInfo("main")
        # The next turn extends the context: the branch still counts once per block.
        status, _ = await complete(r, LONGER, agent={"branch": "main"})
        assert status == 200
        assert counts(d, LONGER) == [1] * len(hashes(LONGER))
        # Another agent with the same system prompt shares its blocks.
        assert (await complete(r, BASE, headers("other")))[0] == 200
        assert counts(d, LONGER) == [2] * 5 + [1] * (len(hashes(LONGER)) - 5)
        assert r.tracker.live == 2
        assert r.tracker.anonymous_live == 0

    run_router(test)


def test_fork_copies_the_parent_and_unknown_parent_is_404() -> None:
    async def test(r: Router) -> None:
        d = r.directory
        assert (await complete(r, LONGER, headers("main")))[0] == 200
        status, body = await complete(r, LONGER + " try A", headers("f1", "ghost", "fork"))
        assert status == 404
        assert body["error"]["code"] == api.UNKNOWN_BRANCH
        assert "ghost" in body["error"]["message"]
        assert "f1" not in r.tracker
        fork = LONGER + " try A"
        assert (await complete(r, fork, headers("f1", "main", "fork")))[0] == 200
        n_shared = len(hashes(LONGER))
        assert counts(d, fork)[:n_shared] == [2] * n_shared
        assert counts(d, fork)[n_shared:] == [1] * (len(hashes(fork)) - n_shared)
        # Retrying the fork (same parent) is no error; another parent is a conflict.
        assert (await complete(r, fork, headers("f1", "main", "fork")))[0] == 200
        assert (await complete(r, BASE, headers("side")))[0] == 200
        before = counts(d, fork)
        status, body = await complete(r, fork, headers("f1", "side", "fork"))
        assert status == 409
        assert body["error"]["code"] == api.BRANCH_EXISTS
        assert counts(d, fork) == before

    run_router(test)


def test_with_replicas_a_moved_tree_is_adopted_not_refused() -> None:
    """A replica that never saw a tree (the front moved it from one that died) starts a fork of
    an unknown parent, or a compaction of an unknown branch, from the request's own prompt."""

    async def test(r: Router) -> None:
        r.tracker.adopt_unknown = True
        d = r.directory
        fork = LONGER + " try A"
        assert (await complete(r, fork, headers("f1", "ghost", "fork")))[0] == 200
        assert "f1" in r.tracker
        assert counts(d, fork) == [1] * len(hashes(fork))
        # Its retry is the same fork; another parent is still a conflict.
        assert (await complete(r, fork, headers("f1", "ghost", "fork")))[0] == 200
        assert (await complete(r, fork, headers("f1", "other", "fork")))[0] == 409
        status, _ = await complete(r, COMPACTED, headers("lost", event="compaction"))
        assert status == 200
        assert counts(d, COMPACTED) == [1] * len(hashes(COMPACTED))

    run_router(test)


def test_compaction_drops_the_old_history() -> None:
    async def test(r: Router) -> None:
        d = r.directory
        assert (await complete(r, LONGER, headers("main")))[0] == 200
        assert (await complete(r, LONGER, headers("keep")))[0] == 200
        assert counts(d, LONGER) == [2] * len(hashes(LONGER))
        status, _ = await complete(r, COMPACTED, headers("main", event="compaction"))
        assert status == 200
        assert counts(d, LONGER) == [1] * len(hashes(LONGER))  # only "keep" needs them now
        assert counts(d, COMPACTED) == [1] * len(hashes(COMPACTED))
        status, body = await complete(r, COMPACTED, headers("nobody", event="compaction"))
        assert status == 404
        assert body["error"]["code"] == api.UNKNOWN_BRANCH

    run_router(test)


def test_end_by_event_and_by_post() -> None:
    async def test(r: Router) -> None:
        d = r.directory
        assert (await complete(r, BASE, headers("a")))[0] == 200
        assert (await complete(r, LONGER, headers("b")))[0] == 200
        # The end event ends the branch once its response is done.
        assert (await complete(r, BASE, headers("a", event="end")))[0] == 200
        assert "a" not in r.tracker
        assert counts(d, BASE) == [1] * 5
        resp = await r.client.post("/v1/branches/b/end")
        assert resp.status == 200
        assert await resp.json() == {"branch": "b", "ended": True, "was_live": True}
        assert counts(d, LONGER) == [0] * len(hashes(LONGER))
        # Idempotent: ending again (a harness's retry), or a branch never seen, changes nothing.
        for branch in ("b", "never", "a%20b"):
            resp = await r.client.post(f"/v1/branches/{branch}/end")
            assert resp.status == 200
            body = await resp.json()
            assert body == {"branch": branch.replace("%20", " "), "ended": True, "was_live": False}
        resp = await r.client.post("/v1/branches/%0A/end")
        assert resp.status == 400
        assert r.tracker.live == 0
        metrics = r.metrics.render().decode()
        assert 'evolving_branch_events_total{event="end"} 2.0' in metrics

    run_router(test)


def test_anonymous_requests_hold_their_blocks_only_while_running() -> None:
    dispatcher = EchoDispatcher(delay=0.05)

    async def test(r: Router) -> None:
        pending = asyncio.create_task(complete(r, BASE))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if r.dispatcher.open:
                break
        assert r.tracker.anonymous_live == 1
        assert counts(r.directory, BASE) == [1] * 5  # the running request's blocks are needed
        assert isinstance(r.dispatcher.seen[0].branch, int)
        assert r.dispatcher.seen[0].branch_info is None
        assert (await pending)[0] == 200
        assert r.tracker.anonymous_live == 0
        assert counts(r.directory, BASE) == [0] * 5

    run_router(test, dispatcher=dispatcher)


def test_client_disconnect_mid_stream_ends_the_anonymous_branch() -> None:
    dispatcher = EchoDispatcher(default_tokens=200, delay=0.02)

    async def test(r: Router) -> None:
        resp = await r.client.post(
            "/v1/completions", json={"model": "m", "prompt": BASE, "stream": True}
        )
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"data: ")
        assert r.tracker.anonymous_live == 1
        resp.close()  # the client goes away mid-stream
        for _ in range(200):
            await asyncio.sleep(0.01)
            if r.dispatcher.closed:
                break
        assert r.dispatcher.open == 0  # dispatch was cancelled, not left generating
        assert r.tracker.anonymous_live == 0
        assert counts(r.directory, BASE) == [0] * 5
        text = r.metrics.render().decode()
        assert "evolving_client_disconnects_total 1.0" in text
        assert 'evolving_requests_total{route="/v1/completions",status="499"} 1.0' in text
        # The server goes on serving.
        r.dispatcher.delay = 0.0
        status, _ = await complete(r, BASE, headers("after"))
        assert status == 200

    run_router(test, dispatcher=dispatcher)


def test_failed_dispatch_leaves_no_anonymous_branch_and_keeps_named_ones() -> None:
    from evolving_infra.router.dispatcher import NoEngineError

    async def test(r: Router) -> None:
        status, _ = await complete(r, BASE)
        assert status == 503
        status, _ = await complete(r, LONGER, headers("main"))
        assert status == 503
        assert r.tracker.anonymous_live == 0
        # The named branch keeps its context: the harness retries the same prompt.
        assert counts(r.directory, LONGER) == [1] * len(hashes(LONGER))

    run_router(test, dispatcher=EchoDispatcher(fail=NoEngineError("all nodes draining")))


def test_branches_live_gauge() -> None:
    async def test(r: Router) -> None:
        for b in ("a", "b", "c"):
            assert (await complete(r, BASE, headers(b)))[0] == 200
        text = r.metrics.render().decode()
        assert 'evolving_branches_live{kind="named"} 3.0' in text
        assert 'evolving_branches_live{kind="anonymous"} 0.0' in text

    run_router(test)


# -- the tracker alone: expiry -----------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_idle_branches_expire_after_the_ttl() -> None:
    clock = Clock()
    d = KvDirectory()
    t = BranchTracker(d, ttl=10.0, clock=clock)
    events: list[str] = []
    t.on_event = events.append
    a = t.begin(BranchInfo("a"), hashes(BASE))
    t.finish(a)
    clock.now = 5.0
    b = t.begin(BranchInfo("b"), hashes(LONGER))  # b stays in flight
    clock.now = 10.5
    assert t.expire() == ["a"]  # idle 10.5 s > 10 s
    assert counts(d, BASE) == [1] * 5  # b still holds the shared system prompt
    clock.now = 100.0
    assert t.expire() == []  # b has a request running: never expired under it
    t.finish(b)
    clock.now = 109.0
    assert t.expire() == []
    clock.now = 110.5
    assert t.expire() == ["b"]
    assert counts(d, LONGER) == [0] * len(hashes(LONGER))
    assert t.live == 0
    assert events == ["expired", "expired"]
    # A finish after the branch is gone (ended or expired meanwhile) is harmless.
    c = t.begin(BranchInfo("c"), hashes(BASE))
    assert t.end("c")
    assert not t.end("c")  # idempotent
    t.finish(c)
    t.finish(c)
    assert t.live == 0
    with pytest.raises(ValueError, match="ttl"):
        BranchTracker(d, ttl=0)


def test_a_lease_carries_the_agents_think_time_since_its_last_answer() -> None:
    """The planner's closed loop counts the time between a branch's answer and its next
    request; a branch's first request, a fork's first and a request beside one in flight have
    none."""
    clock = Clock()
    t = BranchTracker(KvDirectory(), clock=clock)
    first = t.begin(BranchInfo("a"), hashes(BASE))
    assert first.think_s is None
    clock.now = 4.0
    t.finish(first)
    clock.now = 11.5
    second = t.begin(BranchInfo("a"), hashes(LONGER))
    assert second.think_s == 7.5
    beside = t.begin(BranchInfo("a"), hashes(LONGER))
    assert beside.think_s is None  # the agent is still waiting for `second`
    fork = t.begin(BranchInfo("b", parent="a", event=BranchEvent.FORK), hashes(LONGER))
    assert fork.think_s is None
    assert t.begin(None, hashes(BASE)).think_s is None  # anonymous: nobody to follow


def test_the_app_runs_expiry_in_the_background() -> None:
    clock = Clock()
    tracker = BranchTracker(KvDirectory(), ttl=5.0, clock=clock)

    async def test(r: Router) -> None:
        assert (await complete(r, BASE, headers("idle")))[0] == 200
        clock.now = 6.0
        for _ in range(100):
            await asyncio.sleep(0.01)
            if "idle" not in r.tracker:
                break
        assert "idle" not in r.tracker
        assert counts(r.directory, BASE) == [0] * 5

    run_router(test, tracker=tracker, expire_interval=0.01)


def test_disconnect_without_handler_cancellation_stops_at_the_next_write() -> None:
    """aiohttp's default server (no handler cancellation): the failed write ends the stream."""
    import aiohttp
    from aiohttp import web

    from evolving_infra.router.app import build_app
    from evolving_infra.router.metrics import RouterMetrics
    from evolving_infra.router.tokenize import ByteTokenizer

    dispatcher = EchoDispatcher(default_tokens=200, delay=0.01)
    tracker = BranchTracker(KvDirectory())

    async def main() -> None:
        metrics = RouterMetrics()
        app = build_app(dispatcher, tracker, ByteTokenizer(), metrics, page_size=PAGE)
        runner = web.AppRunner(app, handler_cancellation=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            host, port = runner.addresses[0][:2]
            async with aiohttp.ClientSession() as session:
                resp = await session.post(
                    f"http://{host}:{port}/v1/completions",
                    json={"model": "m", "prompt": BASE, "stream": True},
                )
                await resp.content.readuntil(b"\n\n")
                resp.close()
            for _ in range(300):
                await asyncio.sleep(0.01)
                if dispatcher.closed:
                    break
            assert dispatcher.open == 0
            assert tracker.anonymous_live == 0
            text = metrics.render().decode()
            assert "evolving_client_disconnects_total 1.0" in text
            assert 'evolving_requests_total{route="/v1/completions",status="499"} 1.0' in text
        finally:
            await runner.cleanup()

    asyncio.run(main())
