"""Router replicas' leader lease (`router.replicas`) on a real Redis server: one leader at a time,
epochs that only grow, a crashed leader replaced once its lease expires (and stepping down by
its own clock before that), a clean stop handing over at once, a lost Redis deposing the leader;
and two replicas' planners over real simulated engines: only the leader decides, a new leader
fences the engines first, and a deposed leader's switch is refused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import redis.asyncio as aredis

from evolving_infra.control import EngineClient, serve
from evolving_infra.engines.sim import SimEngine
from evolving_infra.planner.base import Split
from evolving_infra.planner.slices import Slices
from evolving_infra.router.admission import DecodeGate
from evolving_infra.router.loads import EngineHandle, LoadTracker
from evolving_infra.router.planning import LivePlanner
from evolving_infra.router.registry import EngineRegistry
from evolving_infra.router.replicas import (
    EXPIRE_INTERVALS,
    Board,
    LeaderLease,
    LoadExchange,
    SharedFeed,
    shared_tails,
)
from evolving_infra.timing.model import IterationModel
from redis_helpers import redis_server
from test_engine_sim_helpers import settings
from test_router_planning import FixedTarget

TTL = 0.6


def leases(url: str, *names: str) -> list[LeaderLease]:
    return [LeaderLease(aredis.from_url(url), n, ttl_s=TTL) for n in names]


async def closed(*of: LeaderLease) -> None:
    for lease in of:
        await lease.client.aclose()


def test_one_leader_at_a_time_with_growing_epochs() -> None:
    async def main(url: str) -> None:
        a, b, c = leases(url, "a", "b", "c")
        changes: list[tuple[bool, int]] = []
        a.on_change = lambda leader, epoch: changes.append((leader, epoch))
        assert await a.attempt()
        assert not await b.attempt()
        assert not await c.attempt()
        assert (a.is_leader, b.is_leader, c.is_leader) == (True, False, False)
        assert a.epoch == 1
        assert await a.attempt()  # a renewal keeps the epoch
        assert a.epoch == 1
        assert await b.holder() == ("a", 1)
        await a.release()
        assert not a.is_leader
        assert changes == [(True, 1), (False, 1)]
        assert await b.attempt()  # at once: no expiry to wait for
        assert b.epoch == 2
        assert not await a.attempt()
        assert await c.holder() == ("b", 2)
        await closed(a, b, c)

    with redis_server() as server:
        asyncio.run(main(server.url))


def test_a_crashed_leader_is_replaced_after_its_lease_and_stepped_down_before() -> None:
    async def main(url: str) -> None:
        a, b = leases(url, "a", "b")
        assert await a.attempt()
        # a crashes: no renewal, no release. b keeps trying, as its run loop does.
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not await b.attempt():
            assert loop.time() - start < 3 * TTL, "the lease never expired"
            await asyncio.sleep(TTL / 10)
        waited = loop.time() - start
        assert TTL * 0.8 < waited < TTL + 0.3
        assert b.epoch == 2
        assert not a.is_leader  # by its own clock, before the key could go to b
        await closed(a, b)

    with redis_server() as server:
        asyncio.run(main(server.url))


def test_losing_redis_deposes_the_leader() -> None:
    async def main(server_kill: object, url: str) -> None:
        [a] = leases(url, "a")
        assert await a.attempt()
        assert callable(server_kill)
        server_kill()
        assert not await a.attempt()
        assert not a.is_leader
        await a.release()  # unreachable: nothing to do, no error
        await closed(a)

    with redis_server() as server:
        asyncio.run(main(server.kill, server.url))


def test_the_run_loop_keeps_the_lease_and_hands_it_over_when_cancelled() -> None:
    async def main(url: str) -> None:
        a, b = leases(url, "a", "b")
        task = asyncio.create_task(a.run())
        await asyncio.sleep(3 * TTL)  # several renewals
        assert a.is_leader
        assert not await b.attempt()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await a.release()
        assert await b.attempt()
        await closed(a, b)

    with redis_server() as server:
        asyncio.run(main(server.url))


def test_bad_arguments_are_refused() -> None:
    client = aredis.Redis()
    with pytest.raises(ValueError, match="ttl_s"):
        LeaderLease(client, "a", ttl_s=0)
    with pytest.raises(ValueError, match="replica name"):
        LeaderLease(client, "a b")


def test_only_the_leader_plans_and_a_deposed_leader_cannot_switch() -> None:
    """Two replicas' planners over the same two real simulated engines (gRPC), one lease."""

    async def scenario(url: str) -> None:
        engines = [SimEngine(settings(node_id=n, phase="prefill")) for n in (0, 1)]
        servers = []
        for e in engines:
            await e.start()
            servers.append(await serve(e, "127.0.0.1", 0))
        addresses = [f"127.0.0.1:{port}" for _, port in servers]
        lease_a, lease_b = leases(url, "a", "b")
        a = replica(addresses, lease_a, Split(1, 1))
        b = replica(addresses, lease_b, Split(2, 0))
        assert await lease_a.attempt()
        assert not await lease_b.attempt()
        for p in (a, b):
            p.tick(time.monotonic())  # a starts fencing; b does nothing
        await until(lambda: a.fenced == lease_a.epoch == 1)
        assert b.fenced == 0
        a.tick(time.monotonic())
        assert a.planner.asked == 1  # type: ignore[attr-defined]
        b.tick(time.monotonic())
        assert b.planner.asked == 0  # type: ignore[attr-defined]
        await until(lambda: len(a.switches) == 1)
        assert a.switches[0].ok
        assert engines[0].phase == "decode"
        # a dies (no renewal). b takes the lease once it expires, fences, then plans.
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not await lease_b.attempt():
            await asyncio.sleep(TTL / 10)
        assert loop.time() - start < TTL + 0.3
        assert lease_b.epoch == 2
        b.registry.set_phase(0, "decode")  # what its health loop learns
        b.tick(time.monotonic())
        await until(lambda: b.fenced == 2)
        # The deposed leader's late switch (its epoch, 1) is refused by the engine.
        await a._switch_one(1, "decode")
        assert not a.switches[-1].ok
        assert "stale" in a.switches[-1].reason
        assert engines[1].phase == "prefill"
        assert not lease_a.is_leader
        a.tick(time.monotonic())  # and, by its own clock, it no longer decides
        assert a.planner.asked == 1  # type: ignore[attr-defined]
        b.tick(time.monotonic())
        await until(lambda: len(b.switches) == 1)
        assert b.switches[0].ok
        assert [e.phase for e in engines] == ["prefill", "prefill"]
        for p in (a, b):
            for c in p.clients.values():
                await c.close()
        await closed(lease_a, lease_b)
        for (server, _), e in zip(servers, engines, strict=True):
            await server.stop(0)
            await e.close()

    with redis_server() as server:
        asyncio.run(scenario(server.url))


