"""The SGLang sidecar through the real gRPC client, against a fake SGLang on loopback HTTP and ZMQ.

Every test here talks to `fake_sglang.FakeSglang` instead of SGLang itself: a real SGLang 0.5.23
server needs a GPU to load and run a model, which this machine lacks. The fake serves the 0.5.23
shapes of the endpoints the sidecar drives over real HTTP and publishes real ZMQ streams; the
sidecar, its gRPC server and the `EngineClient` are the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import msgpack
import pytest
import zmq

from evolving_infra.control import (
    DrainTimeoutError,
    EngineBusyError,
    EngineClient,
    EngineInfo,
    EngineUnavailableError,
    HintsResult,
    IterationSample,
    KvLocation,
    UnsupportedError,
)
from evolving_infra.control.server import serve
from evolving_infra.engines.events import Medium
from evolving_infra.engines.sglang.sidecar import SglangSidecar, SidecarConfig
from evolving_infra.router.daemon import handle_of
from evolving_infra.router.ingest import SampleIngestor
from evolving_infra.timing.samples import Sample
from fake_sglang import FakeSglang

T = TypeVar("T")
ADVERTISE = "localhost"  # what the router is told; the sidecar itself reaches SGLang on 127.0.0.1


async def eventually(call: Callable[[], Awaitable[T]], ok: Callable[[T], bool], what: str) -> T:
    deadline = time.monotonic() + 5.0
    while True:
        value = await call()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last: {value!r}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(
    fake: FakeSglang, **config: Any
) -> AsyncIterator[tuple[SglangSidecar, EngineClient]]:
    """The fake started, a sidecar for it serving gRPC on loopback, and a client of that."""
    await fake.start()
    settings: dict[str, Any] = {
        "node_id": 7,
        "sglang_url": fake.url,
        "advertise_host": ADVERTISE,
        "samples_relay": "tcp://*:*",
        "drain_poll_s": 0.02,
        "health_wait_s": 0.3,
        "events_settle_s": 0.1,
    }
    sidecar = SglangSidecar(SidecarConfig(**(settings | config)))
    await sidecar.start()
    server, port = await serve(sidecar)
    client = EngineClient(f"127.0.0.1:{port}")
    try:
        yield sidecar, client
    finally:
        await client.close()
        await server.stop(None)
        await sidecar.close()
        await fake.stop()


async def holding(fake: FakeSglang, client: EngineClient, gpu: list[int], cpu: list[int]) -> None:
    """Publishes the blocks as SGLang's cache would, once the sidecar listens, and waits until
    GetInfo counts them."""
    assert fake.kv is not None
    assert await asyncio.to_thread(fake.kv.wait_subscribed, 1)
    fake.store(gpu)
    if cpu:
        fake.store(cpu, Medium.CPU)
    await eventually(
        client.get_info,
        lambda i: (i.l1_used_blocks, i.l2_used_blocks) == (len(gpu), len(cpu)),
        "the blocks in GetInfo",
    )


def test_get_info_reports_sglang_facts_and_advertised_endpoints() -> None:
    fake = FakeSglang(page_size=4, max_total_num_tokens=4096, bootstrap_port=18998)

    async def main() -> None:
        async with running(fake) as (sidecar, client):
            info = await client.get_info()
            assert fake.kv is not None
            assert fake.kv.replay_endpoint is not None
            kv_port = fake.kv.endpoint.rsplit(":", 1)[1]
            replay_port = fake.kv.replay_endpoint.rsplit(":", 1)[1]
            relay_port = sidecar.samples_relay_endpoint.rsplit(":", 1)[1]
            assert info == EngineInfo(
                node_id=7,
                model="fake-llama",
                backend="sglang",
                phase="prefill",
                page_size=4,
                l1_capacity_blocks=1024,  # max_total_num_tokens / page
                l2_capacity_blocks=2048,  # --hicache-ratio 2 x the device pool
                http_url=f"http://{ADVERTISE}:{fake.port}",
                # SGLang binds tcp://*:P: the router gets the advertised host instead of "*".
                kv_events_endpoint=f"tcp://{ADVERTISE}:{kv_port}",
                kv_replay_endpoint=f"tcp://{ADVERTISE}:{replay_port}",
                samples_endpoint=f"tcp://{ADVERTISE}:{relay_port}",
                version="sglang 0.5.23",
                bootstrap_port=18998,
            )
            # Occupancy comes from SGLang's own KV events (requests hold none of these pages:
            # /v1/loads would say 0), and the static facts are read once.
            fake.used_tokens = 0
            await holding(fake, client, gpu=[11, 12, 13], cpu=[12, 13])
            assert [c for c in fake.calls if c[1] == "/server_info"] == [
                ("GET", "/server_info", None)
            ]

    asyncio.run(main())


def test_without_kv_events_occupancy_is_what_requests_hold() -> None:
    fake = FakeSglang(kv_events_endpoint=None, kv_replay_endpoint=None, hicache_ratio=None)

    async def main() -> None:
        async with running(fake) as (_, client):
            fake.used_tokens = 9  # 2 pages and a bit, at 4 tokens a page
            info = await client.get_info()
            assert (info.l1_used_blocks, info.l2_used_blocks, info.l2_capacity_blocks) == (3, 0, 0)
            assert (info.kv_events_endpoint, info.kv_replay_endpoint) == ("", "")

    asyncio.run(main())


def test_health_follows_sglang_and_the_sidecar_outlives_it() -> None:
    fake = FakeSglang()

    async def main() -> None:
        async with running(fake) as (_, client):
            assert (await client.health()).state == "serving"
            fake.health_status = 503
            h = await client.health()
            assert (h.state, h.phase) == ("down", "prefill")
            assert "HTTP 503" in h.reason
            fake.health_status = 200
            assert (await client.health()).state == "serving"
            # SGLang's /health may take seconds (its generation probe): Health still answers
            # within health_wait_s, with the last answer.
            fake.health_delay_s = 1.0
            started = time.monotonic()
            assert (await client.health()).state == "serving"
            assert time.monotonic() - started < 0.9
            fake.health_delay_s = 0.0
            await asyncio.sleep(1.0)  # the slow probe finishes
            await fake.stop()
            h = await client.health()
            assert h.state == "down"
            assert f"SGLang at {fake.url}" in h.reason
            # UNAVAILABLE: the engine behind the control service is not running.
            with pytest.raises(EngineUnavailableError, match=f"SGLang at {fake.url}") as e:
                await client.get_info()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_switch_drains_running_requests_then_switches_and_keeps_the_kv() -> None:
    fake = FakeSglang()

    async def main() -> None:
        async with running(fake) as (_, client):
            await holding(fake, client, gpu=[1, 2, 3], cpu=[])
            fake.switch_delay_s = 0.2
            fake.run_requests(2, 0.4)
            switch = asyncio.create_task(client.switch_phase("decode", drain_timeout_s=5.0))
            h = await eventually(client.health, lambda h: h.state != "serving", "draining")
            assert (h.state, h.phase, h.reason) == (
                "draining", "prefill", "draining for a switch to decode"
            )  # fmt: skip
            assert fake.switch_calls() == []  # nothing asked of SGLang while requests run
            r = await switch
            assert (r.phase, r.previous_phase) == ("decode", "prefill")
            assert r.drain_s >= 0.3
            assert r.switch_s >= 0.2
            assert r.total_s >= r.drain_s + r.switch_s
            assert (r.l1_blocks_kept, r.l2_blocks_kept) == (3, 0)
            assert fake.mode == "decode"
            assert fake.switch_calls() == [
                {"new_role": "decode", "decode_cuda_graph_memory_gb": 0.0}
            ]
            assert fake.flushes == 0
            assert (await client.get_info()).phase == "decode"
            assert (await client.health()).phase == "decode"
            # The current phase: nothing to do, zeros.
            again = await client.switch_phase("decode")
            assert (again.drain_s, again.switch_s, again.total_s) == (0.0, 0.0, 0.0)
            assert len(fake.switch_calls()) == 1

    asyncio.run(main())


def test_kept_blocks_are_measured_flush_and_upstream_reset_drop_them() -> None:
    fake = FakeSglang()

    async def main() -> None:
        async with running(fake) as (_, client):
            await holding(fake, client, gpu=[1, 2, 3], cpu=[2, 3])
            r = await client.switch_phase("decode", keep_kv=False)  # the Arrow-like baseline
            assert fake.flushes == 1
            assert (r.phase, r.l1_blocks_kept, r.l2_blocks_kept) == ("decode", 0, 0)
            fake.store([4, 5])
            await eventually(client.get_info, lambda i: i.l1_used_blocks == 2, "new blocks")
            # Unpatched SGLang 0.5.23 resets its tree on a switch: the count shows the loss.
            fake.reset_on_switch = True
            r = await client.switch_phase("prefill")
            assert (r.phase, r.l1_blocks_kept) == ("prefill", 0)
            assert fake.flushes == 1

    asyncio.run(main())


def test_drain_timeout_aborts_and_changes_nothing() -> None:
    fake = FakeSglang()

    async def main() -> None:
        async with running(fake) as (_, client):
            fake.run_requests(1, None)  # never finishes
            with pytest.raises(DrainTimeoutError, match="1 running") as e:
                await client.switch_phase("decode", drain_timeout_s=0.3)
            assert e.value.code == grpc.StatusCode.ABORTED
            assert fake.switch_calls() == []
            assert fake.mode == "prefill"
            h = await client.health()
            assert (h.state, h.phase) == ("serving", "prefill")

    asyncio.run(main())


def test_one_switch_at_a_time() -> None:
    fake = FakeSglang()

    async def main() -> None:
        async with running(fake) as (_, client):
            fake.run_requests(1, 0.5)
            first = asyncio.create_task(client.switch_phase("decode"))
            await eventually(client.health, lambda h: h.state == "draining", "draining")
            with pytest.raises(EngineBusyError, match="already in progress"):
                await client.switch_phase("decode")
            assert (await first).phase == "decode"
            assert len(fake.switch_calls()) == 1

    asyncio.run(main())


def test_a_request_slipping_in_before_the_switch_is_drained_again() -> None:
    fake = FakeSglang()

    async def main() -> None:
        async with running(fake) as (_, client):
            fake.arrive_on_switch_s = 0.2  # SGLang refuses: "instance is not idle"
            r = await client.switch_phase("decode", drain_timeout_s=5.0)
            assert r.phase == "decode"
            assert len(fake.switch_calls()) == 2
            assert r.drain_s >= 0.15

    asyncio.run(main())


def test_sglang_refusals_are_typed_errors_with_its_message() -> None:
    fake = FakeSglang(enable_pd_role_switch=False)

    async def main() -> None:
        async with running(fake) as (_, client):
            with pytest.raises(EngineBusyError) as e:
                await client.switch_phase("decode")
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "--enable-pd-role-switch is not set on this server" in e.value.message
            assert fake.mode == "prefill"
            assert (await client.health()).state == "serving"
            # A switch that fails half way leaves SGLang unusable (no rollback): down, and no
            # further switch is tried.
            fake.enable_pd_role_switch = True
            fake.fail_next_switch = (
                "role switch failed; instance unhealthy, restart required",
                False,
            )
            with pytest.raises(EngineBusyError, match="restart required"):
                await client.switch_phase("decode")
            h = await client.health()
            assert (h.state, h.phase) == ("down", "prefill")
            assert "restart required" in h.reason
            with pytest.raises(EngineUnavailableError, match="restart required"):
                await client.switch_phase("decode")
            assert len(fake.switch_calls()) == 2

    asyncio.run(main())


def test_eviction_hints_reach_the_scheduler_pull_socket_as_one_map(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/hints"
    fake = FakeSglang()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

    async def main() -> None:
        async with running(fake, hints_endpoint=endpoint) as (_, client):
            # The scheduler does not listen yet: the hints are dropped and the caller told so.
            with pytest.raises(EngineUnavailableError, match="not taking them"):
                await client.set_eviction_hints({5: 1}, replace=True)
            pull = context.socket(zmq.PULL)
            try:
                pull.bind(endpoint)
                low, high = -(1 << 63), (1 << 63) - 1
                result = await eventually(
                    lambda: _hints_or_none(client, {low: 2, 42: 0, high: 1}),
                    lambda r: r is not None,
                    "the PUSH to connect",
                )
                assert result == HintsResult(applied=3, ignored=0)
                await client.set_eviction_hints([(7, 3)])
                assert pull.poll(2000)
                assert msgpack.unpackb(pull.recv()) == {
                    "v": 1, "hashes": [low, 42, high], "counts": [2, 0, 1], "replace": True,
                }  # fmt: skip
                assert pull.poll(2000)
                assert msgpack.unpackb(pull.recv()) == {
                    "v": 1, "hashes": [7], "counts": [3], "replace": False,
                }  # fmt: skip
            finally:
                pull.close(linger=0)

    try:
        asyncio.run(main())
    finally:
        context.term()


async def _pause() -> None:
    await asyncio.sleep(0.02)


async def _hints_or_none(client: EngineClient, hints: dict[int, int]) -> HintsResult | None:
    try:
        return await client.set_eviction_hints(hints, replace=True)
    except EngineUnavailableError:
        return None


def test_without_a_hints_endpoint_hints_are_unimplemented(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EVOLVING_INFRA_HINTS_ENDPOINT", raising=False)
    fake = FakeSglang()

    async def main() -> None:
        async with running(fake) as (_, client):
            with pytest.raises(UnsupportedError, match="EVOLVING_INFRA_HINTS_ENDPOINT"):
                await client.set_eviction_hints({1: 1})

    asyncio.run(main())


def test_pass_metrics_reach_the_stream_and_the_router_through_the_relay(tmp_path: Path) -> None:
    fake = FakeSglang(fpm_base=f"ipc://{tmp_path}/fpm")
    prefill = Sample("prefill", 0.05, batch=((100, 20), (50, 0)))
    seen: list[Sample] = []

    async def main() -> None:
        async with running(fake) as (_, client):
            info = await client.get_info()
            assert fake.fpm is not None
            fpm = fake.fpm
            with SampleIngestor(lambda node, s: seen.append(s)) as router:
                router.add_engine(info.node_id, info.samples_endpoint)  # as the router does
                stream = client.iteration_samples()
                got: list[IterationSample] = []

                async def publish() -> None:  # until both ends have one (slow joiners)
                    while True:
                        fpm.set_idle(True)  # heartbeats too: the sidecar drops them
                        fpm.publish_sample(prefill)
                        await asyncio.sleep(0.05)

                publisher = asyncio.create_task(publish())
                try:
                    got.append(await asyncio.wait_for(anext(stream), 5.0))
                    await eventually(_pause, lambda _: bool(seen), "the router's sample")
                finally:
                    publisher.cancel()
                    await stream.aclose()
            s = got[0]
            assert (s.phase, s.wall_s, s.prefill_requests) == ("prefill", 0.05, 2)
            assert (s.prefill_uncached_tokens, s.prefill_cached_tokens) == (150, 20)
            assert s.prefill_uncached_var == 1225.0  # SGLang's variance of prompt lengths
            assert s.decode_batch_size == 0
            assert s.to_sample() == seen[0]  # both paths give the router the same sample

    asyncio.run(main())


def test_samples_without_pass_metrics_are_unimplemented() -> None:
    fake = FakeSglang()

    async def main() -> None:
        async with running(fake) as (_, client):
            with pytest.raises(UnsupportedError, match="--enable-forward-pass-metrics"):
                async for _ in client.iteration_samples():
                    pass

    asyncio.run(main())


def test_transfer_and_prefetch_are_unimplemented() -> None:
    fake = FakeSglang()

    async def main() -> None:
        async with running(fake) as (_, client):
            with pytest.raises(UnsupportedError, match="Mooncake KV manager") as e:
                await client.transfer_kv(KvLocation.node(1), KvLocation.node(7), [1, 2])
            assert e.value.code == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(UnsupportedError, match="HiCache"):
                await client.prefetch("req-1", [1, 2], source="pool")

    asyncio.run(main())


def test_router_handle_uses_the_bootstrap_port() -> None:
    fake = FakeSglang(bootstrap_port=18998)

    async def main() -> EngineInfo:
        async with running(fake) as (_, client):
            return await client.get_info()

    handle = handle_of(asyncio.run(main()))
    assert (handle.bootstrap_host, handle.bootstrap_port) == (ADVERTISE, 18998)
    assert handle.http_url == f"http://{ADVERTISE}:{fake.port}"
    # The simulated engine serves the hand-off on its HTTP port: bootstrap_port 0 says so.
    sim = EngineInfo(1, "m", "sim", "decode", 16, 10, 0, http_url="http://10.0.0.3:30001")
    assert (handle_of(sim).bootstrap_host, handle_of(sim).bootstrap_port) == ("10.0.0.3", 30001)
