"""`EngineCore`: one simulated engine node, the simulator's `Node` under a real-time driver
(`service.SimEngine` adds its EngineControl service).

A request's life (SGLang's PD protocol, notes §1.2-1.5):
- **mixed** (no bootstrap fields; prefill-phase engines only): queued and prefilled
  (`Node.enqueue`, chunked iterations), then handed to its own decode batch (`Node.offer`,
  waiting while its KV does not fit), one token per decode iteration.
- **prefill** (bootstrap fields, prefill phase): queued and prefilled the same way; the prompt's
  KV then stays pinned until the decode engine has pulled it: the decode side long-polls
  `GET /_sim/kv/{room}` on this engine, waits the transfer time, then `POST
  /_sim/kv/{room}/release`, and this engine `release`s the pins and answers its own `/generate`
  with the first token. A decode side that never comes is given up after `kv_hold_timeout_s`.
- **decode** (bootstrap fields, decode phase): admitted when its prompt + output KV fits
  (`Node.offer`), pulls the KV from `bootstrap_host:bootstrap_port` (the prefill engine's HTTP
  port) for bytes / `kv_bandwidth` simulated seconds, joins the batch (`Node.arrive`) and
  streams one token per iteration. The first token is the prefill engine's.
After decoding, the prompt and output pages stay cached (what `next_hashes` gives the node).

Phase switch: stop accepting; queued requests not started and decode requests still waiting
for KV room are handed back at once with 503 (the router retries them elsewhere: a switch must
not wait behind a long queue); running ones finish; then `switch_seconds` pass and the node
flips in place, keeping its KV unless asked not to. Durations in results are simulated seconds.

Shared L2 pool (`settings.pool`, pool.py): the node's L2 blocks are also put in a Mooncake pool,
and a prefill request's blocks past this node's L1/L2 are looked up and fetched there before it
is queued; they count as pool hits in the simulator's `Node.reach`. A PD hand-off's blocks
really travel through the pool, beside the modelled transfer and never delaying the request
(the prefill side puts them after answering the room; the decode side fetches them while the
transfer time passes, and releases the room once they are in), as do `TransferKV`s from the
pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog

from evolving_infra._core import KvDirectory, block_hashes
from evolving_infra.control.records import IterationSample
from evolving_infra.engines.pool import PoolConfig
from evolving_infra.engines.sim.cache import CacheEvents, Hints, KvEventSink
from evolving_infra.engines.sim.env import RealTimeEnv, SampleSink
from evolving_infra.engines.sim.pool import EnginePool, TeeListener
from evolving_infra.engines.sim.requests import (
    BadRequestError,
    GenerateError,
    GenerateSpec,
    KvPullError,
    LiveRequest,
    Mode,
    OverloadedError,
    planned_output,
    sim_request,
)
from evolving_infra.nodemodel.hardware import NodeHardware
from evolving_infra.nodemodel.kv import BlockParents, NodeKv
from evolving_infra.nodemodel.node import Node, NodeSettings
from evolving_infra.nodemodel.request import SimRequest
from evolving_infra.timing.specs import DEFAULT_DEPLOYMENT, Deployment
from evolving_infra.types import Phase, blocks_for

log = structlog.get_logger("evolving_infra.engines.sim")
VERSION = "0.1.0-sim"
# Blocks the parent map may know beyond twice what was needed at its last pruning (~100 bytes a
# block): pruning is linear in the map, so it runs once the map has doubled.
PARENTS_SLACK = 1 << 16


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """One engine's parameters. Times are simulated seconds unless named `_real_s`."""

    node_id: int = 0
    phase: Phase = "prefill"
    deployment: Deployment = DEFAULT_DEPLOYMENT
    page_size: int = 16  # SGLang's page (tokens per KV block)
    time_scale: float = 1.0  # simulated seconds per real second
    seed: int = 0
    noise: float = 0.02  # lognormal sigma of the ground truth's iteration times
    l1_blocks: int | None = None  # None: from the GPU memory left after the weights
    l2_blocks: int | None = None  # None: host memory pro rata (`SimConfig`)
    chunk_tokens: int = 8192  # SGLang's chunked_prefill_size
    kv_bandwidth: float | None = None  # P->D bytes/s; None: `SimConfig.pd_bandwidth`
    l2_bandwidth: float | None = None  # host -> GPU bytes/s; None: `SimConfig.l2_bandwidth`
    transfer_latency: float = 1e-3
    switch_seconds: float = 6.2  # an in-place switch, once drained (docs/simulator.md)
    prefetch: bool = True  # fetch a queued request's L2 blocks while it waits
    max_requests: int = 1024  # in the engine at once; more get 503
    max_new_tokens: int = 1 << 16
    kv_hold_real_s: float = 60.0  # a prefill's KV waits this long for its decode side
    drain_timeout_real_s: float = 600.0
    http_url: str = ""
    kv_events_endpoint: str = ""
    kv_replay_endpoint: str = ""
    samples_endpoint: str = ""
    pool: PoolConfig | None = None  # the shared L2 pool to join (pool.py); None: L2 is local

    def hardware(self) -> NodeHardware:
        """This deployment's node: capacities and bandwidths (the simulator's defaults)."""
        return NodeHardware(deployment=self.deployment)


