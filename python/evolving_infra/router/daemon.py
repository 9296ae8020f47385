"""The router daemon: the live driver of the policies (DESIGN §1).

Start-up asks every engine's control service (`--engines`) what it is (`GetInfo`: node id,
phase, page size, capacities, data URL, KV-event and sample endpoints), then wires:

- one cluster `KvDirectory`, fed by an `EventIngestor` (SGLang's KV events, gaps repaired from
  each engine's replay endpoint) and read by routing and the branch API;
- one `IterationModel`, fitted online from every engine's forward-pass samples
  (`SampleIngestor`);
- the `evolving` router policy and a `PdDispatcher` sending each request to a prefill and a
  decode engine with SGLang's PD protocol;
- the HTTP front end (`app.build_app`);
- a health loop (each engine's `Health` every `health_interval` s: phase changes and engines
  going down or coming back reach the dispatcher) and the planner loop (`planning.LivePlanner`).

Nothing here decides anything: decisions are the policies' (routing/, planner/), which the
simulator drives too.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import structlog

from evolving_infra._core import KvDirectory
from evolving_infra.control import EngineClient, EngineControlError, EngineInfo
from evolving_infra.control.errors import EngineTimeoutError, EngineUnavailableError
from evolving_infra.errors import CommandError
from evolving_infra.planner import options
from evolving_infra.router.app import build_app
from evolving_infra.router.branches import BranchTracker
from evolving_infra.router.config import RouterConfig
from evolving_infra.router.ingest import EventIngestor, SampleIngestor
from evolving_infra.router.kvpull import ControlPuller
from evolving_infra.router.loads import EngineHandle, NodeWork
from evolving_infra.router.metrics import EngineView, PlannerView, RouterMetrics
from evolving_infra.router.observer import Observers, PlannerFeed
from evolving_infra.router.pd import PdDispatcher
from evolving_infra.router.planning import LivePlanner
from evolving_infra.router.registry import EngineRegistry
from evolving_infra.router.replicas import (
    Board,
    LeaderLease,
    LoadExchange,
    SharedFeed,
    shared_tails,
)
from evolving_infra.router.server import Serving, serve
from evolving_infra.router.tokenize import load_tokenizer
from evolving_infra.router.transport import HttpTransport
from evolving_infra.routing.evolving import EvolvingRouter
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.samples import Sample
from evolving_infra.timing.specs import LLAMA3_70B, MODELS

log = structlog.get_logger("evolving_infra.router.daemon")

HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 2.0  # an engine's Health answer; a loaded engine can take over a second
# Eviction hints are refreshed this often: a branch's context changes once per agent turn
# (seconds to minutes), and an engine evicts by them only under memory pressure.
HINTS_INTERVAL_S = 2.0
DISCOVERY_TIMEOUT_S = 10.0
# Forward-pass samples fed to the timing model per engine and phase, at most. An engine reports
# every iteration: a real GPU's decode makes tens a second, a time-scaled simulated engine
# hundreds, and each observation (a prediction, a refit every 16) runs on the event loop: at
# --time-scale 10 they were a fifth of the router's CPU in the soak. Tens a second are plenty
# for a fit over a 2,000-sample window, which thinning also keeps from covering mere seconds.
MAX_SAMPLES_PER_S = 50.0
# Health checks failed in a row before an engine counts as lost (its holdings dropped, its
# requests pulled back): one missed check under load is not a crash.
LOST_AFTER_FAILURES = 3


@dataclass(slots=True)
class SampleThinning:
    """Lets through at most `per_s` samples a second of each engine and phase: a sample passes
    when `1 / per_s` seconds have gone by since the last one that passed (by time, not by
    count, so a burst is thinned and a slow engine keeps every sample)."""

    per_s: float
    _last: dict[tuple[int, str], float] = field(default_factory=dict)

    def admit(self, node: int, phase: str, now: float) -> bool:
        key = (node, phase)
        if now - self._last.get(key, -math.inf) < 1.0 / self.per_s:
            return False
        self._last[key] = now
        return True


class RouterStartError(CommandError):
    """The daemon cannot start: an engine is unreachable or the engines disagree with the
    configuration (the message names the engine and the field, `fix` what to do)."""


@dataclass(slots=True)
class _Engine:
    address: str
    client: EngineClient
    info: EngineInfo
    failures: int = 0  # health checks failed in a row


def handle_of(info: EngineInfo) -> EngineHandle:
    """The dispatcher's view of an engine. Its PD bootstrap address is the host of its data
    address and the engine's `bootstrap_port`: SGLang serves the KV hand-off on its own listener
    (`--disaggregation-bootstrap-port`); 0 means the HTTP port, where the simulated engine
    serves it."""
    url = urlsplit(info.http_url)
    if not url.hostname or url.port is None:
        raise RouterStartError(
            f"engine {info.node_id}: http_url {info.http_url!r} has no host:port"
        )
    return EngineHandle(
        node=info.node_id,
        http_url=info.http_url.rstrip("/"),
        phase=info.phase,
        bootstrap_host=url.hostname,
        bootstrap_port=info.bootstrap_port or url.port,
        kv_capacity_blocks=info.l1_capacity_blocks,
    )


async def discover(
    addresses: Sequence[str], page_size: int, api_key: str | None = None
) -> tuple[list[_Engine], dict[str, EngineClient]]:
    """`GetInfo` from every engine: the engines that answered, and the clients of those that did
    not (the health loop keeps asking them). Engines that answer must agree on the page size and
    have distinct node ids; at least one must answer (it names the model)."""
    clients = [EngineClient(a, timeout=DISCOVERY_TIMEOUT_S, api_key=api_key) for a in addresses]
    results = await asyncio.gather(*(c.get_info() for c in clients), return_exceptions=True)
    engines, problems, unreachable = [], [], []
    pending: dict[str, EngineClient] = {}
    for address, client, info in zip(addresses, clients, results, strict=True):
        if isinstance(info, EngineUnavailableError | EngineTimeoutError):
            unreachable.append(f"{address}: {info}")
            pending[address] = client
        elif isinstance(info, BaseException):
            problems.append(f"{address}: {info}")
        elif problem := _mismatch(info, page_size):
            problems.append(f"{address}: {problem}")
        else:
            engines.append(_Engine(address, client, info))
    nodes = [e.info.node_id for e in engines]
    if len(set(nodes)) != len(nodes):
        problems.append(f"node ids must be distinct, got {sorted(nodes)}")
    fix = "check --engines (each engine's --grpc-port) and --page-size"
    if not engines and not problems:
        problems = unreachable
        fix = "start the engines first (evolving-infra engine), or check --engines"
    if problems:
        await asyncio.gather(*(c.close() for c in clients))
        raise RouterStartError("engines: " + "; ".join(problems), fix)
    for reason in unreachable:
        log.warning("engine_unreachable_at_start", reason=reason, retry_every_s=HEALTH_INTERVAL_S)
    return engines, pending


def _said_if_failed(task: asyncio.Task[None]) -> None:
    """Logs a background loop that ended with an error (they run until the router stops: one
    that ends otherwise has stopped doing its work, silently but for this)."""
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "router_loop_failed", loop=task.get_name(), error=repr(task.exception()),
            exc_info=task.exception(),
        )  # fmt: skip


def _import_scipy() -> None:
    import scipy.optimize
    import scipy.stats  # noqa: F401


def _mismatch(info: EngineInfo, page_size: int) -> str | None:
    if info.page_size != page_size:
        return (
            f"page size {info.page_size}, the router's --page-size is {page_size}"
            " (block hashes would not match the engine's KV events)"
        )
    return None


class RouterDaemon:
    """Everything the `router` command runs; `start()` then `wait()`, `stop()` on shutdown."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.directory = KvDirectory()
        self.engines: dict[int, _Engine] = {}
        self.model = IterationModel()
        self.metrics = RouterMetrics()
        self.events: EventIngestor | None = None
        self.samples: SampleIngestor | None = None
        self.registry = EngineRegistry()  # filled when the engines answer (`start`)
        self.dispatcher: PdDispatcher | None = None
        self.planner: LivePlanner | None = None
        self.lease: LeaderLease | None = None  # with router replicas (`--coordination`)
        self.exchange: LoadExchange | None = None  # their work per engine, shared
        self.tails: Board | None = None  # their live branches' last blocks, shared
        self.window: PlannerFeed | None = None  # what feeds the planner's window
        self.tracker = BranchTracker(self.directory, config.branch_ttl)
        self.serving: Serving | None = None
        self.port = 0
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        # Engines that did not answer at start: asked again by the health loop until they do.
        self._pending: dict[str, EngineClient] = {}
        # Engines whose control service stopped answering: their holdings were dropped from the
        # directory, and are re-learned (a replay from seq 0) when they answer again.
        self._lost: set[int] = set()

    async def start(self) -> None:
        cfg = self.config
        # A tokenizer file that cannot be loaded is the user's error: found before the engines.
        tokenizer = None if cfg.tokenizer is None else load_tokenizer(cfg.tokenizer)
        found, self._pending = await discover(
            [e.address for e in cfg.engines], cfg.page_size, cfg.control_api_key
        )
        self.engines = {e.info.node_id: e for e in found}
        known = MODELS.get(found[0].info.model)
        spec = known or LLAMA3_70B
        loop = asyncio.get_running_loop()

        thinning = SampleThinning(MAX_SAMPLES_PER_S)

        def on_sample(node: int, sample: Sample) -> None:
            # Called on the ingestion thread: the model belongs to the event loop. Thinned here,
            # before a dropped sample costs the loop a wake-up.
            if thinning.admit(node, sample.phase, time.monotonic()):
                loop.call_soon_threadsafe(self._observe, node, sample)

        self.events = EventIngestor(self.directory)
        self.samples = SampleIngestor(on_sample)
        for e in found:
            self._subscribe(e.info)
        router = EvolvingRouter(
            self.model, block_size=cfg.page_size, kv_bytes_per_token=spec.kv_bytes_per_token
        )
        self._session = aiohttp.ClientSession()
        for e in found:
            self.registry.add(handle_of(e.info))
        self.lease = None if cfg.coordination is None else self._lease(cfg)
        # A tree the front moved here from a replica that died: its forks are adopted.
        self.tracker.adopt_unknown = self.lease is not None
        self.planner = LivePlanner(
            self.registry,
            {n: e.client for n, e in self.engines.items()},
            self.model,
            page_size=cfg.page_size,
            interval=cfg.planner_interval,
            settings=options.check(cfg.planner_options),
            enabled=cfg.planner,
            nodes=len(cfg.engines),
            lease=self.lease,
        )
        # The planner's window as the dispatcher feeds it: with replicas, every replica's
        # arrivals (`replicas.SharedFeed`), else this router's.
        self.window = (
            PlannerFeed(self.planner.slices)
            if self.lease is None
            else SharedFeed(self.planner.slices, self.lease.client, self.lease.replica)
        )
        self.dispatcher = PdDispatcher(
            self.registry,
            self.directory,
            router,
            self.model,
            page_size=cfg.page_size,
            transport=HttpTransport(self._session),
            observer=Observers(self.window, self.metrics.feed()),
            admission=cfg.admission,
            context_length=cfg.context_length or (known.context_length if known else None),
            max_queue_wait_s=cfg.max_queue_wait,
            migration_limit=cfg.migration_limit,
            # The planner's map of control clients: the same dict, kept current as engines join.
            puller=ControlPuller(self.planner.clients, self._transfer_address)
            if cfg.kv_pull
            else None,
        )
        self.metrics.watch_engines(self.engine_views)
        self.metrics.watch_planner(self.planner_view)
        events, samples = self.events, self.samples
        self.metrics.watch_ingest(lambda: (events.snapshot(), samples.snapshot()))
        puller = self.dispatcher.puller
        if isinstance(puller, ControlPuller):
            self.metrics.watch_pulls(lambda: puller.counts)
        gate = self.dispatcher.gate
        if gate is not None:
            self.metrics.watch_admission(lambda: (gate.waiting, gate.shed_early, gate.shed_late))
        app = build_app(
            self.dispatcher,
            self.tracker,
            tokenizer or load_tokenizer(None),
            self.metrics,
            page_size=cfg.page_size,
            models=cfg.models,
            listed_models=sorted({e.info.model for e in found if e.info.model}),
            max_body_bytes=cfg.max_body_bytes,
            api_keys=cfg.api_keys,
            turn_cache_bytes=cfg.turn_cache_bytes,
        )
        if cfg.exposed_without_key:
            log.warning(
                "listening beyond loopback with no API key: anyone who reaches the port can"
                " use the engines (set --api-key or EVOLVING_INFRA_API_KEY)",
                host=cfg.host,
            )
        self.serving = await serve(app, cfg.host, cfg.port)
        addresses = self.serving.addresses
        self.port = int(addresses[0][1]) if addresses else cfg.port
        # The fit and the planner's test import scipy on first use (~2 s): do it now, off the
        # event loop, rather than in the middle of a request's first sample.
        asyncio.get_running_loop().run_in_executor(None, _import_scipy)
        self._tasks = [
            asyncio.create_task(self._health_loop(), name="health"),
            asyncio.create_task(self.planner.run(), name="planner"),
            asyncio.create_task(self._hints_loop(), name="hints"),
        ]
        if self.lease is not None:
            self.exchange = LoadExchange(
                self.lease.client,
                self.lease.replica,
                self.registry.loads,
                extra=self.dispatcher.gate.claimed if self.dispatcher.gate is not None else None,
                on_change=self.registry.changed,
            )
            self.tails = Board(self.lease.client, self.lease.replica, "tails")
            self._tasks.append(asyncio.create_task(self.lease.run(), name="lease"))
            self._tasks.append(asyncio.create_task(self.exchange.run(), name="loads"))
            if isinstance(self.window, SharedFeed):
                self._tasks.append(asyncio.create_task(self.window.run(), name="window"))
        for t in self._tasks:
            t.add_done_callback(_said_if_failed)
        log.info(
            "router_serving",
            host=cfg.host,
            port=self.port,
            engines={n: f"{e.info.phase}@{e.address}" for n, e in sorted(self.engines.items())},
        )

    def _lease(self, cfg: RouterConfig) -> LeaderLease:
        """The leader lease in the coordination service (`replicas.LeaderLease`)."""
        import redis.asyncio as aredis

        assert cfg.coordination is not None
        replica = cfg.replica or f"{socket.gethostname()}:{cfg.port}"
        return LeaderLease(aredis.from_url(cfg.coordination), replica, ttl_s=cfg.lease_ttl)

    def _observe(self, node: int, sample: Sample) -> None:
        try:
            self.model.observe(sample)
        except ValueError as e:  # an absurd sample is the engine's bug, not a reason to stop
            log.warning("sample_rejected", node=node, reason=str(e))

    async def _health_loop(self) -> None:
        assert self.dispatcher is not None
        while True:
            checks = [self._check(n, e) for n, e in self.engines.items()]
            joins = [self._join(a, c) for a, c in self._pending.items()]
            await asyncio.gather(*checks, *joins)
            await asyncio.sleep(HEALTH_INTERVAL_S)

    def _subscribe(self, info: EngineInfo) -> None:
        """Follows an engine's KV events (a replay from seq 0 first) and samples."""
        assert self.events is not None
        assert self.samples is not None
        if info.kv_events_endpoint:
            self.events.add_engine(
                info.node_id, info.kv_events_endpoint, info.kv_replay_endpoint or None
            )
        if info.samples_endpoint:
            self.samples.add_engine(info.node_id, info.samples_endpoint)

    async def _join(self, address: str, client: EngineClient) -> None:
        """An engine that was unreachable at start answers: it joins the cluster."""
        d, planner = self.registry, self.planner
        assert planner is not None
        try:
            info = await client.get_info(timeout=HEALTH_TIMEOUT_S)
        except EngineControlError:
            return
        if address not in self._pending:
            return  # joined by a concurrent pass
        if problem := _mismatch(info, self.config.page_size):
            log.error("engine_refused", address=address, reason=problem)
            return
        if info.node_id in self.engines:
            log.error("engine_refused", address=address, reason=f"node id {info.node_id} taken")
            return
        del self._pending[address]
        self.engines[info.node_id] = _Engine(address, client, info)
        d.add(handle_of(info))
        planner.clients[info.node_id] = client
        self._subscribe(info)
        log.info("engine_joined", node=info.node_id, address=address, phase=info.phase)

    async def _check(self, node: int, engine: _Engine) -> None:
        d = self.registry
        if self.planner is not None and self.planner.switching(node):
            return  # the planner owns a switching node's state until its switch returns
        try:
            h = await engine.client.health(timeout=HEALTH_TIMEOUT_S)
        except EngineControlError as e:
            engine.failures += 1
            # Refused: the engine is gone, stop routing to it now. A late answer: it may only
            # be busy (its event loop behind a long batch), so only a run of them counts.
            slow = isinstance(e, EngineTimeoutError)
            if not slow or engine.failures >= LOST_AFTER_FAILURES:
                d.set_state(node, "down", str(e))
            if engine.failures >= LOST_AFTER_FAILURES:
                self._lose(node, str(e))
            return
        engine.failures = 0
        if node in self._lost and not await self._rejoin(node, engine):
            return
        d.set_phase(node, h.phase)
        d.set_state(
            node,
            "up" if h.state == "serving" else "draining" if h.state != "down" else "down",
            h.reason,
        )

    def _lose(self, node: int, reason: str) -> None:
        """An engine's control service stopped answering (crashed, hung, or its machine is
        gone): what the directory says it holds is no longer known, so routing must not count
        on it, and its requests in flight are pulled back rather than left to their timeouts."""
        if node in self._lost or self.events is None or self.dispatcher is None:
            return
        self._lost.add(node)
        self.events.remove_engine(node)
        self.directory.clear(node)
        self.dispatcher.abort_engine(node, reason)
        log.warning("engine_lost", node=node, detail="holdings dropped from the directory")

    async def _rejoin(self, node: int, engine: _Engine) -> bool:
        """A lost engine answers again (restarted, perhaps on other ports): take its current
        `GetInfo` and re-learn its cache from a replay of its events."""
        d = self.registry
        try:
            info = await engine.client.get_info(timeout=HEALTH_TIMEOUT_S)
        except EngineControlError:
            return False
        if info.node_id != node or _mismatch(info, self.config.page_size):
            d.set_state(node, "down", f"came back as node {info.node_id}, page {info.page_size}")
            return False
        engine.info = info
        d.add(handle_of(info))
        self._subscribe(info)
        self._lost.discard(node)
        log.info("engine_back", node=node, phase=info.phase)
        return True

    async def _hints_loop(self) -> None:
        """Every engine learns which chains live branches still need (DESIGN §2's `R_b > 0`
        part of the eviction order, applied by the engine's own eviction)."""
        while True:
            await asyncio.sleep(HINTS_INTERVAL_S)
            tails: Iterable[int] = self.tracker.live_tails().values()
            if self.tails is not None:  # every replica's branches: each send replaces the last
                tails = await shared_tails(self.tails, tails, 3 * HINTS_INTERVAL_S)
            hints = dict.fromkeys(tails, 1)
            await asyncio.gather(*(self._hint(n, e, hints) for n, e in self.engines.items()))

    async def _hint(self, node: int, engine: _Engine, hints: dict[int, int]) -> None:
        try:
            await engine.client.set_eviction_hints(hints, replace=True, timeout=HINTS_INTERVAL_S)
        except EngineControlError as e:
            log.debug("hints_failed", node=node, reason=str(e))

    def engine_views(self) -> list[EngineView]:
        """Each engine's state, the directory's count of its blocks and the router's of its
        work, for `/metrics`."""
        d = self.registry
        out = []
        for n, e in sorted(d.engines.items()):
            load = d.loads.loads.get(n) or NodeWork()
            out.append(
                EngineView(
                    node=n,
                    state=e.state,
                    phase=e.phase,
                    l1_blocks=self.directory.held(n, "L1"),
                    l2_blocks=self.directory.held(n, "L2"),
                    decode_requests=load.decode_requests,
                    queued_prefill_tokens=load.queued_prefill_tokens,
                    kv_used_blocks=load.kv_used_blocks,
                    kv_capacity_blocks=e.kv_capacity_blocks,
                )
            )
        return out

    def planner_view(self) -> PlannerView:
        """The planner's split, decisions and switches, for `/metrics`."""
        p = self.planner
        assert p is not None
        split = p.split()
        ok = sum(1 for s in p.switches if s.ok)
        return PlannerView(
            enabled=p.enabled,
            prefill=split.prefill,
            decode=split.decode,
            decisions=p.decisions,
            switches_ok=ok,
            switches_failed=len(p.switches) - ok,
            last_decision_unix=p.last_decision_unix,
            leader=None if p.lease is None else p.lease.is_leader,
            epoch=p.epoch,
        )

    def _transfer_address(self, node: int) -> str:
        """A node's KV transfer address, its PD bootstrap host:port ("" if unknown)."""
        e = self.registry.engines.get(node)
        if e is None or not e.bootstrap_host:
            return ""
        host = f"[{e.bootstrap_host}]" if ":" in e.bootstrap_host else e.bootstrap_host
        return f"{host}:{e.bootstrap_port}"

    def status(self) -> dict[str, Any]:
        """Counters for logs and tests: ingestion, planner, engines."""
        out: dict[str, Any] = {}
        if self.events is not None:
            out["events"] = self.events.snapshot()
        if self.samples is not None:
            out["samples"] = self.samples.snapshot()
        if self.planner is not None:
            out["switches"] = list(self.planner.switches)
        puller = self.dispatcher.puller if self.dispatcher is not None else None
        if isinstance(puller, ControlPuller):
            out["kv_pulls"] = dict(puller.counts)
        return out

    def memory_stats(self) -> dict[str, Any]:
        """The sizes of what the router keeps, for memory traces (`memtrace.py`)."""
        d = self.directory.stats()
        return {
            "directory_blocks": d["blocks"],
            "directory_placeholders": d["placeholders"],
            "directory_locations": d["locations"],
            "directory_branches": d["branches"],
            "directory_bytes": d["memory_bytes"],
            "branches_named": self.tracker.live,
            "branches_anonymous": self.tracker.anonymous_live,
        }

    async def wait(self) -> None:
        await self._stopped.wait()

    def cut(self) -> None:
        """Ends a drain under way: the requests still in flight are cut (a second Ctrl-C)."""
        if self.serving is not None:
            self.serving.drain.cut()

    async def stop(self) -> None:
        """Drains, then stops everything: the planner first (no phase switch while stopping);
        the requests held for decode room are refused (503); the requests under way get
        `--shutdown-timeout` to finish while health checks and hints go on (an engine that
        dies meanwhile still has its requests pulled back); then the rest. `cut()` ends the
        drain early."""
        planner = [t for t in self._tasks if t.get_name() in ("planner", "lease")]
        for t in planner:
            t.cancel()
        if self.lease is not None:  # another replica takes the planner over at once
            await self.lease.release()
        gate = self.dispatcher.gate if self.dispatcher is not None else None
        if gate is not None and self.serving is not None:
            # Requests still waiting for decode room have cost no engine anything: refused
            # now (503, sent again by their clients), the drain waits only for work under way.
            refused = gate.close()
            if refused:
                log.info("router_stop_refused_held", requests=refused)
        if self.serving is not None:
            await self.serving.stop(self.config.shutdown_timeout)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            # A loop that died of an error was logged when it did (`_said_if_failed`): the stop
            # goes on (raised here, it ended the stop and the router never exited).
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._session is not None:
            await self._session.close()
        for ingestor in (self.events, self.samples):
            if ingestor is not None:
                ingestor.close()
        await asyncio.gather(*(e.client.close() for e in self.engines.values()))
        if self.exchange is not None:
            await self.exchange.leave()
        if self.tails is not None:
            await self.tails.leave()
        if self.lease is not None:
            await self.lease.client.aclose()
        self._stopped.set()
