"""`SimEngine`: the simulated engine with its EngineControl service (gRPC, `control/`).

`EngineCore` (core.py) is the engine; this class adds what the router and the planner ask of it
over gRPC: what it is (`GetInfo`), whether it serves (`Health`), an in-place phase switch, KV
transfers and prefetches, eviction hints and the stream of iteration samples.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import aiohttp

from evolving_infra.control.errors import (
    CapacityError,
    DrainTimeoutError,
    EngineBusyError,
    InvalidRequestError,
    UnknownBlocksError,
    UnsupportedError,
)
from evolving_infra.control.records import (
    EngineInfo,
    EvictionHints,
    Health,
    HintsResult,
    IterationSample,
    PrefetchRequest,
    PrefetchResult,
    SwitchRequest,
    SwitchResult,
    TransferRequest,
    TransferResult,
)
from evolving_infra.control.server import EngineControlService
from evolving_infra.engines.sim.core import VERSION, EngineCore, log
from evolving_infra.timing.samples import Sample

PEER_TIMEOUT_S = 2.0  # asking another engine what it holds (`_peer_held`)


class SimEngine(EngineCore, EngineControlService):
    """Build inside a running event loop; `await start()` before serving, `close()` after."""

    async def get_info(self) -> EngineInfo:
        s, kv = self.settings, self.kv
        return EngineInfo(
            node_id=s.node_id,
            model=s.deployment.model.name,
            backend="sim",
            phase=self.node.phase,
            page_size=s.page_size,
            l1_capacity_blocks=kv.l1_capacity,
            l2_capacity_blocks=kv.l2_capacity,
            l1_used_blocks=min(kv.used, kv.l1_capacity),
            l2_used_blocks=kv.l2_held,
            http_url=s.http_url,
            kv_events_endpoint=s.kv_events_endpoint,
            kv_replay_endpoint=s.kv_replay_endpoint,
            samples_endpoint=s.samples_endpoint,
            version=VERSION,
        )

    async def health(self) -> Health:
        state = self.node.state
        if self._closed:
            return Health("down", self.node.phase, "shutting down")
        if state == "draining":
            return Health("draining", self.node.phase, "draining for a phase switch")
        if state == "down":
            return Health("switching", self.node.phase, "switching phase")
        return Health("serving", self.node.phase)

    async def switch_phase(self, request: SwitchRequest) -> SwitchResult:
        if self._switching:
            raise EngineBusyError("a phase switch is already in progress")
        if request.target == self.node.phase:  # the proto's no-op: nothing drains
            phase = self.node.phase
            return SwitchResult(phase, phase, 0.0, 0.0, 0.0, self.kv.l1_held, self.kv.l2_held)
        self._switching = True
        node, s, scale = self.node, self.settings, self.env.scale
        previous, started = node.phase, self.loop.time()
        node.state = "draining"
        try:
            now = self.env.now
            handed = node.take_queued(now) + node.take_waiting()
            for sim in handed:
                live = self._by_sim.get(sim.id)
                if live is not None:
                    self._hand_back(live)
            for room in list(self._rooms.values()):  # prefills their decode side never claimed
                waiting = room.live
                if waiting is not None and not room.claimed.is_set() and waiting.task is not None:
                    waiting.task.cancel()
                    self._hand_back(waiting)
            timeout = (request.drain_timeout_s / scale) or s.drain_timeout_real_s
            deadline = started + timeout
            while self._live or not node.drained():
                left = deadline - self.loop.time()
                if left <= 0:
                    raise DrainTimeoutError(f"still {len(self._live)} requests after drain")
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)
            drained = self.loop.time()
            node.state = "down"
            await asyncio.sleep(s.switch_seconds / scale)
            node.phase = request.target
            if not request.keep_kv:
                self.hints.apply([], replace=True)
                self.kv.clear()
        finally:
            node.state = "active"
            self._switching = False
        end = self.loop.time()
        log.info("phase_switched", node=s.node_id, phase=node.phase, previous=previous)
        return SwitchResult(
            phase=node.phase,
            previous_phase=previous,
            drain_s=(drained - started) * scale,
            switch_s=(end - drained) * scale,
            total_s=(end - started) * scale,
            l1_blocks_kept=self.kv.l1_held,
            l2_blocks_kept=self.kv.l2_held,
        )

    async def _peer_held(self, address: str, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` the engine at `address` (its bootstrap, i.e.
        HTTP, host:port) holds in L1 or L2; 0 when it cannot say."""
        http = self._http
        if http is None:
            return 0
        try:
            timeout = aiohttp.ClientTimeout(total=PEER_TIMEOUT_S)
            async with http.post(
                f"http://{address}/_sim/held", json={"hashes": hashes}, timeout=timeout
            ) as r:
                body = await r.json(content_type=None)
            held = body.get("held") if r.status == 200 and isinstance(body, dict) else None
            return held if isinstance(held, int) else 0
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.info("peer_held_failed", address=address, error=str(e))
            return 0

    async def transfer_kv(self, request: TransferRequest) -> TransferResult:
        """Pulls a chain (from its first page) into this node's L1: from its own L2, or from
        another node or the pool, whose holdings the caller vouches for (the router's
        directory knows them; this engine cannot check). With a pool, the pool and other
        nodes' L2 are read through it for real: what it lacks is missing."""
        src, dst, me = request.source, request.destination, self.settings.node_id
        if dst.tier != "L1" or dst.node_id != me:
            raise UnsupportedError("the simulated engine only pulls KV into its own L1")
        hashes = list(request.hashes)
        l1, l12 = self.directory.match(hashes).node(me)
        if src.node_id == me and src.tier == "L2":
            available, bandwidth = l12, self.l2_bandwidth
        elif src.node_id == me:
            raise InvalidRequestError("TransferKV: L1 to L1 of the same node moves nothing")
        else:
            available, bandwidth = len(hashes), self.kv_bandwidth
            if self.pool is not None and src.tier != "L1":  # the pool, or an L2 kept in it
                found = await self.pool.fetch_chain(hashes[l1:])  # None: the pool failed
                available = available if found is None else l1 + found
                if src.tier == "L2" and src.address and available < len(hashes):
                    # The pool's copy of a node's L2 is put beside the model, after the block
                    # reached that L2 (and the router heard of it): a pull soon after can find
                    # it missing. The node's host memory holds it, as the simulator's reach
                    # says: asked, the node's count stands (its bytes are not copied).
                    peer = await self._peer_held(src.address, hashes)
                    if peer > available:
                        self.pool.counters.transfer_kv_from_peer += 1
                        self.pool.counters.transfer_kv_peer_blocks += peer - available
                        available = peer
        missing = hashes[available:]
        if missing:
            # The router's directory vouched for blocks the source did not have (yet, or any
            # more): the prefill computes them. Logged, as it shows a directory out of step.
            log.info("transfer_kv_short", source=f"{src.tier}@{src.node_id}", wanted=len(hashes),
                     held=l1, found=available)  # fmt: skip
        if missing and not request.allow_partial:
            raise UnknownBlocksError(f"the source lacks {len(missing)} of the blocks", missing)
        moved = max(available - l1, 0)
        seconds = self.settings.transfer_latency + moved * self.block_bytes / bandwidth
        if not request.answer_when_started:
            await asyncio.sleep(self.env.real_seconds(seconds))
        now = self.env.now
        l1 = self.directory.match(hashes).node(me)[0]  # it may have changed
        chain = hashes[l1:available]
        if chain:
            self.parents.register(hashes[:available])
            if not self.kv.reserve(len(chain), now):
                raise CapacityError(f"no room for {len(chain)} blocks in L1")
            self.kv.store(chain, hashes[l1 - 1] if l1 else None, now)
            self.kv.reserved -= len(chain)
            if request.answer_when_started:
                # In L1 from now for what the node counts, in only at `now + seconds` for the
                # prefills that read it (they wait, as they would for their own fetch).
                self.arriving(hashes[:available], now + seconds)
        return TransferResult(len(chain), len(chain) * self.block_bytes, seconds, tuple(missing))

    async def prefetch(self, request: PrefetchRequest) -> PrefetchResult:
        """Fetches a queued request's L2 blocks into L1 (this engine has no pool of its own:
        `source="pool"` reads the same host tier)."""
        live = self._live.get(request.request_id)
        if live is None or live.sim not in self.node.queue:
            raise InvalidRequestError(f"request {request.request_id!r} is not queued here")
        sim, now, me = live.sim, self.env.now, self.settings.node_id
        l1, l12 = self.directory.match(list(request.hashes)).node(me)
        missing = tuple(request.hashes[l12:])
        if missing and not request.allow_partial:
            raise UnknownBlocksError(f"{len(missing)} blocks are in no tier here", missing)
        was = sim.prefetched
        if not self.node.prefetch(sim, now):
            return PrefetchResult(0, 0, 0.0, missing)
        started = 0 if was else max(sim.cached_blocks - l1, 0)
        seconds = max(sim.fetch_ready - now, 0.0)
        if request.wait and seconds > 0:
            await asyncio.sleep(self.env.real_seconds(seconds))
            seconds = 0.0
        return PrefetchResult(started, started if seconds == 0 else 0, seconds, missing)

    async def set_eviction_hints(self, request: EvictionHints) -> HintsResult:
        applied, ignored = self.hints.apply(request.hints, request.replace)
        return HintsResult(applied, ignored)

    async def iteration_samples(self) -> AsyncGenerator[IterationSample, None]:
        q: asyncio.Queue[IterationSample | None] = asyncio.Queue(maxsize=4096)

        def put(seq: int, wall: float, sample: Sample) -> None:
            if not q.full():  # a slow subscriber loses samples, never stalls the engine
                q.put_nowait(IterationSample.from_sample(sample, seq=seq, timestamp_s=wall))

        self._streams.add(q)
        stop = self.env.subscribe(put)
        try:
            while (item := await q.get()) is not None:
                yield item
        finally:
            stop()
            self._streams.discard(q)
