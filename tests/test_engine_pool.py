"""Simulated engines sharing their L2 through a real Mooncake pool (issue 6, item 3).

Real parts only: a `mooncake_master` on loopback, each `SimEngine` with its own store worker
process, aiohttp servers on 127.0.0.1. Engine A computes a prompt and demotes it to L2 (a
small L1 and a second prompt); engine B, which never saw the prompt, serves it from the pool.
Skipped only when the Mooncake wheel is not installed (see docs/pool.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp.test_utils import TestServer

from evolving_infra import block_hashes
from evolving_infra.engines.pool import PoolConfig, PoolMaster
from evolving_infra.engines.sim import EngineSettings, SimEngine, build_app
from evolving_infra.engines.sim import command as engine_command
from evolving_infra.engines.sim.pool import parse_master, pool_config
from evolving_infra.errors import CommandError
from test_engine_sim_helpers import PAGE, RecordingSink, Running, prompt, settings

# Mooncake comes with the `pool` extra (in `dev`, which `make test` installs): without it these
# tests fail, naming the install command (`MooncakeMissingError`), rather than skip.

LEASE_MS = 1500
SCALE = 64
P_TOKENS = 102  # 25 full pages of 4, and 2 tokens left over
FILL_TOKENS = 124  # with 4 output tokens exactly fills A's 32-block L1


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolMaster]:
    with PoolMaster(log_dir=tmp_path_factory.mktemp("master"), lease_ttl_ms=LEASE_MS) as m:
        yield m


def engine_settings(node_id: int, pool: PoolConfig, **changes: Any) -> EngineSettings:
    return settings(node_id=node_id, pool=pool, **changes)


@asynccontextmanager
async def engines(*all_settings: EngineSettings) -> AsyncIterator[list[Running]]:
    """Engines started and closed in parallel: each joins the pool (~1 s) and Mooncake's
    close takes ~2 s."""
    sinks = [RecordingSink() for _ in all_settings]
    made = [SimEngine(s, kv_sink=k) for s, k in zip(all_settings, sinks, strict=True)]
    servers = [TestServer(build_app(e), host="127.0.0.1") for e in made]
    try:
        await asyncio.gather(*(e.start() for e in made))
        await asyncio.gather(*(s.start_server() for s in servers))
        async with aiohttp.ClientSession() as http:
            yield [
                Running(e, f"http://127.0.0.1:{s.port}", http, k)
                for e, s, k in zip(made, servers, sinks, strict=True)
            ]
    finally:
        await asyncio.gather(*(e.close() for e in made))
        await asyncio.gather(*(s.close() for s in servers))


def gen(ids: list[int], n: int = 4) -> dict[str, object]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n}}


async def serve(r: Running, ids: list[int]) -> dict[str, Any]:
    status, body = await r.post("/generate", gen(ids))
    assert status == 200, body
    return dict(body["meta_info"])


async def pool_info(r: Running) -> dict[str, Any]:
    status, body = await r.get("/server_info")
    assert status == 200
    return dict(body["pool"])


async def until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Polls `check`: deadlines, not sleeps of a guessed length."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        await asyncio.sleep(0.02)


async def demote_to_l2(a: Running, ids: list[int], filler: list[int]) -> list[int]:
    """A serves `ids`, then `filler` pushes all of it out of A's L1 into L2 (and the pool)."""
    hashes = block_hashes(ids, PAGE)
    assert (await serve(a, ids))["cached_tokens"] == 0
    await serve(a, filler)
    assert a.engine.directory.match(hashes).nodes[a.engine.settings.node_id] == (0, len(hashes))
    pool = a.engine.pool
    assert pool is not None
    await until(lambda: pool.in_pool >= set(hashes), 10, "A's L2 blocks in the pool")
    return hashes