def replica(addresses: list[str], lease: LeaderLease, target: Split) -> LivePlanner:
    registry = EngineRegistry(
        [EngineHandle(n, "http://127.0.0.1:1", "prefill", "127.0.0.1", 1, 1000) for n in (0, 1)]
    )
    clients = {n: EngineClient(a) for n, a in enumerate(addresses)}
    planner = LivePlanner(registry, clients, IterationModel(), page_size=4, lease=lease)
    planner.planner = FixedTarget(target)  # type: ignore[assignment]
    return planner


async def until(done: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_replicas_count_each_others_work_until_it_expires() -> None:
    async def main(url: str) -> None:
        ta, tb = LoadTracker(), LoadTracker()
        a = LoadExchange(aredis.from_url(url), "a", ta, extra=lambda: {2: 50}, interval=0.05)
        b = LoadExchange(aredis.from_url(url), "b", tb, interval=0.05)
        ta.add_decode(1, blocks=100, context=4000, prompt_blocks=60)
        ta.add_prefill(0, seconds=1.5, tokens=3000, prompt_blocks=20)
        tb.add_decode(1, blocks=10, context=400, prompt_blocks=6)
        assert await a.exchange()
        assert await b.exchange()
        assert await a.exchange()
        assert (a.peers_seen, b.peers_seen) == (1, 1)
        # b counts a's work (and a's gate's commitments) with its own; a counts b's.
        assert tb.used_blocks(1) == 110
        assert tb.used_blocks(2) == 50
        assert tb.total(0).queued_prefill_s == 1.5
        assert tb.total(1).decode_requests == 2
        assert ta.used_blocks(1) == 110
        assert ta.used_blocks(2) == 0  # its own commitments are the gate's to count, not peers'
        engines = [EngineHandle(n, "", "decode", "", 0, 1000) for n in (1, 2)]
        assert [v.kv_used_blocks for v in tb.view(engines)] == [110, 50]
        # a dies: b stops counting its work once a's figures expire.
        await asyncio.sleep(0.05 * EXPIRE_INTERVALS + 0.1)
        assert await b.exchange()
        assert b.peers_seen == 0
        assert tb.used_blocks(1) == 10
        # A clean stop takes the figures out at once.
        assert await a.exchange()
        assert await b.exchange()
        assert tb.used_blocks(1) == 110
        await a.leave()
        assert await b.exchange()
        assert tb.used_blocks(1) == 10
        await a.board.client.aclose()
        await b.board.client.aclose()

    with redis_server() as server:
        asyncio.run(main(server.url))


def test_a_lost_redis_drops_the_peers_work_after_a_while() -> None:
    async def main(server_kill: Callable[[], None], url: str) -> None:
        ta, tb = LoadTracker(), LoadTracker()
        a = LoadExchange(aredis.from_url(url), "a", ta, interval=0.05)
        b = LoadExchange(aredis.from_url(url), "b", tb, interval=0.05)
        ta.add_decode(1, blocks=100, context=4000, prompt_blocks=60)
        assert await a.exchange()
        assert await b.exchange()
        assert tb.used_blocks(1) == 100
        server_kill()
        assert not await b.exchange()
        assert tb.used_blocks(1) == 100  # kept for a few intervals
        await asyncio.sleep(0.05 * EXPIRE_INTERVALS + 0.05)
        assert not await b.exchange()
        assert tb.used_blocks(1) == 0
        await a.board.client.aclose()
        await b.board.client.aclose()

    with redis_server() as server:
        asyncio.run(main(server.kill, server.url))


def test_every_replica_hints_every_replicas_live_branches() -> None:
    async def main(url: str) -> None:
        a = Board(aredis.from_url(url), "a", "tails")
        b = Board(aredis.from_url(url), "b", "tails")
        assert await shared_tails(a, [1, -(2**63), 2**63 - 1], 1.0) == {1, -(2**63), 2**63 - 1}
        assert await shared_tails(b, [5], 1.0) == {1, -(2**63), 2**63 - 1, 5}
        assert await shared_tails(a, [], 1.0) == {5}  # a's branches ended; b's still live
        await b.leave()
        assert await shared_tails(a, [7], 1.0) == {7}
        await a.client.aclose()
        await b.client.aclose()

    with redis_server() as server:
        asyncio.run(main(server.url))


def test_a_lost_renewal_answer_keeps_the_lease_and_its_epoch() -> None:
    async def main(url: str) -> None:
        [a] = leases(url, "a")
        assert await a.attempt()
        real = a._renew

        async def lost(**_: object) -> int:
            raise ConnectionError("answer lost")

        a._renew = lost
        assert not await a.attempt()
        assert not a.is_leader
        a._renew = real
        assert await a.attempt()  # the key was still a's: renewed, same epoch
        assert a.epoch == 1
        await closed(a)

    with redis_server() as server:
        asyncio.run(main(server.url))


def test_room_another_replica_frees_admits_the_requests_waiting_here() -> None:
    """The decode-KV gate of replica b holds a request while a's work fills the engine; once a's
    work is gone, b's exchange tells b's registry, and the gate admits at once (not at 60 s)."""

    async def main(url: str) -> None:
        ra, rb = EngineRegistry(), EngineRegistry()
        for r in (ra, rb):
            r.add(EngineHandle(0, "", "decode", "", 0, 1000))
        gate = DecodeGate(rb.decode_space, max_wait_s=60.0)
        rb.listen(gate.notify)
        a = LoadExchange(aredis.from_url(url), "a", ra.loads, interval=0.05)
        b = LoadExchange(aredis.from_url(url), "b", rb.loads, on_change=rb.changed, interval=0.05)
        ra.loads.add_decode(0, blocks=900, context=14_000, prompt_blocks=800)
        assert await a.exchange()
        assert await b.exchange()
        assert rb.loads.used_blocks(0) == 900
        waiting = asyncio.create_task(gate.wait(300, lambda extra: 0))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # 900 + 300 > 1000: held
        ra.loads.done_decode(0, blocks=900, context=14_000, prompt_blocks=800)
        assert await a.exchange()
        assert await b.exchange()
        assert await asyncio.wait_for(waiting, 1.0) == 0
        await a.board.client.aclose()
        await b.board.client.aclose()

    with redis_server() as server:
        asyncio.run(main(server.url))


def test_every_replicas_window_holds_every_replicas_arrivals() -> None:
    async def main(url: str) -> None:
        sa, sb = Slices(600.0, block_tokens=16), Slices(600.0, block_tokens=16)
        a = SharedFeed(sa, aredis.from_url(url), "a", clock=lambda: 100.0)
        b = SharedFeed(sb, aredis.from_url(url), "b", clock=lambda: 100.0)
        assert await a.exchange()
        assert await b.exchange()  # both read from now on
        chain = list(range(1000, 1000 + 64))
        a.arrival(1024, 512, 512, chain, 99.0, 12.0)
        a.tokens(40)
        a.prefilled(1024, 500)
        a.answered(0.5, 3.0)
        b.arrival(2048, 2048, 0, [7, 8], 99.5)
        assert await a.exchange()
        assert await b.exchange()
        assert await a.exchange()
        for s in (sa, sb):  # the same window on both
            assert (s.requests, s.prompt, s.uncached, s.cached) == (2, 3072, 2560, 512)
            assert (s.output, s.prefills, s.prefilled_uncached) == (40, 1, 500)
            # The closed loop's figures: a's think time, and the answer it saw.
            assert (s.think_n, s.think_sum) == (1, 12.0)
            assert (s.answered_n, s.ttft_sum, s.response_sum) == (1, 0.5, 3.0)
        assert (a.applied, b.applied) == (1, 4)
        # The reuse tracker saw a's chain on b at every 16th block: a later arrival of it on b
        # finds its whole sampled prefix seen (the age from b's clock at receipt).
        reuse = sb.reuse
        assert reuse is not None
        assert len(reuse) == len(chain[::16]) + 1
        assert reuse.observe(130.0, chain).runs == ((64 * 16, 30.0),)
        await a.client.aclose()
        await b.client.aclose()

    with redis_server() as server:
        asyncio.run(main(server.url))


def test_requests_waiting_on_one_replica_hold_no_room_on_another() -> None:
    """Only what a replica's gate admitted counts on the others: its waiting requests use no
    room, and counted, two replicas' queues would wait on each other until both shed."""

    async def main(url: str) -> None:
        ra, rb = EngineRegistry(), EngineRegistry()
        for r in (ra, rb):
            r.add(EngineHandle(0, "", "decode", "", 0, 1000))
        gate_a = DecodeGate(ra.decode_space, max_wait_s=60.0)
        gate_b = DecodeGate(rb.decode_space, max_wait_s=60.0)
        a = LoadExchange(aredis.from_url(url), "a", ra.loads, extra=gate_a.claimed, interval=0.05)
        b = LoadExchange(aredis.from_url(url), "b", rb.loads, extra=gate_b.claimed, interval=0.05)
        ra.loads.add_decode(0, blocks=300, context=4800, prompt_blocks=300)
        held = asyncio.create_task(gate_a.wait(800, lambda extra: 0))  # 300 + 800 > 1000
        await asyncio.sleep(0.05)
        assert not held.done()
        assert gate_a.extra() == {0: 800}
        assert gate_a.claimed() == {}
        assert await a.exchange()
        assert await b.exchange()
        assert rb.loads.used_blocks(0) == 300  # a's running work, not its queue
        assert await asyncio.wait_for(gate_b.wait(500, lambda extra: 0), 1.0) == 0
        held.cancel()
        await a.board.client.aclose()
        await b.board.client.aclose()

    with redis_server() as server:
        asyncio.run(main(server.url))
