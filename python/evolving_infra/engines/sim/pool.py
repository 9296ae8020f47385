"""The simulated engine's L2 in the shared Mooncake pool, and its pool hits (DESIGN §2, §4).

`EnginePool` joins one engine to the pool through a `PoolClient` (its store worker is a child
process: pyzmq and the Mooncake store cannot share the engine's process, docs/pool.md):

- **L2 in the pool.** It hears the engine's `NodeKv` (`TeeListener` next to the KV events):
  blocks demoted to L2 are `put` (a synthetic payload of the real block size over `scale`),
  blocks L2 drops are `remove`d. The node mechanics stay synchronous and the pool calls are
  not: the listener only records the latest wish per block (`want`) and wakes one flusher task,
  which sends puts, then removes, in batches. The latest wish wins, so a block demoted and
  dropped before a flush costs nothing. A remove refused under a reader's lease is retried
  after `retry_real_s` unless the block came back meanwhile: by default the lease the master
  gives under `cluster up` (`PoolMaster.lease_ttl_ms`, 1 s). A quarter of it, as before, sent
  each refused block ~4 times: 150k-185k retries per prefill engine in a two-minute parity
  run, through the same worker pipe as the puts other nodes' pulls wait for.
- **Pool hits.** Before a prefill request is queued, the engine asks `lookup` for the prompt's
  blocks after what it holds in L1/L2: one `exists` call, then `fetch_batch` of the leading run
  found (the bytes really cross Mooncake's transport into this engine's worker). The run that
  arrived is registered in the engine's local directory as held in L2 by `pseudo_node`, a node
  standing for the pool, so `m.pool` covers it and `Node.reach` (with `shared_pool=True`)
  counts it: the simulator's own `fetch_seconds` charges bytes / `pool_bandwidth` in simulated
  time and the request's cached tokens include the run. The registration lasts until the
  request is done (reference-counted per block: prompts share prefixes); by then the blocks
  are in this node's L1 and its own events say so. The pseudo node never goes through
  `NodeKv`, so it emits no KV events and changes none of the node's counts.
- **PD hand-offs through the store.** When a PD prefill is done, `offer` puts the prompt's
  blocks that are not in the pool yet (real payload size over `scale`) as *transfer objects*
  under the same keys as L2 blocks, and names them to the decode side, whose
  `fetch_transfer` really pulls them into its worker while the simulator's transfer time
  passes, never delaying it. The prefill side's `release` (the room released) drops the
  objects through the same flusher and lease-retry path as an L2 drop, unless the block is in
  this node's L2 by then.
  Open transfers count references per block: the flusher never removes a block one of them
  still needs. `fetch_chain` serves `TransferKV` from the pool the same way as a pool hit.
- **Real copies never stretch the modelled time.** A pool hit's or a transfer's count comes
  from a metadata lookup (`exists`); its bytes are fetched beside the modelled fetch and
  counted when in (`blocks_fetched`, `transfer_blocks_fetched`): the simulator charges the
  model's time, and the live engines it is compared with must too (`evolving-infra parity`).
- **Failures never reach the engine.** Any `PoolError` is logged and counted; a dead worker or
  master marks the pool down (lookups miss at once, nothing is queued) and a reconnect is tried
  with a growing back-off; once back, the blocks the node still holds in L2 are put again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from evolving_infra._core import KvDirectory, KvDirectoryError
from evolving_infra.engines.pool import (
    DEFAULT_SCALE,
    AsyncPoolClient,
    MasterAddress,
    PoolConfig,
    PoolError,
    PoolFullError,
    PoolNamespace,
    PoolUnavailableError,
    block_payload_bytes,
)
from evolving_infra.nodemodel.kv import KvListener, KvTier
from evolving_infra.timing.specs import ModelConfig

log = structlog.get_logger("evolving_infra.engines.sim")

MAX_NODE = (1 << 31) - 2  # the directory's largest node id (kvdir `MAX_NODE`)


def parse_master(text: str) -> MasterAddress:
    """`HOST:PORT` of a `mooncake_master`'s RPC port (the metrics port is not needed)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return MasterAddress(host.strip("[]"), int(port), 0)


def pool_config(
    master: MasterAddress,
    model: ModelConfig,
    page_size: int,
    scale: int = DEFAULT_SCALE,
    log_dir: Path | None = None,
) -> PoolConfig:
    """One engine's store client: namespace (model, page size), payloads of the real block
    size divided by `scale`."""
    return PoolConfig(
        master,
        PoolNamespace(model.name, page_size),
        block_bytes=block_payload_bytes(model, page_size, scale),
        scale=scale,
        log_dir=log_dir,
    )