def test_pool_hit_on_a_node_that_never_computed_the_prefix(
    master: PoolMaster, tmp_path: Path
) -> None:
    cfg = pool_config(master.address, settings().deployment.model, PAGE, SCALE, tmp_path)
    a_settings = engine_settings(0, cfg, l1_blocks=32, l2_blocks=32)
    b_settings = engine_settings(1, cfg, l1_blocks=64, l2_blocks=0)

    async def main() -> None:
        async with engines(a_settings, b_settings) as (a, b):
            ids, filler = prompt(1, P_TOKENS), prompt(2, FILL_TOKENS)
            hashes = await demote_to_l2(a, ids, filler)
            info_a = await pool_info(a)
            assert info_a["up"]
            assert info_a["blocks_put"] >= len(hashes) + 1  # and the output's page
            assert info_a["client"]["put_bytes"] == info_a["client"]["puts"] * cfg.block_bytes
            assert b.engine.directory.match(hashes).nodes == {}  # B never computed it

            meta = await serve(b, ids)
            assert meta["cached_tokens"] == len(hashes) * PAGE == 100  # a pool hit
            # Its bytes come beside the modelled fetch, counted once they are in.
            counts = b.engine.pool.counters if b.engine.pool is not None else None
            assert counts is not None
            await until(lambda: counts.blocks_fetched == len(hashes), 5, "the hit's bytes")
            info_b = await pool_info(b)
            assert info_b["hit_requests"] == 1
            assert info_b["blocks_fetched"] == len(hashes)
            assert info_b["bytes_fetched"] == len(hashes) * cfg.block_bytes  # real bytes moved
            assert info_b["client"]["get_bytes"] == info_b["bytes_fetched"]
            e = b.engine
            # The simulator's charge: bytes of the real block size over the pool bandwidth.
            assert e.env.fetch_seconds == pytest.approx(
                len(hashes) * e.block_bytes / e.kv_bandwidth
            )
            # The fetched blocks are B's own L1 now (its KV events say so); the pool's pseudo
            # node held them only while the request ran.
            assert e.directory.match(hashes).nodes == {1: (len(hashes), len(hashes))}
            stored = {h for ev in b.sink.events if ev[0] == "stored" for h in ev[1]}
            assert set(hashes) <= stored

            # A drops the prompt from its L2 while B's read lease still runs: the removes are
            # refused, retried, and go through once the lease is over.
            pool_a = a.engine.pool
            assert pool_a is not None
            await serve(a, prompt(3, FILL_TOKENS))
            assert a.engine.directory.match(hashes).nodes.get(0) is None
            await until(lambda: not pool_a.in_pool & set(hashes), 3 * LEASE_MS / 1000, "removes")
            info_a = await pool_info(a)
            assert info_a["remove_retries"] >= 1
            assert info_a["blocks_removed"] >= len(hashes)
            assert info_a["errors"] == 0
            assert e.pool is not None
            assert e.pool.client is not None
            assert await e.pool.client.exists(hashes) == [False] * len(hashes)

    asyncio.run(main())


def test_engine_keeps_serving_when_the_pool_dies_and_rejoins_when_it_returns(
    tmp_path: Path,
) -> None:
    with PoolMaster(log_dir=tmp_path / "master", lease_ttl_ms=200) as m:
        cfg = pool_config(m.address, settings().deployment.model, PAGE, SCALE, tmp_path)
        a_settings = engine_settings(0, cfg, l1_blocks=32, l2_blocks=64)
        b_settings = engine_settings(1, cfg, l1_blocks=64)

        async def main() -> None:
            async with engines(a_settings, b_settings) as (a, b):
                ids = prompt(1, P_TOKENS)
                await demote_to_l2(a, ids, prompt(2, FILL_TOKENS))
                assert m.pid is not None
                os.kill(m.pid, signal.SIGKILL)  # the pool dies mid-run
                with structlog.testing.capture_logs() as logs:
                    meta = await serve(b, ids)  # would have been a pool hit
                    assert meta["cached_tokens"] == 0
                    info_b = await pool_info(b)
                    assert not info_b["up"]
                    assert info_b["errors"] >= 1
                    assert info_b["blocks_fetched"] == 0
                    assert "MasterUnreachableError" in info_b["last_error"]
                    # A keeps serving too: its demotions and drops no longer reach the pool.
                    await serve(a, prompt(3, FILL_TOKENS))
                    await serve(a, prompt(4, FILL_TOKENS))
                    await until(lambda: a.engine.pool is not None and not a.engine.pool.up, 10,
                                "A notices the pool is gone")  # fmt: skip
                    assert (await serve(b, ids))["cached_tokens"] == 100  # its own L1 now
                assert any(x["event"] == "pool_down" for x in logs)
                # The master comes back (same address, empty): both engines rejoin by
                # themselves and pool hits work again.
                m.restart()
                pools = [r.engine.pool for r in (a, b)]
                await until(lambda: all(p is not None and p.up for p in pools), 30,
                            "both engines rejoin the pool")  # fmt: skip
                again = prompt(5, P_TOKENS)
                await demote_to_l2(a, again, prompt(6, FILL_TOKENS))
                assert (await serve(b, again))["cached_tokens"] == 100
                assert (await pool_info(b))["reconnects"] >= 1

        asyncio.run(main())


def test_engine_command_takes_the_pool_flags(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    engine_command.add_arguments(parser)
    args = parser.parse_args(["--pool-master", "127.0.0.1:1", "--pool-scale", "8", "--port", "0"])
    s = engine_command.settings_from(args)
    assert s.pool is not None
    assert s.pool.master == parse_master("127.0.0.1:1")
    assert s.pool.scale == 8
    assert s.pool.namespace.model == "llama-3-70b"
    assert s.pool.block_bytes == s.deployment.model.kv_bytes_per_token * 16 // 8
    assert engine_command.settings_from(parser.parse_args([])).pool is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--pool-master", "nohost"])
    # No master at that address: the engine says so (cli.main prints it, status 2), not serving.
    with pytest.raises(CommandError, match=r"cannot join the pool at 127\.0\.0\.1:1"):
        asyncio.run(engine_command.serve(args))
