"""PD hand-offs and TransferKV whose KV bytes really travel through the Mooncake store (issue 6,
item 3).

Real parts only: a `mooncake_master` on loopback, `SimEngine`s each with its own store worker
process, aiohttp servers on 127.0.0.1; the decode engine polls the prefill engine's bootstrap
endpoint as in `test_engine_sim_pd.py`. Skipped only when the Mooncake wheel is not installed.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from evolving_infra import block_hashes
from evolving_infra.control.errors import UnknownBlocksError
from evolving_infra.control.records import KvLocation, TransferRequest
from evolving_infra.engines.pool import PoolConfig, PoolMaster
from evolving_infra.engines.sim.pool import EnginePool, pool_config
from test_engine_pool import demote_to_l2, engines, pool_info, until
from test_engine_sim_helpers import PAGE, Running, prompt, running, settings
from test_engine_sim_pd import pd_body

# Mooncake comes with the `pool` extra (in `dev`, which `make test` installs): without it these
# tests fail, naming the install command (`MooncakeMissingError`), rather than skip.

LEASE_MS = 500  # the decode side's read lease delays the prefill side's removes this long
SCALE = 64
P_TOKENS = 102  # 25 full pages of 4, and 2 tokens left over
FILL_TOKENS = 124  # with 4 output tokens exactly fills a 32-block L1


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolMaster]:
    with PoolMaster(log_dir=tmp_path_factory.mktemp("master"), lease_ttl_ms=LEASE_MS) as m:
        yield m


def config(master: PoolMaster, tmp_path: Path) -> PoolConfig:
    return pool_config(master.address, settings().deployment.model, PAGE, SCALE, tmp_path)


async def pd(p: Running, d: Running, ids: list[int], room: int, n: int = 6) -> dict[str, Any]:
    """One PD request as the router sends it: the same body to both engines at once."""
    body = pd_body(ids, n, p.port, room)
    (sp, out_p), (sd, out_d) = await asyncio.gather(
        p.post("/generate", body), d.post("/generate", body)
    )
    assert (sp, sd) == (200, 200), (out_p, out_d)
    assert out_p["output_ids"] == out_d["output_ids"][:1]
    return dict(out_d)


def the_pool(r: Running) -> EnginePool:
    pool = r.engine.pool
    assert pool is not None
    return pool


async def in_pool(r: Running, hashes: list[int]) -> list[bool]:
    client = the_pool(r).client
    assert client is not None
    return await client.exists(hashes)


def master_puts(master: PoolMaster) -> float:
    """Objects put, by Mooncake's own count (single and batched puts)."""
    m = master.metrics()
    return m["master_put_start_requests_total"] + m["master_batch_put_start_items_total"]


def test_pd_blocks_travel_through_the_store_and_are_removed_after(
    master: PoolMaster, tmp_path: Path
) -> None:
    cfg = config(master, tmp_path)
    ids = prompt(1, P_TOKENS)
    hashes = block_hashes(ids, PAGE)

    async def reference() -> dict[str, Any]:
        async with (
            running(settings(node_id=0, phase="prefill")) as p,
            running(settings(node_id=1, phase="decode")) as d,
        ):
            return await pd(p, d, ids, room=41)

    async def main() -> None:
        want = await reference()  # the same pair without a pool
        puts_before = master_puts(master)
        p_settings = settings(node_id=0, phase="prefill", pool=cfg)
        d_settings = settings(node_id=1, phase="decode", pool=cfg)
        async with engines(p_settings, d_settings) as (p, d):
            out = await pd(p, d, ids, room=42)
            assert out["output_ids"] == want["output_ids"]
            assert out["meta_info"]["cached_tokens"] == want["meta_info"]["cached_tokens"] == 0
            info_p, info_d = await pool_info(p), await pool_info(d)
            assert info_p["transfers_offered"] == 1
            assert info_p["transfer_blocks_put"] == len(hashes) == 25
            assert info_p["transfer_bytes_put"] == 25 * cfg.block_bytes
            assert info_p["client"]["put_bytes"] == 25 * cfg.block_bytes
            # The decode side fetched every full page of the prompt, real bytes through Mooncake.
            assert info_d["transfer_blocks_fetched"] == 25
            assert info_d["transfer_bytes_fetched"] == 25 * cfg.block_bytes
            assert info_d["client"]["get_bytes"] == 25 * cfg.block_bytes
            assert info_d["transfer_fetch_real_s"] > 0
            assert info_p["transfer_fallbacks"] == info_d["transfer_fallbacks"] == 0

            # Garbage: once released, the prefill side removes its transfer objects (the
            # decode side's read lease refuses the first try).
            pool_p = the_pool(p)
            await until(lambda: not pool_p.in_pool and not pool_p.want, 4 * LEASE_MS / 1000,
                        "the transfer objects removed")  # fmt: skip
            assert not pool_p._refs
            assert await in_pool(d, hashes) == [False] * 25
            info_p = await pool_info(p)
            assert info_p["blocks_removed"] == 25
            assert info_p["open_transfers"] == 0
            # Mooncake's own account agrees: 25 objects put, all gone again.
            assert master_puts(master) - puts_before == 25
            assert master.metrics()["master_allocated_bytes"] == 0

            # Turn two: the decode engine caches the prompt now and fetches none of it.
            out = await pd(p, d, ids, room=43, n=3)
            assert out["meta_info"]["cached_tokens"] == 100
            info_d = await pool_info(d)
            assert info_d["transfer_blocks_fetched"] == 25
            assert info_d["transfer_fallbacks"] == 0

    asyncio.run(main())