class TeeListener:
    """A `KvListener` that forwards every change to several listeners, in order."""

    def __init__(self, *listeners: KvListener) -> None:
        self.listeners = listeners

    def stored(self, tier: KvTier, hashes: list[int], parent: int | None) -> None:
        for x in self.listeners:
            x.stored(tier, hashes, parent)

    def removed(self, tier: KvTier, hashes: list[int]) -> None:
        for x in self.listeners:
            x.removed(tier, hashes)

    def cleared(self) -> None:
        for x in self.listeners:
            x.cleared()


@dataclass(slots=True)
class PoolCounters:
    """What this engine did with the pool (blocks, and real bytes where they moved)."""

    blocks_put: int = 0  # acknowledged in the pool (new, or already there)
    put_rejected: int = 0  # no segment had room: the block is in the local L2 only
    blocks_removed: int = 0
    remove_retries: int = 0  # removes refused under a reader's lease, retried later
    lookups: int = 0
    hit_requests: int = 0  # lookups that found at least one block
    blocks_fetched: int = 0  # pool hits: blocks really fetched and counted as cached
    bytes_fetched: int = 0
    errors: int = 0
    reconnects: int = 0
    # PD hand-offs and TransferKV through the store (bytes are the pool's, scaled payloads).
    transfers_offered: int = 0  # prefill side: rooms whose blocks were all in the pool
    transfer_blocks_put: int = 0  # put for a decode side (not in the pool before)
    transfer_bytes_put: int = 0
    transfer_blocks_shared: int = 0  # already there (this node's L2, or another node's)
    transfer_blocks_fetched: int = 0  # decode side / TransferKV: really fetched
    transfer_bytes_fetched: int = 0
    transfer_fetch_real_s: float = 0.0  # wall time of those fetches: reported, never charged
    transfer_fallbacks: int = 0  # a put or fetch failed: the simulated-time-only path
    # Decode side: hand-offs whose real copy outlasted the modelled transfer (the request went
    # on at the modelled time; its room was released after the copy).
    transfer_copies_late: int = 0
    # TransferKV from the pool or another node's L2 that found only part of the chain the
    # router vouched for (the source's put not done yet, or evicted since): the prefill then
    # computes the rest, and the router's placement counted those blocks as cached.
    transfer_kv_short: int = 0
    transfer_kv_blocks_missing: int = 0
    # ... of which the source node said it held more in its L2 (`service.py`): counted as
    # moved in the model, their bytes not copied.
    transfer_kv_from_peer: int = 0
    transfer_kv_peer_blocks: int = 0


