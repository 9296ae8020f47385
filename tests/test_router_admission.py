"""The router's decode-KV gate (`router.admission`): first come, first served per decode engine;
a request's prefill is sent only once its decode engine has room for it by the router's count;
overload is a 429, predicted at arrival or after the longest hold.

The gate alone runs on engines whose space the test controls (`_Engines`, with the evolving
policy's decode choice: the most free, the gate's commitments counted); the dispatcher runs its
real placement (the Rust directory, the `evolving` policy) with the engines' two legs replaced by
coroutines the test finishes, so "B's prefill was not sent while A held the decode KV" is checked
without timing.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from evolving_infra import KvDirectory, block_hashes
from evolving_infra.router import api, config
from evolving_infra.router.admission import DecodeGate
from evolving_infra.router.dispatcher import (
    Finished,
    OverloadedError,
    PreparedRequest,
    ShuttingDownError,
    TextPiece,
)
from evolving_infra.router.loads import EngineHandle
from evolving_infra.router.observer import DispatchObserver
from evolving_infra.router.pd import PdDispatcher
from evolving_infra.router.registry import EngineRegistry
from evolving_infra.routing.evolving import EvolvingRouter
from evolving_infra.timing.model import IterationModel
from evolving_infra.types import Phase
from router_helpers import PAGE, Legs


class _Engines:
    """Decode engines' capacity and used blocks the test sets (`gate.notify()` after each
    change, as the dispatcher does); `choose` picks the most free engine counting the gate's
    commitments, ties to the lowest id (`routing.common.most_free_decode`'s order)."""

    def __init__(self, **used: int) -> None:
        self.cap = 100
        self.used = {int(k.removeprefix("e")): v for k, v in used.items()}

    def space(self) -> dict[int, tuple[int, int]]:
        return {e: (self.cap, u) for e, u in self.used.items()}

    def choose(self, extra: Mapping[int, int]) -> int:
        if not self.used:
            return -1
        return min(self.used, key=lambda e: (self.used[e] + extra.get(e, 0), e))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class _Clients:
    """Requests through one gate, in the order they pass it, with the engine each got; each
    takes its room before its next await, as the dispatcher does."""

    def __init__(self, engines: _Engines, max_wait_s: float = 60.0) -> None:
        self.engines = engines
        self.gate = DecodeGate(engines.space, max_wait_s=max_wait_s)
        self.order: list[tuple[str, int | None]] = []

    def send(self, name: str, blocks: int) -> asyncio.Task[None]:
        return asyncio.create_task(self._request(name, blocks))

    async def _request(self, name: str, blocks: int) -> None:
        e = await self.gate.wait(blocks, self.engines.choose)
        self.order.append((name, e))
        if e is not None:
            self.engines.used[e] += blocks

    def free(self, engine: int, blocks: int) -> None:
        self.engines.used[engine] -= blocks
        self.gate.notify()


def test_one_engine_serves_in_arrival_order_and_a_small_request_does_not_jump_its_queue() -> None:
    async def run() -> list[tuple[str, int | None]]:
        c = _Clients(_Engines(e0=100))
        tasks = [c.send(n, b) for n, b in (("a", 10), ("b", 30), ("c", 5))]
        await _settle()
        assert c.order == []
        assert c.gate.waiting == 3
        assert c.gate.extra() == {0: 45}
        c.free(0, 20)  # enough for a and for c, not for b
        await _settle()
        # b waits for 30 blocks, and c behind it, although c would fit now...
        assert c.order == [("a", 0)]
        assert c.gate.waiting == 2
        # ...and so does a request arriving now.
        tasks.append(c.send("d", 5))
        await _settle()
        assert c.order == [("a", 0)]
        assert c.gate.waiting == 3
        c.free(0, 30)  # 40 free: b, c and d
        await asyncio.gather(*tasks)
        assert c.gate.waiting == 0
        assert c.gate.extra() == {}
        return c.order

    assert asyncio.run(run()) == [("a", 0), ("b", 0), ("c", 0), ("d", 0)]


def test_a_stopping_router_refuses_the_held_requests_and_every_later_one() -> None:
    """`close()` (the router drains for a stop): the requests held for decode room are refused
    at once (503 shutting_down: no engine saw them), and so is a request arriving after,
    even one that would fit; the room the engine had is untouched."""

    async def run() -> None:
        c = _Clients(_Engines(e0=95))
        held = [c.send(n, 10) for n in ("a", "b")]
        await _settle()
        assert c.gate.waiting == 2
        assert c.gate.close() == 2
        for task in held:
            with pytest.raises(ShuttingDownError):
                await task
        assert c.gate.waiting == 0
        assert c.gate.extra() == {}
        with pytest.raises(ShuttingDownError):
            await c.gate.wait(1, c.engines.choose)
        assert c.order == []

    asyncio.run(run())


def test_a_request_that_fits_on_another_engine_passes_and_the_waiting_one_is_not_starved() -> None:
    """A large request waits for room on engine 0 (the most free); a small one that fits on
    engine 1 goes there at once rather than waiting behind it (one queue for the cluster held
    every dispatch until an engine had drained). Engine 0 takes no one else while the large one
    waits: its queue counts as used, so the next request waits on engine 1."""

    async def run() -> list[tuple[str, int | None]]:
        c = _Clients(_Engines(e0=60, e1=70))
        big = c.send("big", 90)
        await _settle()
        assert c.gate.extra() == {0: 90}
        small = c.send("small", 20)
        await small
        assert c.order == [("small", 1)]
        later = c.send("later", 20)  # engine 1 has 10 free, engine 0 "-50"
        await _settle()
        assert c.gate.waiting == 2
        assert c.gate.extra() == {0: 90, 1: 20}
        c.free(0, 50)  # engine 0: 10 used, room for big only
        await big
        c.free(1, 20)
        await later
        return c.order

    assert asyncio.run(run()) == [("small", 1), ("big", 0), ("later", 1)]


def test_a_request_that_fits_with_no_one_waiting_passes_at_once() -> None:
    async def run() -> tuple[int | None, int]:
        engines = _Engines(e0=92)
        gate = DecodeGate(engines.space, max_wait_s=60.0)
        e = await gate.wait(8, engines.choose)
        return e, gate.waiting

    assert asyncio.run(run()) == (0, 0)


def test_an_admitted_request_holds_its_room_until_it_resumes() -> None:
    """Between its admission and its resuming (when it takes the room), the room is claimed:
    the next request in the queue must not be admitted into it too."""

    async def run() -> None:
        c = _Clients(_Engines(e0=100))
        a, b = c.send("a", 10), c.send("b", 10)
        await _settle()
        c.engines.used[0] = 90
        c.gate.notify()
        c.gate.notify()  # twice before a has resumed
        assert c.gate.waiting == 1
        assert c.gate.extra() == {0: 20}  # a's claim, b waiting
        await a
        await _settle()
        assert c.gate.extra() == {0: 10}  # a took the last 10 blocks: b waits
        assert not b.done()
        c.free(0, 10)
        await b
        assert c.order == [("a", 0), ("b", 0)]

    asyncio.run(run())


def test_an_engine_that_leaves_hands_its_queue_to_the_others_in_arrival_order() -> None:
    async def run() -> list[tuple[str, int | None]]:
        c = _Clients(_Engines(e0=100, e1=100))
        # a and c wait on engine 0, b on engine 1 (each goes to the least committed).
        tasks = [c.send(n, 10) for n in "abc"]
        await _settle()
        assert c.gate.extra() == {0: 20, 1: 10}
        # Engine 1 changes phase: b moves to engine 0, between a and c.
        del c.engines.used[1]
        for _ in "abc":
            c.free(0, 10)  # room for one more
            await _settle()
        await asyncio.gather(*tasks)
        return c.order

    assert asyncio.run(run()) == [("a", 0), ("b", 0), ("c", 0)]


def test_with_no_decode_engine_up_the_waiting_requests_go_on_to_the_placement() -> None:
    async def run() -> list[tuple[str, int | None]]:
        c = _Clients(_Engines(e0=100))
        tasks = [c.send(n, 5) for n in "ab"]
        await _settle()
        c.engines.used.clear()
        c.gate.notify()
        await asyncio.gather(*tasks)
        return c.order

    assert asyncio.run(run()) == [("a", None), ("b", None)]


def test_waiting_too_long_is_overload_and_leaves_the_queue_to_the_next() -> None:
    async def run() -> None:
        c = _Clients(_Engines(e0=100), max_wait_s=0.05)
        # Nothing freed yet: no prediction, so it is held, then refused (429), never admitted.
        with pytest.raises(OverloadedError, match="no decode room for 7 KV blocks") as e:
            await c.gate.wait(7, c.engines.choose)
        assert e.value.status == 429
        assert e.value.retry_after_s == 1.0  # the bound (0.05 s), at least a second
        assert (c.gate.shed_early, c.gate.shed_late) == (0, 1)
        assert c.gate.waiting == 0
        assert c.gate.extra() == {}
        c.gate.max_wait_s = 60.0
        late = c.send("late", 1)
        await _settle()
        c.free(0, 1)
        await late

    asyncio.run(run())


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_wait_predicted_over_the_bound_is_refused_at_once_with_retry_after() -> None:
    async def run() -> None:
        engines, clock = _Engines(e0=90), _Clock()
        gate = DecodeGate(engines.space, max_wait_s=30.0, clock=clock)
        assert gate.expected_wait(0, 10) == 0.0  # room now
        assert gate.expected_wait(0, 20) is None  # no block freed yet: no rate
        clock.now += 60.0
        for _ in range(6):  # 60 blocks freed over the last minute: 1 block/s
            gate.freed(0, 10)
        assert gate.expected_wait(0, 20) == pytest.approx(10.0)  # 10 blocks short at 1/s
        # 10 s predicted: held (and admitted once the room comes).
        held = asyncio.create_task(gate.wait(20, engines.choose))
        await _settle()
        assert gate.waiting == 1
        # Behind it: 20 + 25 - 10 free = 35 blocks, 35 s > 30 s: refused now, not held.
        with pytest.raises(OverloadedError, match="predicted wait 35 s") as e:
            await gate.wait(25, engines.choose)
        assert e.value.retry_after_s == pytest.approx(35.0)
        assert (gate.shed_early, gate.shed_late, gate.waiting) == (1, 0, 1)
        engines.used[0] -= 10
        gate.notify()
        assert await held == 0
        # Freed blocks age out of the window: a minute later there is no rate again.
        clock.now += 61.0
        assert gate.expected_wait(0, 50) is None

    asyncio.run(run())


def test_a_client_gone_while_waiting_leaves_the_queue_to_the_next() -> None:
    async def run() -> None:
        c = _Clients(_Engines(e0=100))
        first = c.send("first", 50)
        await _settle()
        second = c.send("second", 5)
        await _settle()
        first.cancel()
        await _settle()
        assert c.gate.waiting == 1
        assert c.gate.extra() == {0: 5}
        c.free(0, 5)
        await second
        assert c.gate.waiting == 0

    asyncio.run(run())


# -- in the dispatcher ------------------------------------------------------------------------

CAPACITY = 96  # the decode engine's KV, in blocks


def _dispatcher(admission: bool, phases: tuple[Phase, ...] = ("prefill", "decode")) -> PdDispatcher:
    engines = [
        EngineHandle(n, f"http://127.0.0.1:{9000 + n}", phase, "127.0.0.1", 9000 + n, CAPACITY)
        for n, phase in enumerate(phases)
    ]
    model = IterationModel()
    router = EvolvingRouter(model, block_size=PAGE, kv_bytes_per_token=1024)
    registry = EngineRegistry(engines)
    return PdDispatcher(
        registry,
        KvDirectory(),
        router,
        model,
        page_size=PAGE,
        transport=Legs(),
        admission=admission,
    )


class Holds(DispatchObserver, list[float]):
    """The gate's hold of each request, in seconds, as the dispatcher reports them."""

    def admitted(self, held_s: float) -> None:
        self.append(held_s)


def _request(name: str, tokens: int) -> PreparedRequest:
    ids = [hash((name, i)) % 50_000 for i in range(tokens)]
    return PreparedRequest(
        request_id=name, kind="completion", model="m", token_ids=tuple(ids),
        block_hashes=tuple(block_hashes(ids, PAGE)), page_size=PAGE, branch=0, branch_info=None,
        sampling=api.SamplingParams(max_tokens=PAGE), stream=True, arrival=0.0,
    )  # fmt: skip


@pytest.mark.parametrize("admission", [True, False])
def test_a_prefill_is_sent_only_once_the_decode_engine_has_room(admission: bool) -> None:
    """A and B each need 64 of the decode engine's 96 blocks (prompt and max_tokens). With the
    gate, B's prefill leaves only after A's stream ends; without it, at once."""
    d = _dispatcher(admission)
    sent: list[str] = []
    finish = {"A": asyncio.Event(), "B": asyncio.Event()}

    async def prefill(engine: Any, body: bytes) -> None:
        sent.append(body.split(b'"rid": "')[1].split(b'"')[0].decode())

    async def decode(engine: Any, body: bytes) -> AsyncIterator[Any]:
        name = body.split(b'"rid": "')[1].split(b'"')[0].decode()
        yield TextPiece("x", 1)
        await finish[name].wait()
        yield Finished("stop", 1, 0)

    d.transport = Legs(prefill, decode)
    held = Holds()
    d.observer = held
    tokens = 63 * PAGE  # 63 prompt blocks, then max_tokens = one page: 64 blocks

    async def run() -> None:
        async def consume(name: str) -> None:
            async for _ in d.generate(_request(name, tokens)):
                pass

        a = asyncio.create_task(consume("A"))
        await _settle()
        b = asyncio.create_task(consume("B"))
        await _settle()
        if admission:
            assert sent == ["A"]
            assert d.gate is not None
            assert d.gate.waiting == 1
        else:
            assert sent == ["A", "B"]
            assert d.gate is None
        finish["A"].set()
        await a
        await _settle()
        assert sent == ["A", "B"]
        finish["B"].set()
        await b
        assert d.registry.loads.used_blocks(1) == 0
        # Every admitted request's time at the gate is reported (the histogram's count).
        assert len(held) == (2 if admission else 0)

    asyncio.run(run())


def test_the_decode_engine_is_the_one_whose_room_the_gate_gave() -> None:
    """Two decode engines of 96 blocks: A and B (64 blocks each) take one each; C (64) waits on
    one of them; D (16 blocks) fits where C waits for room and passes C there (C's
    queue counts as used, so D goes to the other engine, which has 32 free); C goes, to the
    engine it waited for, once that engine's request ends."""
    d = _dispatcher(True, ("prefill", "decode", "decode"))
    engine_of: dict[str, int] = {}
    finish = {n: asyncio.Event() for n in "ABCD"}

    async def prefill(engine: Any, body: bytes) -> None:
        pass

    async def decode(engine: Any, body: bytes) -> AsyncIterator[Any]:
        name = body.split(b'"rid": "')[1].split(b'"')[0].decode()
        engine_of[name] = engine.node
        yield TextPiece("x", 1)
        await finish[name].wait()
        yield Finished("stop", 1, 0)

    d.transport = Legs(prefill, decode)

    async def run() -> None:
        async def consume(name: str, tokens: int) -> None:
            async for _ in d.generate(_request(name, tokens)):
                pass

        big, small = 63 * PAGE, 15 * PAGE
        tasks = {n: asyncio.create_task(consume(n, t)) for n, t in (("A", big), ("B", big))}
        await _settle()
        assert sorted(engine_of.values()) == [1, 2]
        tasks["C"] = asyncio.create_task(consume("C", big))
        await _settle()
        assert d.gate is not None
        assert d.gate.waiting == 1
        (c_engine,) = d.gate.extra()
        tasks["D"] = asyncio.create_task(consume("D", small))
        await _settle()
        assert "C" not in engine_of
        assert engine_of["D"] == 3 - c_engine  # the other engine, at once
        # The engine C does not wait for frees first: C still waits.
        other = next(n for n in "AB" if engine_of[n] != c_engine)
        finish[other].set()
        await tasks[other]
        await _settle()
        assert "C" not in engine_of
        mine = next(n for n in "AB" if engine_of[n] == c_engine)
        finish[mine].set()
        await tasks[mine]
        await _settle()
        assert engine_of["C"] == c_engine
        for n in "CD":
            finish[n].set()
        await asyncio.gather(*tasks.values())
        assert d.registry.loads.used_blocks(1) == d.registry.loads.used_blocks(2) == 0
        assert d.gate.extra() == {}

    asyncio.run(run())


def test_the_decode_leg_goes_to_the_engine_the_gate_gave_not_the_policys_pick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = _dispatcher(True, ("prefill", "decode", "decode"))
    engine_of: list[int] = []

    async def prefill(engine: Any, body: bytes) -> None:
        pass

    async def decode(engine: Any, body: bytes) -> AsyncIterator[Any]:
        engine_of.append(engine.node)
        yield Finished("stop", 0, 0)

    async def gate_gives_engine_2(blocks: int, choose: Any) -> int:
        assert choose({}) == 1  # the policy's pick: both empty, the lowest id
        return 2

    d.transport = Legs(prefill, decode)
    assert d.gate is not None
    monkeypatch.setattr(d.gate, "wait", gate_gives_engine_2)

    async def run() -> None:
        async for _ in d.generate(_request("r", 4 * PAGE)):
            pass

    asyncio.run(run())
    assert engine_of == [2]


def test_a_request_no_decode_engine_could_hold_is_not_held() -> None:
    """Waiting cannot help a request larger than every decode engine: it goes on (the engine
    answers for it) rather than blocking everyone behind it until it times out."""
    d = _dispatcher(True)
    sent: list[str] = []

    async def prefill(engine: Any, body: bytes) -> None:
        sent.append("big")

    async def decode(engine: Any, body: bytes) -> AsyncIterator[Any]:
        yield Finished("stop", 0, 0)

    d.transport = Legs(prefill, decode)

    async def run() -> None:
        async for _ in d.generate(_request("big", (CAPACITY + 1) * PAGE)):
            pass

    asyncio.run(run())
    assert sent == ["big"]


@pytest.mark.parametrize(("flags", "admission"), [([], True), (["--no-admission"], False)])
def test_the_gate_is_on_unless_turned_off(flags: list[str], admission: bool) -> None:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    cfg = config.RouterConfig.from_args(parser.parse_args(["--engines", "127.0.0.1:1", *flags]))
    assert cfg.admission is admission


def test_limits_are_the_context_length_bounded_by_the_largest_engine() -> None:
    d = _dispatcher(True)
    assert d.limits().context_tokens == CAPACITY * PAGE  # no context length known: the KV
    d.context_length = 300
    assert d.limits().context_tokens == 300
    d.context_length = 10**6
    assert d.limits().context_tokens == CAPACITY * PAGE
    # A request that names no max_tokens gets the default, cut to the room its prompt leaves.
    d.context_length = 300
    no_max = dataclasses.replace(_request("r", 250), sampling=api.SamplingParams())
    assert d._max_out(no_max) == 50
    assert d._max_out(_request("r", 250)) == PAGE  # its own max_tokens


def test_every_finished_request_feeds_the_gates_drain_rate() -> None:
    d = _dispatcher(True)

    async def decode(engine: Any, body: bytes) -> AsyncIterator[Any]:
        yield Finished("stop", 1, 0)

    d.transport = Legs(None, decode)

    async def run() -> None:
        for name in ("a", "b"):
            async for _ in d.generate(_request(name, 3 * PAGE)):
                pass

    asyncio.run(run())
    assert d.gate is not None
    # Each held 3 prompt blocks and max_tokens (one page): 4 blocks freed, twice.
    assert sum(b for _, b in d.gate._freed[1]) == 8