def test_pd_reuses_l2_blocks_in_the_pool_and_they_stay(master: PoolMaster, tmp_path: Path) -> None:
    """The prompt is already in the prefill engine's L2 (so in the pool): nothing is put for the
    hand-off and nothing removed after it. TransferKV on a third engine reads the same blocks
    from the pool for real (a chain the pool lacks is missing), and that engine's own hand-off
    of the prompt leaves the other engine's objects alone."""
    cfg = config(master, tmp_path)
    ids = prompt(2, P_TOKENS)
    hashes = block_hashes(ids, PAGE)
    p_settings = settings(node_id=0, phase="prefill", pool=cfg, l1_blocks=32, l2_blocks=64)
    d_settings = settings(node_id=1, phase="decode", pool=cfg)
    x_settings = settings(node_id=2, phase="prefill", pool=cfg)

    async def main() -> None:
        async with engines(p_settings, d_settings, x_settings) as (p, d, x):
            await demote_to_l2(p, ids, prompt(3, FILL_TOKENS))
            await pd(p, d, ids, room=51)
            info_p, info_d = await pool_info(p), await pool_info(d)
            assert info_p["transfers_offered"] == 1
            assert info_p["transfer_blocks_shared"] == 25
            assert info_p["transfer_blocks_put"] == 0
            assert info_d["transfer_bytes_fetched"] == 25 * cfg.block_bytes
            pool_p = the_pool(p)
            await until(lambda: not pool_p._refs, 2, "the hand-off closed")
            await asyncio.sleep(2 * LEASE_MS / 1000)  # a wrong remove would have gone through
            assert pool_p.in_pool >= set(hashes)
            assert await in_pool(x, hashes) == [True] * 25

            me = KvLocation.node(2, "L1")
            got = await x.engine.transfer_kv(
                TransferRequest(KvLocation.node(0, "L2"), me, tuple(hashes))
            )
            assert got.blocks_moved == 25
            assert got.bytes == 25 * x.engine.block_bytes  # the modelled KV, as without a pool
            # The bytes come beside the modelled transfer, counted once they are in.
            fetched = the_pool(x).counters
            await until(lambda: fetched.transfer_blocks_fetched == 25, 5, "the bytes fetched")
            info_x = await pool_info(x)
            assert info_x["transfer_blocks_fetched"] == 25
            assert info_x["transfer_bytes_fetched"] == 25 * cfg.block_bytes
            assert x.engine.directory.match(hashes).nodes[2] == (25, 25)
            # X hands the same prompt off: the blocks are P's objects, read but never X's.
            await pd(x, d, ids, room=52)
            info_x = await pool_info(x)
            assert (info_x["transfer_blocks_shared"], info_x["transfer_blocks_put"]) == (25, 0)
            await until(lambda: not the_pool(x)._refs, 2, "X's hand-off closed")
            assert not the_pool(x).in_pool & set(hashes)
            other = block_hashes(prompt(4, 40), PAGE)
            with pytest.raises(UnknownBlocksError):
                await x.engine.transfer_kv(TransferRequest(KvLocation.pool(), me, tuple(other)))

    asyncio.run(main())


def test_pd_completes_when_the_pool_dies(master: PoolMaster, tmp_path: Path) -> None:
    """A decode engine that cannot fetch the blocks (it joined another pool) and a pool killed
    mid-run: the hand-offs fall back to simulated time only, and every request completes."""
    with PoolMaster(log_dir=tmp_path / "master", lease_ttl_ms=200) as m:
        cfg = config(m, tmp_path)
        p_settings = settings(node_id=0, phase="prefill", pool=cfg)
        d_settings = settings(node_id=1, phase="decode", pool=cfg)
        elsewhere = settings(node_id=2, phase="decode", pool=config(master, tmp_path))

        async def main() -> None:
            async with engines(p_settings, d_settings, elsewhere) as (p, d, e):
                await pd(p, d, prompt(5, P_TOKENS), room=61)
                out = await pd(p, e, prompt(6, P_TOKENS), room=62)
                assert len(out["output_ids"]) == 6
                info_e = await pool_info(e)
                assert info_e["transfer_fallbacks"] == 1  # 25 of 25 blocks missing
                assert info_e["transfer_bytes_fetched"] == 0
                assert m.pid is not None
                os.kill(m.pid, signal.SIGKILL)  # the pool dies mid-run (removes in flight)
                for room in (63, 64):
                    out = await pd(p, d, prompt(room, P_TOKENS), room=room)
                    assert len(out["output_ids"]) == 6
                info_p, info_d = await pool_info(p), await pool_info(d)
                assert not info_p["up"]
                assert info_p["transfers_offered"] == 2
                assert info_p["transfer_fallbacks"] == 2
                assert info_d["transfer_fallbacks"] == 2  # the prefill side offered nothing
                assert info_d["transfer_blocks_fetched"] == 25  # the first request only

        asyncio.run(main())