def _leading(flags: Sequence[bool]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


class EnginePool:
    """One engine's side of the shared L2 pool (see the module docstring)."""

    def __init__(
        self,
        config: PoolConfig,
        node_id: int,
        directory: KvDirectory,
        l2_blocks: Callable[[], Collection[int]],
        *,
        batch: int = 128,
        retry_real_s: float = 1.0,
        reconnect_real_s: float = 2.0,
    ) -> None:
        self.config = config
        self.directory = directory
        self.l2_blocks = l2_blocks  # what the node holds in L2 now (re-put after a reconnect)
        self.pseudo_node = MAX_NODE if node_id != MAX_NODE else MAX_NODE - 1
        self.batch = batch
        self.retry_real_s = retry_real_s
        self.reconnect_real_s = reconnect_real_s
        self.counters = PoolCounters()
        self.client: AsyncPoolClient | None = None
        self.last_error = ""
        self.want: dict[int, bool] = {}  # block -> should be in the pool (latest L2 event)
        self.in_pool: set[int] = set()  # blocks this engine put and has not removed
        self._held: dict[int, int] = {}  # pseudo-node blocks -> requests counting on them
        self._by_req: dict[int, list[int]] = {}
        self._refs: dict[int, int] = {}  # blocks -> open PD hand-offs (prefill side) needing them
        self._offered: dict[int, list[int]] = {}  # request -> its hand-off's blocks
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    @property
    def up(self) -> bool:
        return self.client is not None

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Connects (raises `PoolError`: a pool named at start that cannot be joined is a
        configuration error) and starts the flusher."""
        self.client = await AsyncPoolClient.connect(self.config)
        self._spawn(self._flush_loop())
        log.info("pool_joined", master=self.config.master.rpc, block_bytes=self.config.block_bytes)

    async def close(self) -> None:
        self._closing = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        client, self.client = self.client, None
        if client is not None:
            # Mooncake's close takes ~2 s; this engine's blocks leave the pool with it.
            with contextlib.suppress(PoolError, OSError):
                await client.close()

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- `nodemodel.kv.KvListener`: the node's L2 ---------------------------------------------

    def stored(self, tier: KvTier, hashes: list[int], parent: int | None) -> None:
        if tier == "L2" and self.client is not None:
            self.want.update(dict.fromkeys(hashes, True))
            self._wake.set()

    def removed(self, tier: KvTier, hashes: list[int]) -> None:
        if tier == "L2" and self.client is not None:
            self.want.update(dict.fromkeys(hashes, False))
            self._wake.set()

    def cleared(self) -> None:
        if self.client is not None:
            self.want = dict.fromkeys(self.in_pool | self.want.keys(), False)
            self._wake.set()

    # -- the flusher --------------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                while self.want and self.client is not None:
                    want, self.want = self.want, {}
                    puts = [h for h, w in want.items() if w and h not in self.in_pool]
                    removes = [h for h, w in want.items() if not w and h in self.in_pool]
                    await self._put(puts)
                    await self._remove(removes)
            except Exception:  # a bug here must not silently stop every later flush
                self.counters.errors += 1
                log.exception("pool_flush_failed")

    async def _put(self, hashes: list[int]) -> None:
        for i in range(0, len(hashes), self.batch):
            client = self.client
            if client is None:
                return
            chunk = hashes[i : i + self.batch]
            try:
                await client.put_batch([(h, None) for h in chunk])  # synthetic, block_bytes
                stored = chunk
            except PoolFullError as e:
                stored = e.stored
                self.counters.put_rejected += len(e.rejected)
                log.warning("pool_full", rejected=len(e.rejected))
            except PoolError as e:
                self._failed("put", e)
                continue
            self.in_pool.update(stored)
            self.counters.blocks_put += len(stored)

    async def _remove(self, hashes: list[int]) -> None:
        # A block an open hand-off still needs stays; `release` looks at it again after.
        hashes = [h for h in hashes if h not in self._refs]
        for i in range(0, len(hashes), self.batch):
            client = self.client
            if client is None:
                return
            chunk = hashes[i : i + self.batch]
            try:
                gone = await client.remove(chunk)
            except PoolError as e:
                self._failed("remove", e)
                continue
            refused = [h for h, ok in zip(chunk, gone, strict=True) if not ok]
            self.in_pool.difference_update(h for h, ok in zip(chunk, gone, strict=True) if ok)
            self.counters.blocks_removed += len(chunk) - len(refused)
            if refused:
                # NOTE: a reader's lease (any get or exists) refuses a plain remove; a forced
                # one would pull the bytes from under that reader's transfer. Try again later.
                self.counters.remove_retries += len(refused)
                asyncio.get_running_loop().call_later(self.retry_real_s, self._retry, refused)

    def _retry(self, hashes: list[int]) -> None:
        self._drop_unneeded(hashes)

    def _drop_unneeded(self, hashes: Sequence[int]) -> None:
        """Queues the removal of blocks this engine put that neither its L2 nor an open hand-off
        needs. A newer wish (the block demoted again, still pending) wins."""
        l2 = self.l2_blocks()
        for h in hashes:
            if h in self.in_pool and h not in self.want and h not in self._refs and h not in l2:
                self.want[h] = False
        self._wake.set()

    # -- failures -----------------------------------------------------------------------------

    def _failed(self, op: str, e: PoolError) -> None:
        self.counters.errors += 1
        self.last_error = f"{op}: {type(e).__name__}: {e}"
        if not isinstance(e, PoolUnavailableError):
            log.warning("pool_error", op=op, error=self.last_error)
            return
        # The worker or the master is gone: nothing this engine put is known to be in the pool
        # any more. Lookups miss until a reconnect succeeds.
        log.error("pool_down", op=op, error=self.last_error, master=self.config.master.rpc)
        client, self.client = self.client, None
        self.in_pool.clear()
        self.want.clear()
        if client is not None and not self._closing:
            self._spawn(self._reconnect(client))

    async def _reconnect(self, old: AsyncPoolClient) -> None:
        with contextlib.suppress(PoolError, OSError):
            await old.close()  # usually closed already by the client itself
        delay = self.reconnect_real_s
        while self.client is None:
            await asyncio.sleep(delay)
            try:
                client = await AsyncPoolClient.connect(self.config)
            except PoolError as e:
                log.warning("pool_reconnect_failed", error=str(e), retry_in_s=delay)
                delay = min(2 * delay, 60.0)
                continue
            self.client = client
            self.counters.reconnects += 1
            self.want = dict.fromkeys(self.l2_blocks(), True)
            self._wake.set()
            log.info("pool_rejoined", master=self.config.master.rpc, l2_blocks=len(self.want))

    # -- pool hits ----------------------------------------------------------------------------

    async def lookup(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` (the prompt's blocks after what the node holds)
        are in the pool; 0 on any failure. Their bytes are fetched into this engine's worker
        beside the modelled fetch, never delaying the request (`_fetch_beside`)."""
        if self.client is None or not hashes:
            return 0
        self.counters.lookups += 1
        n = await self._found("lookup", hashes) or 0
        if n:
            self.counters.hit_requests += 1
            self._spawn(self._fetch_beside("lookup", list(hashes[:n]), transfer=False))
        return n

    async def _found(self, op: str, hashes: Sequence[int]) -> int | None:
        """The leading run of `hashes` the pool holds (a metadata call); None when the pool is
        down or failed."""
        client = self.client
        if client is None:
            return None
        try:
            return _leading(await client.exists(list(hashes)))
        except PoolError as e:
            self._failed(op, e)
            return None

    async def _fetch_beside(self, op: str, hashes: list[int], *, transfer: bool) -> None:
        """Really fetches blocks `_found` found, while the node model charges their modelled
        fetch time: the real copy is counted and timed, never waited for (on a small machine
        the stand-in copies cost more than the modelled ones and would stretch every hit).
        Missing and failed transfers both read as None (docs/pool.md): counted as a fallback."""
        client = self.client
        if client is None:
            return
        started = time.perf_counter()
        try:
            sizes = await client.fetch_batch(hashes)
        except PoolError as e:
            self._failed(op, e)
            self._fallback(op, self.last_error)
            return
        n = _leading([s is not None for s in sizes])
        nbytes = sum(s or 0 for s in sizes[:n])
        c = self.counters
        if transfer:
            c.transfer_fetch_real_s += time.perf_counter() - started
            c.transfer_blocks_fetched += n
            c.transfer_bytes_fetched += nbytes
        else:
            c.blocks_fetched += n
            c.bytes_fetched += nbytes
        if n < len(hashes):
            self._fallback(op, f"{len(hashes) - n} of {len(hashes)} blocks gone after the lookup")

    def hold(self, req_id: int, hashes: Sequence[int], start: int, n: int) -> None:
        """Registers `hashes[start:start+n]` (fetched by request `req_id`) as held in L2 by the
        pseudo node, until `release(req_id)`. Every prompt block is known to the directory
        (the request's branch keeps placeholders), so the parent always is."""
        run = list(hashes[start : start + n])
        if not run:
            return
        try:
            self.directory.store(self.pseudo_node, "L2", run, hashes[start - 1] if start else None)
        except KvDirectoryError as e:  # an invariant broken elsewhere: no hit, no crash
            self._failed("hold", PoolError(str(e)))
            return
        for h in run:
            self._held[h] = self._held.get(h, 0) + 1
        self._by_req.setdefault(req_id, []).extend(run)

    def release(self, req_id: int) -> None:
        """The request is done: its pool-hit blocks leave the pseudo node and its hand-off's
        transfer objects (prefill side) become garbage."""
        self._end_offer(req_id)
        run = self._by_req.pop(req_id, None)
        if not run:
            return
        gone = _release(self._held, run)
        if gone:
            self.directory.remove(self.pseudo_node, "L2", gone)

    # -- PD hand-offs and TransferKV through the store ----------------------------------------

    async def offer(self, req_id: int, hashes: Sequence[int]) -> list[int] | None:
        """Prefill side, once request `req_id`'s prefill is done: makes every block of its
        prompt fetchable from the pool (those not in it yet are put, the real payload size
        over `scale`) and returns the hashes the decode side should fetch; None (the hand-off
        falls back to simulated time only) when the pool is down or a put failed. The blocks
        stay until `release(req_id)`."""
        assert req_id not in self._offered, "one hand-off per request"
        blocks = list(dict.fromkeys(hashes))
        if not blocks:
            return []
        if self.client is None:
            self._fallback("offer", "the pool is down")
            return None
        # References first: a flush in flight must not remove an L2 block this hand-off uses.
        self._offered[req_id] = blocks
        for h in blocks:
            self._refs[h] = self._refs.get(h, 0) + 1
        todo = [h for h in blocks if h not in self.in_pool]
        client = self.client
        try:
            if todo:
                # NOTE: Mooncake answers a put of a key already there with success and keeps
                # the old value (0.3.13, measured), so blocks another node put are found
                # first: readable, but not this engine's to remove afterwards.
                there = await client.exists(todo)
                todo = [h for h, t in zip(todo, there, strict=True) if not t]
            for i in range(0, len(todo), self.batch):
                chunk = todo[i : i + self.batch]
                try:
                    await client.put_batch([(h, None) for h in chunk])  # synthetic, block_bytes
                except PoolFullError as e:
                    self._own(e.stored)  # in before the pool filled: garbage of this hand-off
                    raise
                self._own(chunk)
        except PoolFullError as e:
            why = f"pool full: {len(e.rejected)} blocks rejected"
        except PoolError as e:
            self._failed("offer", e)
            why = self.last_error
        else:
            if req_id not in self._offered:  # released while the puts ran: nobody fetches
                self._drop_unneeded(todo)
                return None
            self.counters.transfers_offered += 1
            self.counters.transfer_blocks_shared += len(blocks) - len(todo)
            return blocks
        self._end_offer(req_id)
        self._fallback("offer", why)
        return None

    def _own(self, hashes: list[int]) -> None:
        self.in_pool.update(hashes)
        self.counters.transfer_blocks_put += len(hashes)
        self.counters.transfer_bytes_put += len(hashes) * self.config.block_bytes

    def _end_offer(self, req_id: int) -> None:
        blocks = self._offered.pop(req_id, None)
        if not blocks:
            return
        self._drop_unneeded(_release(self._refs, blocks))

    def _fallback(self, op: str, why: str) -> None:
        self.counters.transfer_fallbacks += 1
        log.warning("pool_transfer_fallback", op=op, reason=why)

    async def fetch_transfer(self, offered: object, need: Sequence[int]) -> None:
        """Decode side: really fetches the blocks of `need` (those it lacks) that the prefill
        side `offer`ed (from its room's JSON, so checked here). Never raises: a failure is
        counted and the hand-off is the simulated-time-only one."""
        if not isinstance(offered, list) or not all(type(h) is int for h in offered):
            self._fallback("fetch", "the prefill side's answer names no blocks")
            return
        listed = set(offered)
        todo = [h for h in need if h in listed]
        client = self.client
        if not todo:
            return
        if client is None:
            self._fallback("fetch", "the pool is down")
            return
        started = time.perf_counter()
        sizes: list[int | None] = []
        try:
            for i in range(0, len(todo), self.batch):
                sizes += await client.fetch_batch(todo[i : i + self.batch])
        except PoolError as e:
            self._failed("fetch", e)
            self._fallback("fetch", self.last_error)
            return
        finally:
            c = self.counters
            c.transfer_fetch_real_s += time.perf_counter() - started
            c.transfer_blocks_fetched += sum(s is not None for s in sizes)
            c.transfer_bytes_fetched += sum(s or 0 for s in sizes)
        if None in sizes:
            self._fallback("fetch", f"{sizes.count(None)} of {len(todo)} blocks missing")

    async def fetch_chain(self, hashes: Sequence[int]) -> int | None:
        """`TransferKV` from the pool (or a node's L2 kept there): how many leading blocks of
        `hashes` the pool holds, their bytes fetched beside the modelled transfer as for a pool
        hit; None when the pool is down or failed (the caller falls back to what the request
        vouches for)."""
        if not hashes:
            return 0
        n = await self._found("transfer_kv", hashes)
        if n is None:
            self._fallback("transfer_kv", self.last_error or "the pool is down")
            return None
        if n < len(hashes):
            self.counters.transfer_kv_short += 1
            self.counters.transfer_kv_blocks_missing += len(hashes) - n
        if n:
            self._spawn(self._fetch_beside("transfer_kv", list(hashes[:n]), transfer=True))
        return n

    # -- views --------------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """What `/server_info` reports under `pool`."""
        c = self.config
        client = self.client
        return {
            "master": c.master.rpc,
            "namespace": f"{c.namespace.model}/p{c.namespace.page_size}",
            "block_bytes": c.block_bytes,
            "scale": c.scale,
            "up": client is not None,
            "blocks_in_pool": len(self.in_pool),
            "pending": len(self.want),
            "open_transfers": len(self._offered),
            **dataclasses.asdict(self.counters),
            "last_error": self.last_error,
            "client": None if client is None else dataclasses.asdict(client.stats()),
        }


def _release(counts: dict[int, int], hashes: Sequence[int]) -> list[int]:
    """Takes one reference off each of `hashes`; returns those left with none."""
    free: list[int] = []
    for h in hashes:
        left = counts[h] - 1
        if left:
            counts[h] = left
        else:
            del counts[h]
            free.append(h)
    return free
