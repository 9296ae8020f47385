"""Engine control over real gRPC on loopback: every RPC round-trips, errors arrive typed.

The engine here is a small in-memory subject of the protocol (block sets per tier, a phase, a
scripted sample stream), not the simulated engine: it exercises the server base, the converters
and the client against a real `grpc.aio` server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from evolving_infra.control import (
    MAX_HASHES,
    DrainTimeoutError,
    EngineBusyError,
    EngineClient,
    EngineControlService,
    EngineInfo,
    EngineInternalError,
    EngineTimeoutError,
    EngineUnavailableError,
    EvictionHints,
    Health,
    HintsResult,
    InvalidRequestError,
    IterationSample,
    KvLocation,
    PrefetchRequest,
    PrefetchResult,
    StaleLeaderError,
    SwitchRequest,
    SwitchResult,
    TransferRequest,
    TransferResult,
    UnauthenticatedError,
    UnknownBlocksError,
    UnsupportedError,
    serve,
)
from evolving_infra.control.v1 import engine_pb2 as pb
from evolving_infra.control.v1.engine_pb2_grpc import EngineControlStub
from evolving_infra.timing.samples import Sample
from evolving_infra.types import Phase

NODE = 3
BLOCK_BYTES = 4096
PREFILL = Sample("prefill", 0.05, batch=((100, 20), (60, 0)))
DECODE = Sample("decode", 0.01, batch_size=4, context_tokens=900)
SAMPLES = (
    IterationSample.from_sample(PREFILL, seq=0, timestamp_s=1.0),
    # what SGLang's forward-pass metrics give: sums, no per-request pairs
    IterationSample(1, 2.0, "prefill", 0.04, prefill_requests=1, prefill_uncached_tokens=80),
    IterationSample.from_sample(DECODE, seq=2, timestamp_s=3.0),
)


class MemoryEngine(EngineControlService):
    """Node NODE with block sets for L1 and L2, the pool, hints, a phase and scripted samples."""

    def __init__(self) -> None:
        self.phase: Phase = "prefill"
        self.l1: set[int] = set()
        self.l2: set[int] = set()
        self.pool: set[int] = set()
        self.hints: dict[int, int] = {}
        self.running = 0  # requests a drain waits for; > 0 makes every drain time out
        self.switching = False
        self.stream_closed = asyncio.Event()
        self.endless = False

    async def get_info(self) -> EngineInfo:
        return EngineInfo(
            NODE,
            "llama-3-8b",
            "sim",
            self.phase,
            16,
            1000,
            4000,
            len(self.l1),
            len(self.l2),
            http_url="http://127.0.0.1:30000",
            kv_events_endpoint="tcp://127.0.0.1:5557",
            kv_replay_endpoint="tcp://127.0.0.1:5558",
            samples_endpoint="tcp://127.0.0.1:5559",
            version="test 0",
        )

    async def health(self) -> Health:
        if self.switching:
            return Health("switching", self.phase, "switching phase")
        return Health("serving", self.phase)

    async def switch_phase(self, request: SwitchRequest) -> SwitchResult:
        before = self.phase
        if request.target == before:
            return SwitchResult(before, before, 0.0, 0.0, 0.0, len(self.l1), len(self.l2))
        if self.switching:
            raise EngineBusyError("a phase switch is already in progress")
        self.switching = True
        try:
            if self.running:
                await asyncio.sleep(request.drain_timeout_s)
                raise DrainTimeoutError(f"{self.running} requests still running")
            await asyncio.sleep(0.01)
            if not request.keep_kv:
                self.l1.clear()
                self.l2.clear()
            self.phase = request.target
        finally:
            self.switching = False
        return SwitchResult(self.phase, before, 0.0, 0.01, 0.01, len(self.l1), len(self.l2))

    def _tier(self, loc: KvLocation) -> set[int]:
        if loc.tier == "pool":
            return self.pool
        if loc.node_id != NODE:
            raise InvalidRequestError(f"node {loc.node_id} is not this node ({NODE})")
        return self.l1 if loc.tier == "L1" else self.l2

    async def transfer_kv(self, request: TransferRequest) -> TransferResult:
        source, destination = self._tier(request.source), self._tier(request.destination)
        missing = tuple(h for h in request.hashes if h not in source)
        if missing and not request.allow_partial:
            raise UnknownBlocksError(f"{len(missing)} blocks not at the source", missing)
        moved = [h for h in request.hashes if h in source and h not in destination]
        destination.update(moved)
        return TransferResult(len(moved), len(moved) * BLOCK_BYTES, 0.001, missing)

    async def prefetch(self, request: PrefetchRequest) -> PrefetchResult:
        if request.request_id == "crash":
            raise RuntimeError("engine bug")
        source = self.l2 if request.source == "L2" else self.pool
        wanted = [h for h in request.hashes if h not in self.l1]
        missing = tuple(h for h in wanted if h not in source)
        if missing and not request.allow_partial:
            raise UnknownBlocksError("blocks not found", missing)
        started = [h for h in wanted if h in source]
        self.l1.update(started)
        return PrefetchResult(len(started), len(request.hashes) - len(missing), 0.002, missing)

    async def set_eviction_hints(self, request: EvictionHints) -> HintsResult:
        if request.replace:
            self.hints.clear()
        held = self.l1 | self.l2
        applied = {h: p for h, p in request.hints if h in held}
        self.hints.update(applied)
        return HintsResult(len(applied), len(request.hints) - len(applied))

    async def iteration_samples(self) -> AsyncIterator[IterationSample]:
        try:
            for s in SAMPLES:
                yield s
            seq = len(SAMPLES)
            while self.endless:
                await asyncio.sleep(0.005)
                yield IterationSample(seq, 9.0, self.phase, 0.01, decode_batch_size=1)
                seq += 1
        finally:
            self.stream_closed.set()


class InfoOnlyEngine(EngineControlService):
    """Implements only what the base requires: every other call must answer UNIMPLEMENTED."""

    async def get_info(self) -> EngineInfo:
        return EngineInfo(0, "m", "sim", "decode", 1, 1, 0)

    async def health(self) -> Health:
        return Health("down", "decode", "not started")


Body = Callable[[EngineClient, MemoryEngine, str], Awaitable[None]]


def run(body: Body, engine: MemoryEngine | None = None) -> None:
    """Serve an engine on loopback, run `body` with a client to it, stop the server."""

    async def main() -> None:
        subject = engine or MemoryEngine()
        server, port = await serve(subject)
        address = f"127.0.0.1:{port}"
        try:
            async with EngineClient(address, timeout=5.0) as client:
                await body(client, subject, address)
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_get_info_and_health_round_trip() -> None:
    async def body(client: EngineClient, engine: MemoryEngine, _: str) -> None:
        engine.l1.update((1, 2))
        info = await client.get_info()
        assert info == await engine.get_info()
        assert (info.node_id, info.phase, info.l1_used_blocks, info.page_size) == (
            3,
            "prefill",
            2,
            16,
        )
        assert await client.health() == Health("serving", "prefill", "")

    run(body)


def test_switch_phase_keeps_or_drops_kv() -> None:
    async def body(client: EngineClient, engine: MemoryEngine, _: str) -> None:
        engine.l1.update((-5, 7))
        engine.l2.add(9)
        kept = await client.switch_phase("decode")
        assert kept == SwitchResult("decode", "prefill", 0.0, 0.01, 0.01, 2, 1)
        assert (await client.get_info()).phase == "decode"
        noop = await client.switch_phase("decode")
        assert (noop.phase, noop.total_s) == ("decode", 0.0)
        dropped = await client.switch_phase("prefill", keep_kv=False)
        assert (dropped.phase, dropped.l1_blocks_kept, dropped.l2_blocks_kept) == ("prefill", 0, 0)

    run(body)


def test_switch_phase_errors_are_typed() -> None:
    async def body(client: EngineClient, engine: MemoryEngine, _: str) -> None:
        engine.running = 2
        with pytest.raises(DrainTimeoutError, match="2 requests still running"):
            await client.switch_phase("decode", drain_timeout_s=0.05)
        assert (await client.get_info()).phase == "prefill"  # nothing changed
        slow = asyncio.create_task(client.switch_phase("decode", drain_timeout_s=0.3))
        await asyncio.sleep(0.05)
        assert (await client.health()).state == "switching"
        with pytest.raises(EngineBusyError):
            await client.switch_phase("decode")
        with pytest.raises(DrainTimeoutError):
            await slow
        with pytest.raises(EngineTimeoutError, match=r"engine at 127\.0\.0\.1"):
            await client.switch_phase("decode", drain_timeout_s=1.0, timeout=0.1)

    run(body)


def test_a_stale_leader_epoch_is_refused_before_the_engine_sees_it() -> None:
    async def body(client: EngineClient, engine: MemoryEngine, _: str) -> None:
        # A new leader fences the engine with a no-op (its current phase) at its epoch...
        assert (await client.switch_phase("prefill", leader_epoch=7)).total_s == 0.0
        # ...after which the deposed leader's switch (epoch 6, or a router without replicas)
        # is refused, and the phase is untouched.
        for stale in (6, 0):
            with pytest.raises(StaleLeaderError, match=f"epoch {stale} is stale.*seen epoch 7"):
                await client.switch_phase("decode", leader_epoch=stale)
        assert (await client.get_info()).phase == "prefill"
        assert (await client.switch_phase("decode", leader_epoch=7)).phase == "decode"
        assert (await client.switch_phase("prefill", leader_epoch=9)).phase == "prefill"
        with pytest.raises(StaleLeaderError):
            await client.switch_phase("decode", leader_epoch=8)
        with pytest.raises(InvalidRequestError, match="leader_epoch"):
            await client.switch_phase("decode", leader_epoch=-1)

    run(body)


def test_transfer_kv_both_directions_and_missing_blocks() -> None:
    async def body(client: EngineClient, engine: MemoryEngine, _: str) -> None:
        engine.pool.update((10, -11, 12))
        pulled = await client.transfer_kv(KvLocation.pool(), KvLocation.node(NODE, "L2"), [10, -11])
        assert pulled == TransferResult(2, 2 * BLOCK_BYTES, 0.001, ())
        assert engine.l2 == {10, -11}
        pushed = await client.transfer_kv(
            KvLocation.node(NODE, "L2", "127.0.0.1:1"),
            KvLocation.node(NODE, "L1"),
            [10, -11, 99],
            allow_partial=True,
        )
        assert (pushed.blocks_moved, pushed.missing_hashes) == (2, (99,))
        with pytest.raises(UnknownBlocksError) as err:
            await client.transfer_kv(
                KvLocation.pool(), KvLocation.node(NODE), [12, -(2**63), 2**63 - 1]
            )
        assert err.value.hashes == (-(2**63), 2**63 - 1)
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        assert 12 not in engine.l1  # all or nothing
        with pytest.raises(InvalidRequestError, match="node 4 is not this node"):
            await client.transfer_kv(KvLocation.node(4, "L1"), KvLocation.node(NODE), [10])

    run(body)


def test_prefetch_and_eviction_hints() -> None:
    async def body(client: EngineClient, engine: MemoryEngine, _: str) -> None:
        engine.l2.update((1, 2, 3))
        engine.l1.add(1)
        got = await client.prefetch("req-1", [1, 2, 3], wait=True)
        assert got == PrefetchResult(2, 3, 0.002, ())
        with pytest.raises(UnknownBlocksError) as err:
            await client.prefetch("req-2", [1, 4], source="pool")
        assert err.value.hashes == (4,)
        partial = await client.prefetch("req-2", [1, 4], source="pool", allow_partial=True)
        assert (partial.blocks_started, partial.blocks_ready, partial.missing_hashes) == (
            0,
            1,
            (4,),
        )
        assert await client.set_eviction_hints({1: 2, 2: 0, 77: 5}) == HintsResult(2, 1)
        assert await client.set_eviction_hints([(3, 1)]) == HintsResult(1, 0)
        assert engine.hints == {1: 2, 2: 0, 3: 1}
        assert await client.set_eviction_hints({}, replace=True) == HintsResult(0, 0)
        assert engine.hints == {}

    run(body)


def test_stream_iteration_samples() -> None:
    async def body(client: EngineClient, _: MemoryEngine, __: str) -> None:
        got = [s async for s in client.iteration_samples()]
        assert got == list(SAMPLES)
        samples = [s.to_sample() for s in got]
        assert samples[0] == PREFILL
        assert samples[1] == Sample("prefill", 0.04, batch=((80, 0),))  # rebuilt from sums
        assert samples[2] == DECODE
        assert (got[0].prefill_requests, got[0].prefill_uncached_tokens) == (2, 160)
        assert got[0].prefill_uncached_var == pytest.approx(400.0)

    run(body)


def test_leaving_the_stream_early_closes_it_on_the_engine() -> None:
    engine = MemoryEngine()
    engine.endless = True

    async def body(client: EngineClient, engine: MemoryEngine, _: str) -> None:
        seen = 0
        stream = client.iteration_samples()
        async for _sample in stream:
            seen += 1
            if seen == 6:
                break
        await stream.aclose()
        await asyncio.wait_for(engine.stream_closed.wait(), timeout=2.0)
        assert (await client.health()).state == "serving"

    run(body, engine)


def test_calls_an_engine_does_not_offer_are_unsupported() -> None:
    async def main() -> None:
        server, port = await serve(InfoOnlyEngine())
        try:
            async with EngineClient(f"127.0.0.1:{port}") as client:
                assert (await client.health()).state == "down"
                with pytest.raises(UnsupportedError):
                    await client.switch_phase("prefill")
                with pytest.raises(UnsupportedError):
                    await client.set_eviction_hints({1: 1})
                with pytest.raises(UnsupportedError):
                    async for _ in client.iteration_samples():
                        pass
                assert (await client.get_info()).backend == "sim"
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_engine_bug_is_internal_and_the_server_keeps_serving() -> None:
    async def body(client: EngineClient, _: MemoryEngine, __: str) -> None:
        with pytest.raises(EngineInternalError, match="RuntimeError: engine bug"):
            await client.prefetch("crash", [1])
        assert (await client.health()).state == "serving"

    run(body)


def test_client_validates_before_sending() -> None:
    async def body(client: EngineClient, _: MemoryEngine, __: str) -> None:
        with pytest.raises(InvalidRequestError, match="no block hashes"):
            await client.transfer_kv(KvLocation.pool(), KvLocation.node(NODE), [])
        with pytest.raises(InvalidRequestError, match="repeated"):
            await client.prefetch("r", [1, 1])
        with pytest.raises(InvalidRequestError, match="signed 64-bit"):
            await client.prefetch("r", [2**63])
        with pytest.raises(InvalidRequestError, match="drain_timeout_s"):
            await client.switch_phase("decode", drain_timeout_s=float("nan"))
        with pytest.raises(InvalidRequestError, match="needs a node_id"):
            KvLocation("L1")
        with pytest.raises(InvalidRequestError, match="priority"):
            await client.set_eviction_hints({1: -1})

    run(body)


def _expect(code: grpc.StatusCode, match: str) -> pytest.RaisesExc[grpc.aio.AioRpcError]:
    return pytest.raises(
        grpc.aio.AioRpcError, check=lambda e: e.code() == code and match in (e.details() or "")
    )


def test_server_rejects_bad_messages_with_a_clear_status_and_keeps_serving() -> None:
    """Requests a well-behaved client never sends, through the raw generated stub and bytes."""

    async def body(client: EngineClient, engine: MemoryEngine, address: str) -> None:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        async with grpc.aio.insecure_channel(address) as channel:
            raw: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                "/evolving_infra.v1.EngineControl/SwitchPhase",
                request_serializer=None,
                response_deserializer=None,
            )
            for garbage in (b"\xff\xff\xff\xff", b"\x08", b"\x12\x05ab"):
                with _expect(bad, "malformed SwitchPhaseRequest"):
                    await raw(garbage)
                assert (await client.health()).state == "serving"
            stream: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
                "/evolving_infra.v1.EngineControl/StreamIterationSamples"
            )
            with _expect(bad, "malformed StreamIterationSamplesRequest"):
                async for _ in stream(b"\x0a\xff"):
                    pass
            stub = EngineControlStub(channel)
            with _expect(bad, "unknown SwitchPhase target_phase 7"):
                await stub.SwitchPhase(pb.SwitchPhaseRequest(target_phase=pb.Phase.ValueType(7)))
            with _expect(bad, "unknown SwitchPhase target_phase 0"):
                await stub.SwitchPhase(pb.SwitchPhaseRequest())
            with _expect(bad, "drain_timeout_s"):
                await stub.SwitchPhase(
                    pb.SwitchPhaseRequest(target_phase=pb.PHASE_DECODE, drain_timeout_s=-1)
                )
            with _expect(bad, "source and destination are required"):
                await stub.TransferKV(pb.TransferKVRequest(hashes=[1]))
            pool, l1 = (
                pb.KvLocation(tier=pb.TIER_POOL),
                pb.KvLocation(tier=pb.TIER_L1, node_id=NODE),
            )
            with _expect(bad, "the pool has no node_id"):
                await stub.TransferKV(
                    pb.TransferKVRequest(
                        source=pb.KvLocation(tier=pb.TIER_POOL, node_id=1),
                        destination=l1,
                        hashes=[1],
                    )
                )
            with _expect(bad, "TransferKV destination tier 9"):
                await stub.TransferKV(
                    pb.TransferKVRequest(
                        source=pool,
                        destination=pb.KvLocation(tier=pb.Tier.ValueType(9)),
                        hashes=[1],
                    )
                )
            with _expect(bad, f"at most {MAX_HASHES}"):
                await stub.TransferKV(
                    pb.TransferKVRequest(source=pool, destination=l1, hashes=range(MAX_HASHES + 1))
                )
            with _expect(bad, "source must be L2 or pool, got L1"):
                await stub.Prefetch(
                    pb.PrefetchRequest(request_id="r", hashes=[1], source=pb.TIER_L1)
                )
            with _expect(bad, "request_id"):
                await stub.Prefetch(pb.PrefetchRequest(hashes=[1], source=pb.TIER_L2))
            with _expect(bad, "empty needs replace"):
                await stub.SetEvictionHints(pb.SetEvictionHintsRequest())
            with _expect(bad, "repeated"):
                hints = [pb.EvictionHint(hash=5, priority=1), pb.EvictionHint(hash=5, priority=2)]
                await stub.SetEvictionHints(pb.SetEvictionHintsRequest(hints=hints))
        assert engine.l1 == set()  # nothing was applied
        assert engine.hints == {}
        assert (await client.get_info()).node_id == NODE

    run(body)


def test_every_rpc_of_the_proto_is_served() -> None:
    """An empty request to each method gets an answer or INVALID_ARGUMENT, never UNIMPLEMENTED."""

    async def status(channel: grpc.aio.Channel, path: str, streaming: bool) -> tuple[str, str]:
        try:
            if streaming:
                stream: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(path)
                async for _ in stream(b""):
                    break
            else:
                unary: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(path)
                await unary(b"")
        except grpc.aio.AioRpcError as e:
            return e.code().name, e.details() or ""
        return "OK", ""

    async def body(_: EngineClient, __: MemoryEngine, address: str) -> None:
        service = pb.DESCRIPTOR.services_by_name["EngineControl"]
        async with grpc.aio.insecure_channel(address) as channel:
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                code, message = await status(channel, path, method.server_streaming)
                assert code in ("OK", "INVALID_ARGUMENT"), (method.name, code, message)
                assert code == "OK" or message, method.name

    run(body)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_unreachable_engine_is_unavailable_within_the_deadline() -> None:
    async def main() -> None:
        address = f"127.0.0.1:{_closed_port()}"
        async with EngineClient(address, timeout=3.0) as client:
            started = time.perf_counter()
            with pytest.raises(EngineUnavailableError, match=address):
                await client.get_info()
            with pytest.raises(EngineUnavailableError):
                async for _ in client.iteration_samples(timeout=3.0):
                    pass
            assert time.perf_counter() - started < 3.0

    asyncio.run(main())


def test_stopped_server_makes_the_client_unavailable() -> None:
    async def main() -> None:
        server, port = await serve(MemoryEngine())
        async with EngineClient(f"127.0.0.1:{port}", timeout=2.0) as client:
            assert (await client.health()).state == "serving"
            await server.stop(None)
            with pytest.raises(EngineUnavailableError):
                await client.health()

    asyncio.run(main())


def test_a_taken_port_is_an_error() -> None:
    async def main() -> None:
        server, port = await serve(MemoryEngine())
        try:
            with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
                await serve(MemoryEngine(), port=port)
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_a_control_api_key_is_required_on_every_call_when_set() -> None:
    """Issue 8, security: with `api_key`, a call without it, or with another, is
    UNAUTHENTICATED (typed on the client side) and changes nothing; the right key works for
    unary calls and for the sample stream."""

    async def main() -> None:
        engine = MemoryEngine()
        server, port = await serve(engine, api_key="s3cret")
        address = f"127.0.0.1:{port}"
        try:
            for key in (None, "wrong", "s3cret "):
                async with EngineClient(address, timeout=5.0, api_key=key) as client:
                    with pytest.raises(UnauthenticatedError, match="control API key"):
                        await client.get_info()
                    with pytest.raises(UnauthenticatedError):
                        await client.switch_phase("decode")
                    with pytest.raises(UnauthenticatedError):
                        async for _ in client.iteration_samples():
                            pass
            assert engine.phase == "prefill"  # nothing was switched
            async with EngineClient(address, timeout=5.0, api_key="s3cret") as client:
                assert (await client.get_info()).node_id == NODE
                samples = [s async for s in client.iteration_samples()]
                assert len(samples) == len(SAMPLES)
        finally:
            await server.stop(None)

    asyncio.run(main())
