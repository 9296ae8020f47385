"""The router's decode-KV gate (`router.admission`): first come, first served; a request's prefill
is sent only once a decode engine has room for it by the router's count; overload is a 503.

The gate alone runs on a room function the test controls; the dispatcher runs its real placement
(the Rust directory, the `evolving` policy) with the engines' two legs replaced by coroutines the
test finishes, so "B's prefill was not sent while A held the decode KV" is checked without timing.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from evolving_infra import KvDirectory, block_hashes
from evolving_infra.router import api, config
from evolving_infra.router.admission import DecodeGate
from evolving_infra.router.dispatcher import Finished, NoEngineError, PreparedRequest, TextPiece
from evolving_infra.router.pd import EngineHandle, PdDispatcher
from evolving_infra.routing.base import Phase
from evolving_infra.routing.evolving import EvolvingRouter
from evolving_infra.timing.model import IterationModel
from router_helpers import PAGE


class _Room:
    """Free blocks the test sets; `gate.notify()` after each change, as the dispatcher does."""

    def __init__(self, free: int) -> None:
        self.free = free

    def __call__(self, blocks: int) -> bool:
        return blocks <= self.free


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class _Clients:
    """Requests through one gate, in the order they pass it; with `take`, each takes its room
    before its next await, as the dispatcher does."""

    def __init__(self, *, take: bool) -> None:
        self.room = _Room(0)
        self.gate = DecodeGate(self.room, max_wait_s=60.0)
        self.order: list[str] = []
        self.take = take

    def send(self, name: str, blocks: int) -> asyncio.Task[None]:
        return asyncio.create_task(self._request(name, blocks))

    async def _request(self, name: str, blocks: int) -> None:
        await self.gate.wait(blocks)
        self.order.append(name)
        if self.take:
            self.room.free -= blocks


def test_requests_pass_in_arrival_order_and_a_small_one_does_not_jump_the_queue() -> None:
    async def run() -> list[str]:
        c = _Clients(take=True)
        tasks = [c.send(n, b) for n, b in (("a", 10), ("b", 30), ("c", 5))]
        await _settle()
        assert c.order == []
        assert c.gate.waiting == 3
        c.room.free = 20  # enough for a and for c, not for b
        c.gate.notify()
        await _settle()
        # b waits for 30 blocks, and c behind it, although c would fit now...
        assert c.order == ["a"]
        assert c.gate.waiting == 2
        # ...and so does a request arriving now.
        tasks.append(c.send("d", 5))
        await _settle()
        assert c.order == ["a"]
        assert c.gate.waiting == 3
        c.room.free += 30  # 40 free: b, c and d
        c.gate.notify()
        await asyncio.gather(*tasks)
        assert c.gate.waiting == 0
        return c.order

    assert asyncio.run(run()) == ["a", "b", "c", "d"]


def test_a_request_that_fits_with_no_one_waiting_passes_at_once() -> None:
    async def run() -> int:
        gate = DecodeGate(_Room(8), max_wait_s=60.0)
        await gate.wait(8)
        return gate.waiting

    assert asyncio.run(run()) == 0


def test_a_woken_request_that_finds_the_room_gone_waits_at_the_head() -> None:
    async def run() -> list[str]:
        c = _Clients(take=False)
        a = c.send("a", 10)
        await _settle()
        b = c.send("b", 1)
        await _settle()
        c.room.free = 10
        c.gate.notify()
        c.room.free = 0  # taken before a ran (another path of the router, say)
        await _settle()
        assert c.order == []
        assert c.gate.waiting == 2
        c.room.free = 11
        c.gate.notify()
        await asyncio.gather(a, b)
        return c.order

    assert asyncio.run(run()) == ["a", "b"]


def test_waiting_too_long_is_overload_and_leaves_the_queue_to_the_next() -> None:
    async def run() -> None:
        room = _Room(0)
        gate = DecodeGate(room, max_wait_s=0.05)
        with pytest.raises(NoEngineError, match="no decode engine had room for 7 KV blocks"):
            await gate.wait(7)
        assert gate.waiting == 0
        gate.max_wait_s = 60.0
        late = asyncio.create_task(gate.wait(1))
        await _settle()
        room.free = 1
        gate.notify()
        await late

    asyncio.run(run())


def test_a_client_gone_while_waiting_leaves_the_queue_to_the_next() -> None:
    async def run() -> None:
        room = _Room(0)
        gate = DecodeGate(room, max_wait_s=60.0)
        first = asyncio.create_task(gate.wait(50))
        await _settle()
        second = asyncio.create_task(gate.wait(5))
        await _settle()
        first.cancel()
        await _settle()
        assert gate.waiting == 1
        room.free = 5
        gate.notify()
        await second
        assert gate.waiting == 0

    asyncio.run(run())


# -- in the dispatcher ------------------------------------------------------------------------

CAPACITY = 96  # the decode engine's KV, in blocks


def _dispatcher(admission: bool) -> PdDispatcher:
    phases: tuple[Phase, ...] = ("prefill", "decode")
    engines = [
        EngineHandle(n, f"http://127.0.0.1:{9000 + n}", phase, "127.0.0.1", 9000 + n, CAPACITY)
        for n, phase in enumerate(phases)
    ]
    model = IterationModel()
    router = EvolvingRouter(model, block_size=PAGE, kv_bytes_per_token=1024)
    session: Any = None  # the legs below send nothing
    return PdDispatcher(
        engines, KvDirectory(), router, model, page_size=PAGE, session=session, admission=admission
    )


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

    d._prefill = prefill  # type: ignore[method-assign]
    d._decode = decode  # type: ignore[method-assign,assignment]
    held: list[float] = []
    d.on_admitted = held.append
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
        assert d.loads.used_blocks(1) == 0
        # Every admitted request's time at the gate is reported (the histogram's count).
        assert len(held) == (2 if admission else 0)

    asyncio.run(run())


def test_a_request_no_decode_engine_could_hold_is_not_held() -> None:
    """Waiting cannot help a request larger than every decode engine: it goes on (the engine
    answers for it) rather than blocking everyone behind it until it times out."""
    d = _dispatcher(True)
    sent: list[str] = []

    async def prefill(engine: Any, body: bytes) -> None:
        sent.append("big")

    async def decode(engine: Any, body: bytes) -> AsyncIterator[Any]:
        yield Finished("stop", 0, 0)

    d._prefill = prefill  # type: ignore[method-assign]
    d._decode = decode  # type: ignore[method-assign,assignment]

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