def test_a_copy_slower_than_the_modelled_transfer_is_reported_not_charged(
    master: PoolMaster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real copy through the pool runs beside the modelled transfer: when it takes longer
    (a loaded machine: here held 1.5 s), the decode side goes on at the modelled time, counts
    the copy late, and releases the room (the prefill side's answer, its pins) only after it.
    The simulator charges the transfer the model gives; so must the engines it is compared
    with (`evolving-infra parity`)."""
    cfg = config(master, tmp_path)
    ids = prompt(2, P_TOKENS)
    slow = EnginePool.fetch_transfer

    async def held(self: EnginePool, offered: object, need: Any) -> None:
        await asyncio.sleep(1.5)
        await slow(self, offered, need)

    monkeypatch.setattr(EnginePool, "fetch_transfer", held)

    async def main() -> None:
        p_settings = settings(node_id=0, phase="prefill", pool=cfg)
        d_settings = settings(node_id=1, phase="decode", pool=cfg)
        async with engines(p_settings, d_settings) as (p, d):
            loop = asyncio.get_running_loop()
            body = pd_body(ids, 6, p.port, 51)
            start = loop.time()
            prefill = asyncio.ensure_future(p.post("/generate", body))
            status, out = await d.post("/generate", body)
            decoded = loop.time() - start
            assert status == 200, out
            assert len(out["output_ids"]) == 6
            assert decoded < 1.0  # not held for the copy
            assert not prefill.done()  # the room is released after the copy
            sp, out_p = await prefill
            assert sp == 200, out_p
            assert loop.time() - start >= 1.5
            info_d = await pool_info(d)
            assert info_d["transfer_copies_late"] == 1
            assert info_d["transfer_blocks_fetched"] == 25  # the bytes still moved
            assert info_d["transfer_fallbacks"] == 0

    asyncio.run(main())


def test_a_pull_from_a_node_l2_the_pool_lags_asks_that_node(
    master: PoolMaster, tmp_path: Path
) -> None:
    """The pool's copy of a node's L2 is put after the block reached that L2, so a pull soon
    after can find it missing (parity saw 10-12 such pulls a run, 2-3% of the prompt tokens
    recomputed). Named with its address, the source node is asked and its count stands."""
    cfg = config(master, tmp_path)
    ids = prompt(5, P_TOKENS)
    p_settings = settings(node_id=0, phase="prefill", pool=cfg, l1_blocks=32, l2_blocks=64)
    x_settings = settings(node_id=2, phase="prefill", pool=cfg)

    async def main() -> None:
        async with engines(p_settings, x_settings) as (p, x):
            hashes = await demote_to_l2(p, ids, prompt(6, FILL_TOKENS))
            client = the_pool(p).client
            assert client is not None
            # The pool without them, P's L2 with them: as before P's flusher put them.
            assert await client.remove(hashes, force=True) == [True] * len(hashes)
            me = KvLocation.node(2, "L1")
            blind = await x.engine.transfer_kv(
                TransferRequest(KvLocation.node(0, "L2"), me, tuple(hashes), allow_partial=True)
            )
            assert (blind.blocks_moved, len(blind.missing_hashes)) == (0, len(hashes))
            source = KvLocation.node(0, "L2", f"127.0.0.1:{p.port}")
            got = await x.engine.transfer_kv(
                TransferRequest(source, me, tuple(hashes), allow_partial=True)
            )
            assert (got.blocks_moved, got.missing_hashes) == (len(hashes), ())
            assert x.engine.directory.match(hashes).nodes[2][0] == len(hashes)
            info = await pool_info(x)
            assert (info["transfer_kv_from_peer"], info["transfer_kv_peer_blocks"]) == (1, 25)
            assert info["transfer_kv_short"] == 2  # the pool lacked them both times
            # A peer that cannot say (gone, or not an engine) leaves the pull short.
            gone = KvLocation.node(0, "L2", "127.0.0.1:1")
            other = block_hashes(prompt(7, P_TOKENS), PAGE)
            short = await x.engine.transfer_kv(
                TransferRequest(gone, me, tuple(other), allow_partial=True)
            )
            assert short.blocks_moved == 0

    asyncio.run(main())