@dataclass(slots=True)
class _Room:
    ready: asyncio.Future[dict[str, Any]]
    live: LiveRequest | None = None
    hold: asyncio.TimerHandle | None = None
    # Set when the decode side polls for the room: it has reserved the KV (SGLang's bootstrap
    # handshake), and only then does the prefill run, so prefill pins never wait on a decode
    # engine that has no room for them (the two filled each other up: a PD deadlock).
    claimed: asyncio.Event = field(default_factory=asyncio.Event)
    # With a pool: the prefill side's `offer` of the prompt's blocks, under way from the end of
    # the prefill (`GET /_sim/kv/{room}/blocks` awaits it).
    offered: asyncio.Task[list[int] | None] | None = None


class EngineCore:
    """Build inside a running event loop; `await start()` before serving, `close()` after."""

    def __init__(
        self,
        settings: EngineSettings,
        *,
        kv_sink: KvEventSink | None = None,
        sample_sink: SampleSink | None = None,
    ) -> None:
        s = settings
        if s.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {s.page_size}")
        self.settings = s
        self.loop = asyncio.get_running_loop()
        c = s.hardware()
        ps = s.page_size
        self.block_bytes = c.block_bytes(ps)
        self.kv_bytes_per_token = c.kv_bytes_per_token
        self.kv_bandwidth = s.kv_bandwidth or c.pd_bandwidth
        self.l2_bandwidth = s.l2_bandwidth or c.l2_bandwidth
        l1 = s.l1_blocks if s.l1_blocks is not None else c.l1_blocks(ps)
        l2 = s.l2_blocks if s.l2_blocks is not None else c.l2_blocks(ps)
        self.directory = KvDirectory()
        self.parents = BlockParents()
        self._parents_limit = PARENTS_SLACK
        self.events = CacheEvents(ps, kv_sink)
        self.pool = (
            None
            if s.pool is None
            else EnginePool(s.pool, s.node_id, self.directory, lambda: self.events.held["L2"])
        )
        listener = self.events if self.pool is None else TeeListener(self.events, self.pool)
        self.kv = NodeKv(s.node_id, self.directory, l1, l2, listener=listener, parents=self.parents)
        self.hints = Hints(self.directory, self.parents, self.events)
        self.env = RealTimeEnv(
            s.deployment, self, time_scale=s.time_scale, noise=s.noise, seed=s.seed,
            sink=sample_sink, loop=self.loop,
        )  # fmt: skip
        node_settings = NodeSettings(
            block_size=ps,
            block_bytes=self.block_bytes,
            chunk_tokens=s.chunk_tokens,
            span_cap=1,  # one token per event: every streamed token has its own time
            l2_bandwidth=self.l2_bandwidth,
            pool_bandwidth=self.kv_bandwidth,
            net_bandwidth=self.kv_bandwidth,
            # One node: its own L1 and L2, and with a pool the blocks fetched from it (held in
            # the local directory by the pool's pseudo node).
            shared_pool=self.pool is not None,
            prefetch=s.prefetch,
            accepted=s.deployment.mtp_accepted,
        )
        self.node = Node(s.node_id, s.phase, self.kv, self.directory, node_settings, self.env)
        self._live: dict[str, LiveRequest] = {}
        self._by_sim: dict[int, LiveRequest] = {}
        self._rooms: dict[int, _Room] = {}
        self._failed_rooms: dict[int, GenerateError] = {}
        # Chains a TransferKV answered when started is still bringing into L1, by first block:
        # (blocks, last block, simulated time they are in). `_ready_floor` reads them.
        self._arriving: dict[int, list[tuple[int, int, float]]] = {}
        self._ids = itertools.count()
        self._changed = asyncio.Event()
        self._switching = False
        self._closed = False
        self._streams: set[asyncio.Queue[IterationSample | None]] = set()
        self._http: aiohttp.ClientSession | None = None
        self.completed = self.failed = 0

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if self.pool is not None:
            await self.pool.start()
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def close(self) -> None:
        self._closed = True
        now = self.env.now
        for live in list(self._live.values()):
            live.fail(OverloadedError("the engine is shutting down"), now)
            if live.task is not None:
                live.task.cancel()
        for q in self._streams:
            q.put_nowait(None)
        if self._http is not None:
            await self._http.close()
        if self.pool is not None:
            await self.pool.close()

    @property
    def phase(self) -> Phase:
        return self.node.phase

    @property
    def active(self) -> int:
        return len(self._live)

    # -- requests -----------------------------------------------------------------------------

    def accept(self, spec: GenerateSpec) -> LiveRequest:
        """Takes a request in (raises `GenerateError` if refused); await its `LiveRequest`."""
        s, node, now = self.settings, self.node, self.env.now
        if self._closed or not node.accepting:
            error = OverloadedError(f"engine {s.node_id} is {node.state}: retry another engine")
            if spec.bootstrap is not None and node.phase == "prefill":
                self._room_failed(spec.bootstrap.room, error)
            raise error
        if len(self._live) >= s.max_requests:
            raise OverloadedError(f"engine {s.node_id} has {s.max_requests} requests already")
        if spec.rid in self._live:
            raise BadRequestError(f"request id {spec.rid!r} is already running")
        if not 1 <= spec.max_new_tokens <= s.max_new_tokens:
            raise BadRequestError(f"max_new_tokens must be in [1, {s.max_new_tokens}]")
        if not spec.input_ids:
            raise BadRequestError("the prompt is empty")
        b = spec.bootstrap
        mode: Mode = "mixed" if b is None else node.phase
        if mode == "mixed" and node.phase == "decode":
            raise BadRequestError("a decode engine needs bootstrap_host, bootstrap_port, ...room")
        t, out = len(spec.input_ids), spec.max_new_tokens
        need = blocks_for(t if mode == "prefill" else t + out, s.page_size)
        if need > self.kv.l1_capacity:
            raise BadRequestError(f"{need} KV blocks never fit in {self.kv.l1_capacity}")
        room: _Room | None = None
        if mode == "prefill":
            assert b is not None
            room = self._rooms.setdefault(b.room, _Room(self.loop.create_future()))
            if room.live is not None or room.ready.done():
                raise BadRequestError(f"bootstrap_room {b.room} is already in use")
        hashes = block_hashes(spec.input_ids, s.page_size)
        sim = sim_request(next(self._ids), hashes, t, out)
        live = LiveRequest(
            spec.rid, sim, spec.input_ids, planned_output(s.seed, spec.input_ids, out),
            mode, b, now,
        )  # fmt: skip
        if hashes:
            self.parents.register(hashes)
            self.events.learn(hashes, spec.input_ids)
            # A live branch: its blocks sort after unneeded ones, so pins hold (cache.py).
            self.directory.branch_set(_branch(sim), hashes)
        self._live[spec.rid] = live
        self._by_sim[sim.id] = live
        if room is not None:
            room.live = live
        if mode == "decode":
            if node.offer(sim, now):
                self.decode_reserved(sim)
        elif room is not None:
            live.task = self.loop.create_task(self._enqueue_when_claimed(live, room))
        elif self.pool is not None and self.pool.up and hashes:
            live.task = self.loop.create_task(self._enqueue_after_pool(live))
        else:
            self._queue_prefill(sim, now)
        return live

    async def _enqueue_when_claimed(self, live: LiveRequest, room: _Room) -> None:
        """A PD prefill is queued once its decode side has claimed the room (reserved its KV);
        one never claimed within the KV hold fails as an unpulled prefill would (504). The pool
        is asked for the prompt's blocks meanwhile: the claim is a round trip through the
        decode engine, the lookup one through the pool, and neither needs the other."""
        lookup = None
        if self.pool is not None and self.pool.up and live.sim.hashes:
            lookup = self.loop.create_task(self._pool_lookup(live.sim))
        try:
            await asyncio.wait_for(room.claimed.wait(), self.settings.kv_hold_real_s)
        except TimeoutError:
            if lookup is not None:
                lookup.cancel()
            error = GenerateError(
                f"room {live.bootstrap.room if live.bootstrap else '?'}:"
                " no decode engine claimed it in time",
                504,
            )
            self._fail_room(live, error)
            self._done(live, error)
            return
        if lookup is not None:
            await self._enqueue_after_pool(live, await lookup)
            return
        if self._by_sim.get(live.sim.id) is not live:
            return
        if not self.node.accepting:
            self._hand_back(live)
            return
        self._queue_prefill(live.sim, self.env.now)

    def arriving(self, chain: Sequence[int], ready_at: float) -> None:
        """A move of `chain` (a prompt's leading blocks, already stored in L1) that is in only
        at simulated time `ready_at`: prefills whose prompt starts with it wait until then, as
        the simulator's prefills wait for their fetches (`SimRequest.ready_floor`)."""
        if not chain:
            return
        entry = (len(chain), chain[-1], ready_at)
        self._arriving.setdefault(chain[0], []).append(entry)
        delay = self.env.real_seconds(max(ready_at - self.env.now, 0.0))
        self.loop.call_later(delay, self._arrived_chain, chain[0], entry)

    def _arrived_chain(self, first: int, entry: tuple[int, int, float]) -> None:
        entries = self._arriving.get(first)
        if entries is not None:
            entries.remove(entry)
            if not entries:
                del self._arriving[first]

    def held_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` this node holds in L1 or L2."""
        return self.directory.match(hashes).node(self.settings.node_id)[1] if hashes else 0

    def _ready_floor(self, hashes: Sequence[int]) -> float:
        """The latest simulated time a move still under way brings in a prefix of `hashes`."""
        entries = self._arriving.get(hashes[0]) if hashes else None
        if not entries:
            return 0.0
        n = len(hashes)
        return max((t for k, last, t in entries if k <= n and hashes[k - 1] == last), default=0.0)

    async def _pool_lookup(self, sim: SimRequest) -> tuple[int, int]:
        """(start, n): the prompt's first block past what this node holds in L1/L2, and how many
        blocks from there the shared pool holds (0 on any pool failure)."""
        assert self.pool is not None
        start = self.held_blocks(sim.hashes)
        return start, await self.pool.lookup(sim.hashes[start:])

    async def _enqueue_after_pool(
        self, live: LiveRequest, looked: tuple[int, int] | None = None
    ) -> None:
        """Queues a prefill once the prompt's blocks past this node's L1/L2 are looked up, and
        the leading run found fetched, in the shared pool (a miss on any pool failure).
        `looked`: a lookup made earlier (`_pool_lookup`); the node may hold more since."""
        assert self.pool is not None
        sim = live.sim
        start, n = looked if looked is not None else await self._pool_lookup(sim)
        if self._by_sim.get(sim.id) is not live:
            return  # failed meanwhile (the engine is closing)
        if not self.node.accepting:
            self._hand_back(live)  # a switch began: as for the requests already queued
            return
        # A pull may have landed since the lookup: the pool's run starts past what is held.
        held = self.held_blocks(sim.hashes)
        if held > start:
            start, n = held, max(start + n - held, 0)
        self.pool.hold(sim.id, sim.hashes, start, n)
        self._queue_prefill(sim, self.env.now)

    def _queue_prefill(self, sim: SimRequest, now: float) -> None:
        """Queues `sim` for prefill, no earlier than a move under way brings in its prefix."""
        sim.ready_floor = self._ready_floor(sim.hashes)
        self.node.enqueue(sim, now)

    def _done(self, live: LiveRequest, error: GenerateError | None = None) -> None:
        now = self.env.now
        if error is None:
            live.finish(now)
            self.completed += 1
        else:
            live.fail(error, now)
            self.failed += 1
        self._live.pop(live.rid, None)
        self._by_sim.pop(live.sim.id, None)
        if live.sim.hashes:
            self.directory.branch_end(_branch(live.sim))
            # The token ids of its pages that no tier holds: a request that never ran (a PD
            # prefill no decode engine claimed) stores nothing, so no eviction would sweep
            # them (`CacheEvents.removed`); under the soak they reached 900k pages an engine.
            self.events.forget(live.sim.hashes)
            self.events.forget(live.sim.out_hashes)
        if self.pool is not None:
            self.pool.release(live.sim.id)
        self._prune_parents()
        self._changed.set()

    def _prune_parents(self) -> None:
        """Once the parent map has doubled, forgets the blocks that no tier holds and no live
        request needs (they were registered for requests that ended and since evicted)."""
        if len(self.parents) <= self._parents_limit:
            return
        held = self.events.held
        live = (r.sim.hashes for r in self._live.values())
        self.parents.prune(itertools.chain(held["L1"], held["L2"], *live))
        self._parents_limit = 2 * len(self.parents) + PARENTS_SLACK

    # -- PD: the prefill side -----------------------------------------------------------------

    async def wait_prefilled(self, room_id: int, timeout_real_s: float) -> dict[str, Any]:
        """The `GET /_sim/kv/{room}` long poll: once the room's prefill is done, what the
        decode side needs (raises `GenerateError` on timeout or if the prefill failed)."""
        failed = self._failed_rooms.get(room_id)
        if failed is not None:
            raise failed
        if self.node.phase != "prefill" and room_id not in self._rooms:
            raise BadRequestError(f"engine {self.settings.node_id} is not a prefill engine")
        room = self._rooms.setdefault(room_id, _Room(self.loop.create_future()))
        room.claimed.set()
        try:
            return await asyncio.wait_for(asyncio.shield(room.ready), timeout_real_s)
        except TimeoutError:
            if room.live is None and self._rooms.get(room_id) is room:
                del self._rooms[room_id]  # no prefill request ever came for it
            raise GenerateError(f"room {room_id}: no prefill within the poll", 504) from None

    def release_room(self, room_id: int, error: GenerateError | None = None) -> bool:
        """The decode side has the KV (or gave up): unpin it and answer the prefill request."""
        room = self._rooms.pop(room_id, None)
        if room is None or room.live is None or not room.ready.done():
            return False
        if room.hold is not None:
            room.hold.cancel()
        live = room.live
        self.node.release(live.sim, self.env.now)
        if error is None:
            live.emit(1)
        self._done(live, error)
        return True

    def _hand_back(self, live: LiveRequest) -> None:
        """A request not started when a phase switch begins: 503, the router retries it."""
        error = OverloadedError(f"engine {self.settings.node_id} is switching phase: retry")
        if live.mode == "prefill":
            self._fail_room(live, error)
        self._done(live, error)

    def _fail_room(self, live: LiveRequest, error: GenerateError) -> None:
        assert live.bootstrap is not None
        room = self._rooms.pop(live.bootstrap.room, None)
        self._room_failed(live.bootstrap.room, error)
        if room is not None and not room.ready.done():
            room.ready.set_exception(error)
            room.ready.exception()  # retrieved: the pollers (if any) see it; no loop warning

    def _room_failed(self, room_id: int, error: GenerateError) -> None:
        """Remembers for a while that a room's prefill failed or was refused: a decode engine
        that polls for it later learns at once (SGLang's decode side sees `KVPoll.Failed`),
        instead of holding its KV reservation for the whole poll."""
        self._failed_rooms[room_id] = error
        self.loop.call_later(self.settings.kv_hold_real_s, self._failed_rooms.pop, room_id, None)

    # -- PD: the decode side ------------------------------------------------------------------

    async def _pull(self, live: LiveRequest) -> None:
        b, sim, http = live.bootstrap, live.sim, self._http
        assert b is not None
        host = f"[{b.host}]" if ":" in b.host else b.host
        base = f"http://{host}:{b.port}/_sim/kv/{b.room}"
        try:
            if http is None:
                raise KvPullError("the engine is not started")
            poll = self.settings.kv_hold_real_s
            async with http.get(base, params={"timeout": str(poll)}) as r:
                body = await r.json(content_type=None)
                if not isinstance(body, dict):
                    raise KvPullError(f"prefill engine {b.host}:{b.port}: not a KV handoff")
                if r.status != 200:
                    message = body.get("error", {}).get("message", "") if body else ""
                    raise KvPullError(f"prefill engine {b.host}:{b.port}: {r.status} {message}")
            moved = max(sim.prompt_tokens - sim.h_d * self.settings.page_size, 0)
            seconds = self.settings.transfer_latency + moved * self.kv_bytes_per_token / (
                self.kv_bandwidth
            )
            copy = None
            if self.pool is not None and body.get("pool"):
                copy = self.loop.create_task(self._copy(base, sim.hashes[sim.h_d :]))
            await asyncio.sleep(self.env.real_seconds(seconds))
            if copy is None or copy.done():
                if copy is not None:
                    await copy
                async with http.post(base + "/release") as r:
                    await r.read()
            else:
                # The modelled transfer is over: the request goes on; the real copy through
                # the pool is reported, not charged, and the room is released after it.
                assert self.pool is not None
                self.pool.counters.transfer_copies_late += 1
                live.task = self.loop.create_task(self._release_after(copy, base))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # whatever went wrong, the request fails and its KV is freed
            error = e if isinstance(e, GenerateError) else KvPullError(f"KV pull from {base}: {e}")
            self._abort_admitted(live, error)
            return
        live.cached_tokens = int(body.get("cached_tokens", 0))
        if body.get("first_token") is not None:
            live.planned[0] = int(body["first_token"])
        self._arrive(sim)

    async def _copy(self, base: str, need: list[int]) -> None:
        """The real side of a PD hand-off through the pool: the blocks the prefill side offers
        (asked for once its puts are done), fetched where this engine lacks them."""
        assert self.pool is not None
        assert self._http is not None
        poll = {"timeout": str(self.settings.kv_hold_real_s)}
        try:
            async with self._http.get(base + "/blocks", params=poll) as r:
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            body = None
            log.warning("pool_transfer_blocks_unknown", room=base, error=str(e))
        offered = body.get("pool_blocks") if isinstance(body, dict) else None
        await self.pool.fetch_transfer(offered, need)  # never raises: a failure is counted

    async def _release_after(self, copy: asyncio.Task[None], base: str) -> None:
        """Releases a room once the real copy of its blocks is done (or failed: the request
        already has its KV in the model, so nothing here may fail it)."""
        with contextlib.suppress(Exception):
            await copy
        if self._http is None:
            return
        try:
            async with self._http.post(base + "/release") as r:
                await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:  # the prefill side's hold expires it
            log.warning("kv_release_failed", room=base, error=str(e))

    def _abort_admitted(self, live: LiveRequest, error: GenerateError) -> None:
        """Undoes a decode admission whose KV never came (the inverse of `Node.offer`'s
        reservation; the simulator never needs it: its transfers cannot fail)."""
        sim, node, kv, now = live.sim, self.node, self.kv, self.env.now
        kv.unpin(sim.hashes[: sim.h_d], now, sim.id)
        kv.pinned -= sim.pin_d
        kv.reserved -= sim.res_d
        sim.pin_d = sim.res_d = 0
        node.inbound -= 1
        self._done(live, error)
        node.admit_waiting(now)
        self._changed.set()

    def _arrive(self, sim: SimRequest) -> None:
        live = self._by_sim.get(sim.id)
        if live is None:
            return
        live.emit(1)  # the first token, computed by the prefill
        self.node.arrive(sim, self.env.now)

    # -- `env.EngineHooks` --------------------------------------------------------------------

    def prefilled(self, req: SimRequest) -> None:
        live = self._by_sim[req.id]
        live.cached_tokens = req.prompt_tokens - req.uncached
        now, node = self.env.now, self.node
        if live.mode == "prefill":
            assert live.bootstrap is not None
            answer = {"room": live.bootstrap.room, "prompt_tokens": req.prompt_tokens,
                      "cached_tokens": live.cached_tokens, "first_token": live.planned[0],
                      "blocks": len(req.hashes), "node_id": self.settings.node_id}  # fmt: skip
            if self.pool is not None:
                # The blocks follow through the pool, alongside the modelled transfer: the
                # decode side asks for them (`wait_offered`) while its transfer time passes.
                answer["pool"] = True
                room = self._rooms[live.bootstrap.room]
                room.offered = self.loop.create_task(self._offer(live))
            self._room_ready(answer)
            return
        # Mixed: its own decode. The prefill's pins go first (an unpin touches the chain and
        # would undo the decode's pin), the queue is kicked once the decode holds its KV.
        node.release(req, now, kick=False)
        if node.offer(req, now):
            self.decode_reserved(req)
        node.kick(now)

    def _room_ready(self, answer: dict[str, Any]) -> None:
        room_id = answer["room"]
        room = self._rooms[room_id]
        room.ready.set_result(answer)
        room.hold = self.loop.call_later(self.settings.kv_hold_real_s, self._hold_expired, room_id)

    async def _offer(self, live: LiveRequest) -> list[int] | None:
        """Puts the prompt's blocks in the pool for the decode side (`EnginePool.offer`); None
        when that failed (the hand-off is then the modelled one alone)."""
        assert self.pool is not None
        try:
            return await self.pool.offer(live.sim.id, live.sim.hashes)
        except Exception:  # a bug there must not strand the decode side: modelled time only
            log.exception("pool_offer_failed")
            return None

    async def wait_offered(self, room_id: int, timeout_real_s: float) -> list[int] | None:
        """The `GET /_sim/kv/{room}/blocks` long poll: the blocks the decode side may fetch
        from the pool once the offer is done; None when there are none (no pool, the offer
        failed, or the room is gone)."""
        room = self._rooms.get(room_id)
        if room is None or room.offered is None:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(room.offered), timeout_real_s)
        except TimeoutError:
            return None

    def _hold_expired(self, room_id: int) -> None:
        error = GenerateError(f"room {room_id}: no decode engine pulled the KV in time", 504)
        self.release_room(room_id, error)

    def decode_reserved(self, req: SimRequest) -> None:
        live = self._by_sim[req.id]
        if live.mode == "decode":
            live.task = self.loop.create_task(self._pull(live))
        else:  # its own KV: no transfer, but not inside the node's callback either
            self.env.at(self.env.now, self._arrive, req)

    def span_done(self, tokens: int) -> None:
        for r in self.node.batch:
            live = self._by_sim.get(r.id)
            if live is not None:
                live.emit(r.made)

    def decoded(self, req: SimRequest) -> None:
        live = self._by_sim.get(req.id)
        if live is not None:
            self._done(live)
        if live is None or live.mode == "mixed":
            # Its KV is unpinned: a prefill head waiting for room may fit now. (The simulator
            # never needs this: there, prefill and decode nodes are distinct.) Soon, not
            # now: the node is still inside its span's bookkeeping.
            self.loop.call_soon(self._kick)

    def _kick(self) -> None:
        self.node.kick(self.env.now)

    def next_hashes(self, req: SimRequest) -> list[int] | None:
        live = self._by_sim.get(req.id)
        if live is None:
            return None
        ids = live.input_ids + live.planned
        hashes = block_hashes(ids, self.settings.page_size)
        self.events.learn(hashes, ids)
        return hashes

    def changed(self, node: Node) -> None:
        self._changed.set()

    # -- views --------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What `/server_info` reports under `internal_states`."""
        node, kv = self.node, self.kv
        return {
            "phase": node.phase,
            "state": node.state,
            "num_running_reqs": len(node.batch) + len(node.running),
            "num_waiting_reqs": len(node.queue) + len(node.waiting),
            "num_requests": len(self._live),
            "l1_capacity_blocks": kv.l1_capacity,
            "l1_held_blocks": kv.l1_held,
            "l1_reserved_blocks": kv.reserved,
            "l1_pinned_blocks": kv.pinned,
            "l2_capacity_blocks": kv.l2_capacity,
            "l2_held_blocks": kv.l2_held,
            "evicted_blocks": kv.evicted,
            "demoted_blocks": kv.demoted,
            "dropped_blocks": kv.dropped,
            "hinted_chains": len(self.hints.hinted),
            "completed": self.completed,
            "failed": self.failed,
            "iterations": self.env.seq,
            "simulated_time_s": self.env.now,
            "wall_time": time.time(),
        }

    def memory_stats(self) -> dict[str, int]:
        """The sizes of what the engine keeps, for memory traces (`memtrace.py`)."""
        d = self.directory.stats()
        return {
            "live_requests": len(self._live),
            "rooms": len(self._rooms),
            "failed_rooms": len(self._failed_rooms),
            "held_l1": len(self.events.held["L1"]),
            "held_l2": len(self.events.held["L2"]),
            "token_pages": len(self.events.tokens),
            "parent_blocks": len(self.parents),
            "hinted": len(self.hints.hinted),
            "directory_blocks": d["blocks"],
            "directory_branches": d["branches"],
            "directory_bytes": d["memory_bytes"],
        }

    def holdings(self) -> dict[str, set[int]]:
        """The blocks this node holds per tier, from its KV events' point of view."""
        return {tier: set(held) for tier, held in self.events.held.items()}


def _branch(sim: SimRequest) -> str:
    return f"req:{sim.id}"
