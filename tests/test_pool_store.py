"""The shared L2 pool against a real `mooncake_master` and real store workers on loopback.

Every client runs its own store worker process, so "put in one client, get in another" crosses
processes and Mooncake's TCP transport. Skipped only when the Mooncake wheel is not installed;
a wheel that is installed but cannot load its system libraries fails (see docs/pool.md).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from evolving_infra.engines.pool import (
    AsyncPoolClient,
    MasterAddress,
    MasterStartError,
    MasterUnreachableError,
    MooncakeMissingError,
    PoolClient,
    PoolConfig,
    PoolFullError,
    PoolMaster,
    PoolNamespace,
    PoolTimeoutError,
    PoolUnavailableError,
    block_payload_bytes,
    synthetic_payload,
)
from evolving_infra.engines.pool import master as master_mod
from evolving_infra.ports import free_ports
from evolving_infra.timing.specs import LLAMA3_8B, LLAMA3_70B

# Mooncake comes with the `pool` extra (in `dev`, which `make test` installs): without it these
# tests fail, naming the install command (`MooncakeMissingError`), rather than skip.

MiB = 2**20
LEASE_MS = 1000
NS = PoolNamespace("llama-3-70b", 64)

ClientFactory = Callable[..., PoolClient]


def close_all(clients: list[PoolClient]) -> None:
    # NOTE: Mooncake's store.close() takes ~2 s (it joins its threads); close in parallel.
    with ThreadPoolExecutor(max(1, len(clients))) as pool:
        list(pool.map(lambda c: c.close(), clients))


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolMaster]:
    with PoolMaster(log_dir=tmp_path_factory.mktemp("master"), lease_ttl_ms=LEASE_MS) as m:
        yield m


def make_factory(master: PoolMaster, log_dir: Path) -> tuple[ClientFactory, list[PoolClient]]:
    clients: list[PoolClient] = []

    def make(**overrides: object) -> PoolClient:
        fields: dict[str, object] = {
            "master": master.address,
            "namespace": NS,
            "block_bytes": 64 * 1024,
            "segment_bytes": 16 * MiB,
            "local_buffer_bytes": 16 * MiB,
            "log_dir": log_dir,
        }
        fields.update(overrides)
        client = PoolClient(PoolConfig(**fields))  # type: ignore[arg-type]
        clients.append(client)
        return client

    return make, clients


@pytest.fixture
def new_client(master: PoolMaster, tmp_path: Path) -> Iterator[ClientFactory]:
    make, clients = make_factory(master, tmp_path)
    yield make
    close_all(clients)


@pytest.fixture(scope="module")
def pair(
    master: PoolMaster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[PoolClient, PoolClient]]:
    """Two engines' clients shared by the module's tests (each test uses its own hashes):
    a worker's start and Mooncake's ~2 s close are paid once."""
    make, clients = make_factory(master, tmp_path_factory.mktemp("workers"))
    yield make(), make()
    close_all(clients)


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll `check` until true; the seconds it took. Deadlines, not sleeps of a guessed length."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - start


def test_put_in_one_client_get_in_another(pair: tuple[PoolClient, PoolClient]) -> None:
    a, b = pair
    b_before, a_before = b.stats(), a.stats()
    assert a.worker_pid != b.worker_pid != os.getpid()
    real = os.urandom(3000)
    a.put(101, real)
    a.put_batch([(102, None), (103, 5000)])
    assert b.get(101) == real
    assert b.get_batch([102, 103, 999]) == [
        synthetic_payload(102, 64 * 1024),
        synthetic_payload(103, 5000),
        None,
    ]
    assert b.exists([101, 102, 103, 999]) == [True, True, True, False]
    assert b.fetch_batch([102, 999]) == [64 * 1024, None]
    stats = b.stats()
    assert stats.gets - b_before.gets == 6
    assert stats.hits - b_before.hits == 4
    assert stats.get_bytes - b_before.get_bytes == 3000 + 2 * 64 * 1024 + 5000
    assert a.stats().puts - a_before.puts == 3
    # A block already present (same hash, same content) is not an error.
    a.put(101, real)


def test_signed_hashes_and_namespaces_do_not_collide(pair: tuple[PoolClient, PoolClient]) -> None:
    a, _ = pair
    edges = [-(2**63), -1, 0, 2**63 - 1]
    a.put_batch([(h, 64) for h in edges])
    assert [a.get(h) for h in edges] == [synthetic_payload(h, 64) for h in edges]
    keys = {NS.key(h) for h in edges}
    assert len(keys) == 4
    # Other models and page sizes live under other prefixes.
    for ns in (PoolNamespace("llama-3-8b", 64), PoolNamespace("llama-3-70b", 16)):
        assert keys.isdisjoint(ns.key(h) for h in edges)
    assert NS.key(-1) == "ei/llama-3-70b/p64/ffffffffffffffff"
    with pytest.raises(ValueError, match="signed 64-bit"):
        a.put(2**63)
    with pytest.raises(ValueError, match="empty"):
        a.put(1, b"")


def test_remove_waits_for_the_read_lease_unless_forced(
    pair: tuple[PoolClient, PoolClient],
) -> None:
    a, b = pair
    a.put_batch([(1001, 128), (1002, 128)])
    t_read = time.monotonic()
    assert b.get_batch([1001, 1002]) == [synthetic_payload(h, 128) for h in (1001, 1002)]
    first = a.remove([1001])
    if time.monotonic() - t_read < LEASE_MS / 1000 * 0.8:
        # Only meaningful while the lease the read took is certainly still running.
        assert first == [False]
        assert a.get(1001) == synthetic_payload(1001, 128)
    # The lease runs out: the plain remove goes through, polled against a deadline.
    wait_until(lambda: a.remove([1001]) == [True], 5 * LEASE_MS / 1000, "lease expiry")
    assert b.exists([1001]) == [False]
    assert b.get(1001) is None
    assert a.remove([1002], force=True) == [True]
    assert b.get(1002) is None
    assert a.remove([12345]) == [True]  # absent: already gone


@pytest.fixture
def small_master(tmp_path: Path) -> Iterator[PoolMaster]:
    # Its own master, so the pool's capacity is exactly the two segments below.
    with PoolMaster(log_dir=tmp_path, lease_ttl_ms=200) as m:
        yield m


def test_pool_full_is_a_typed_error_and_loses_nothing(
    small_master: PoolMaster, tmp_path: Path
) -> None:
    make, clients = make_factory(small_master, tmp_path)
    try:
        block = 2 * MiB  # 8 blocks per 16 MiB segment
        a = make(block_bytes=block)
        b = make(block_bytes=block)
        a.put_batch([(h, None) for h in range(10)])  # 8 in a's segment, 2 spill into b's
        with pytest.raises(PoolFullError) as err:
            b.put_batch([(h, None) for h in range(100, 110)])
        assert err.value.stored == list(range(100, 106))
        assert err.value.rejected == list(range(106, 110))
        with pytest.raises(PoolFullError):
            a.put(200)
        # Nothing was evicted to make room: the master's eviction is off and blocks are pinned.
        everything = list(range(10)) + list(range(100, 106))
        assert a.exists(everything) == [True] * 16
        got = b.get_batch(everything)
        assert got == [synthetic_payload(h, block) for h in everything]
        assert small_master.metrics()["master_allocated_bytes"] == 16 * block
        assert b.stats().full_rejections == 4
        # Room made by a (forced) remove is usable again.
        assert a.remove([0, 1], force=True) == [True, True]
        b.put_batch([(106, None), (107, None)])
        assert a.exists([106, 107]) == [True, True]
    finally:
        close_all(clients)


def test_killed_worker_raises_and_a_new_client_works(
    pair: tuple[PoolClient, PoolClient], new_client: ClientFactory
) -> None:
    _, b = pair
    a = new_client()
    b.put(7, 256)
    os.kill(a.worker_pid, signal.SIGKILL)
    with pytest.raises(PoolUnavailableError) as err:
        a.get(7)
    assert err.value.returncode == -signal.SIGKILL
    assert a.closed
    with pytest.raises(PoolUnavailableError, match="closed"):
        a.exists([7])
    c = new_client()
    assert c.get(7) == synthetic_payload(7, 256)


def test_hung_worker_times_out_instead_of_hanging(new_client: ClientFactory) -> None:
    a = new_client(call_timeout_s=0.5)
    os.kill(a.worker_pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(PoolTimeoutError):
        a.put(1, 4 * MiB)  # larger than a pipe buffer: the write side must time out too
    assert time.monotonic() - start < 3
    assert a.closed


def test_no_master_is_a_typed_error_within_a_timeout() -> None:
    # Mooncake's own setup would retry for ~90 s; the client checks the address first.
    (port,) = free_ports(1)
    cfg = PoolConfig(MasterAddress("127.0.0.1", port, port), NS, block_bytes=64)
    with pytest.raises(ValueError, match="at least"):
        PoolConfig(MasterAddress("127.0.0.1", port, port), NS, 64, segment_bytes=MiB)
    start = time.monotonic()
    with pytest.raises(MasterUnreachableError):
        PoolClient(cfg)
    assert time.monotonic() - start < 3


def test_master_gone_mid_session_closes_the_client(tmp_path: Path) -> None:
    with PoolMaster(log_dir=tmp_path, lease_ttl_ms=200) as m:
        make, clients = make_factory(m, tmp_path)
        a = make()
        a.put(1, 64)
    start = time.monotonic()
    with pytest.raises(MasterUnreachableError):
        a.put(2, 64)
    assert time.monotonic() - start < 5
    assert a.closed
    close_all(clients)


def test_master_start_failure_is_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A port another process listens on: the master exits; the connect test alone would
        # have been fooled by the other listener.
        monkeypatch.setattr(master_mod, "free_ports", lambda n: [port, port + 1][:n])
        with pytest.raises(MasterStartError) as err:
            PoolMaster(attempts=1, start_timeout_s=10).start()
    assert err.value.returncode == 1


def test_missing_mooncake_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    # The one stand-in in this file: an uninstalled wheel cannot be had on a machine that has it.
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(MooncakeMissingError, match=r"pip install .evolving-infra\[pool\]."):
        PoolMaster().start()


def test_payload_size_is_the_real_block_size_scaled() -> None:
    # Llama-3-70B: 2 (K,V) x 80 layers x 8 KV heads x 128 dims x 2 bytes = 320 KiB per token.
    assert block_payload_bytes(LLAMA3_70B, 64, scale=1) == 64 * 327_680
    assert block_payload_bytes(LLAMA3_70B, 64) == 20 * 1024
    assert block_payload_bytes(LLAMA3_8B, 16, scale=1000) == 2098  # ceil(2_097_152 / 1000)
    with pytest.raises(ValueError, match="positive"):
        block_payload_bytes(LLAMA3_70B, 64, scale=0)


def test_client_stores_scaled_blocks_and_reports_the_scale(
    pair: tuple[PoolClient, PoolClient],
) -> None:
    a, b = pair  # configured with the 64 KiB blocks of `make_factory`
    before = a.stats()
    a.put(-42)
    a.put(-43, block_payload_bytes(LLAMA3_70B, 64, scale=512))
    assert [len(v or b"") for v in b.get_batch([-42, -43])] == [64 * 1024, 40 * 1024]
    stats = a.stats()
    assert (stats.scale, stats.block_bytes, stats.segment_bytes) == (1024, 64 * 1024, 16 * MiB)
    assert stats.put_bytes - before.put_bytes == (64 + 40) * 1024


def test_async_client(
    pair: tuple[PoolClient, PoolClient], master: PoolMaster, tmp_path: Path
) -> None:
    cfg = PoolConfig(master.address, NS, block_bytes=4096, log_dir=tmp_path)

    async def scenario() -> None:
        a = await AsyncPoolClient.connect(cfg)
        b = AsyncPoolClient(pair[1])
        try:
            await a.put_batch([(h, None) for h in range(500, 520)])
            # The loop keeps running while calls are in flight in threads.
            got, _ = await asyncio.gather(b.get_batch(list(range(500, 520))), asyncio.sleep(0))
            assert got == [synthetic_payload(h, 4096) for h in range(500, 520)]
            # The get batch is cut by b's own 64 KiB hint; 4 KiB blocks fit many per chunk.
            assert await b.exists([500, 9999]) == [True, False]
            assert await a.remove([500], force=True) == [True]
            assert await b.get(500) is None
            assert a.stats().puts == 20
        finally:
            await a.close()

    asyncio.run(scenario())


def test_engine_process_with_pyzmq_uses_the_pool(pair: tuple[PoolClient, PoolClient]) -> None:
    """The reason for the worker process: pyzmq and `mooncake.store` abort in one process."""
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    try:
        pub.bind("tcp://127.0.0.1:*")
        a, b = pair
        a.put(3001, 512)
        pub.send_multipart([b"kv", b"event"])
        assert b.get(3001) == synthetic_payload(3001, 512)
        maps = Path(f"/proc/{a.worker_pid}/maps").read_text()
        assert "store.so" in maps
        assert "zmq" not in maps
    finally:
        pub.close(linger=0)
        ctx.term()


def test_a_long_prompt_is_fetched_within_the_transports_queue(new_client: ClientFactory) -> None:
    """3,000 small blocks in one fetch: Mooncake's TCP transport queues at most 1,024 transfers
    per peer and fails the rest at once ("queue-full"), which made the worker refetch them one
    by one past its call timeout. The worker cuts batches below that bound (MAX_BATCH_KEYS)."""
    a, b = new_client(block_bytes=1024), new_client(block_bytes=1024)
    hashes = list(range(70_000, 73_000))
    a.put_batch([(h, None) for h in hashes])
    assert b.fetch_batch(hashes) == [1024] * len(hashes)
    for client in (a, b):
        assert "queue-full" not in client.log_path.read_text(errors="replace")
