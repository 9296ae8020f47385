"""The live planner loop: the router's driver of the phase-split planner (DESIGN §3).

Every `sample_interval` seconds the nodes are sampled into the planner's window (the same
`planner.slices.Slices` the simulator feeds; arrivals and decoded tokens come from the
dispatcher, through `observer.PlannerFeed`); every `interval` seconds the slice is closed and
the `evolving` planner decides. A decision becomes `SwitchPhase` calls on the chosen engines:
they stop getting new requests at once (marked draining in the engine registry), drain, flip in
place keeping their KV, and come back in the new phase. The planner hears `switch_done()` when
every engine of the switch has answered, so no new decision is made while one is in flight.

Which nodes move: those of the shrinking phase with the least work in flight (the least to
drain), as the simulator's `Switcher` picks them.

With router replicas (`lease`, `replicas.LeaderLease`) every replica samples, so that its window
is warm should it take over, but only the lease's holder decides. Each `SwitchPhase` carries the
lease's epoch; a replica that gains the lease first fences every engine with a no-op switch at
its epoch (`_fence`) and decides only once that is done, so no switch of a deposed leader can
land after the new one has looked at the phases. An engine that refuses (`StaleLeaderError`)
means a newer leader exists: this one decides nothing more until it holds a newer epoch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from evolving_infra.control import EngineClient, EngineControlError, StaleLeaderError
from evolving_infra.planner.base import Split
from evolving_infra.planner.evolving import EvolvingPlanner
from evolving_infra.planner.slices import NodeSample, Slices
from evolving_infra.router.registry import EngineRegistry
from evolving_infra.router.replicas import LeaderLease
from evolving_infra.timing.model import IterationModel
from evolving_infra.types import Phase

log = structlog.get_logger("evolving_infra.router.planning")

SAMPLE_INTERVAL_S = 1.0
DRAIN_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class SwitchRecord:
    """One engine's finished (or failed) switch."""

    node: int
    to: Phase
    ok: bool
    drain_s: float = 0.0
    switch_s: float = 0.0
    reason: str = ""


class LivePlanner:
    """Samples, decides and carries switches out (see the module docstring)."""

    def __init__(
        self,
        registry: EngineRegistry,
        clients: Mapping[int, EngineClient],
        model: IterationModel,
        *,
        page_size: int,
        interval: float = 60.0,
        window_s: float = 600.0,
        sample_interval: float = SAMPLE_INTERVAL_S,
        enabled: bool = True,
        nodes: int | None = None,
        lease: LeaderLease | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        """`nodes`: engines the cluster has (default: one per client), including any that
        have not answered yet and join later (the daemon adds their clients to `clients`).
        `lease`: with router replicas, decide only while holding it (module docstring).
        `settings`: the evolving planner's other settings (`planner.options`); a `window_s`
        there replaces the one given here."""
        kw = dict(settings or {})
        window_s = float(kw.pop("window_s", None) or window_s)
        self.registry = registry
        self.clients = dict(clients)
        self.model = model
        self.interval = interval
        self.sample_interval = min(sample_interval, interval)
        self.enabled = enabled
        self.page_size = page_size
        self.slices = Slices(window_s, block_tokens=page_size)
        self.nodes = nodes or len(self.clients)
        self.planner = EvolvingPlanner(self.nodes, interval=interval, window_s=window_s, **kw)
        self.switches: list[SwitchRecord] = []
        self._switching: set[int] = set()
        self._held = False  # decisions held while not every engine is up (`tick`)
        self.lease = lease
        self.fenced = 0  # the lease epoch every up engine has been fenced at (`_fence`)
        self._fencing = False
        self.decisions = 0  # evaluations made (kept or switched), for /metrics
        self.last_decision_unix: float | None = None  # wall-clock time of the latest

    def switching(self, node: int) -> bool:
        return node in self._switching

    def split(self) -> Split:
        up = [e for e in self.registry.engines.values() if e.state == "up"]
        return Split(sum(e.phase == "prefill" for e in up), sum(e.phase == "decode" for e in up))

    def node_samples(self) -> list[NodeSample]:
        d = self.registry
        out = []
        for e in d.engines.values():
            if e.state == "down":
                continue
            load = d.loads.total(e.node)  # every replica's work, with replicas
            out.append(
                NodeSample(
                    phase=e.phase,
                    queued_prefill_s=load.queued_prefill_s,
                    decoding=load.decode_requests,
                    context_tokens=load.decode_context,
                    kv_used=min(load.kv_used_blocks / e.kv_capacity_blocks, 1.0)
                    if e.kv_capacity_blocks
                    else 0.0,
                    # NOTE: the router counts a request from dispatch, so these include what
                    # waits in an engine's bootstrap and prealloc queues (the simulator's do
                    # not): the live engines do not report those queues apart yet.
                    queued_prefill_tokens=load.queued_prefill_tokens,
                    # NOTE: the engines do not report preempted decode requests
                    # (`queued_decode`, 0), and SGLang's decode admits a request only once its
                    # KV is allocated.
                    kv_capacity_tokens=e.kv_capacity_blocks * self.page_size
                    if e.phase == "decode"
                    else 0,
                )
            )
        return out

    async def run(self) -> None:
        start = time.monotonic()
        self.slices.start = start
        next_tick = start + self.interval
        while True:
            await asyncio.sleep(self.sample_interval)
            self.slices.sample(self.node_samples())
            if self.enabled and self.lease is not None:
                self._leads()  # a lease just gained is fenced now, not at the next decision
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + self.interval
                self.tick(now)

    def tick(self, now: float) -> None:
        """Closes the slice and, when enabled and no switch is in flight, asks the planner."""
        self.slices.close(now)
        if not self.enabled or self._switching or not self._leads():
            return
        current = self.split()
        nodes = self.nodes
        if current.prefill + current.decode != nodes:
            # An engine down (or not joined yet): the split of the cluster the planner weighs
            # is not the one running. It holds until the engines are back (the decision asked
            # with such a split raised, and the planner's task died: no decision ever again).
            if not self._held:
                log.warning("planner_held", split=str(current), engines=nodes)
            self._held = True
            return
        if self._held:
            log.info("planner_resumed", split=str(current))
            self._held = False
        try:
            target = self.planner.decide(now, current, list(self.slices.window), self.model)
        except ValueError as err:  # a split it cannot weigh (one phase only): it goes on
            log.error("planner_decision_failed", split=str(current), error=str(err))
            return
        decided = self.planner.decision(now, target)
        if decided is not None:  # kept or switched, and Θ per candidate: why
            self.decisions += 1
            self.last_decision_unix = time.time()
            log.info("planner_decision", **decided)
        if target is None or target == current:
            return
        to: Phase = "prefill" if target.prefill > current.prefill else "decode"
        source: Phase = "decode" if to == "prefill" else "prefill"
        n = abs(target.prefill - current.prefill)
        loads = self.registry.loads.loads
        movable = sorted(
            (e for e in self.registry.engines.values() if e.state == "up" and e.phase == source),
            key=lambda e: (loads[e.node].in_flight if e.node in loads else 0.0, e.node),
        )[:n]
        if not movable:
            self.planner.switch_done()
            return
        log.info(
            "switch", current=str(current), target=str(target), nodes=[e.node for e in movable]
        )
        for e in movable:
            self._switching.add(e.node)
            self.registry.set_state(e.node, "draining", f"switching to {to}")
        asyncio.get_running_loop().create_task(self._switch([e.node for e in movable], to))

    @property
    def epoch(self) -> int:
        """The epoch this planner's switches carry (0 without replicas)."""
        return 0 if self.lease is None else self.lease.epoch

    def _leads(self) -> bool:
        """Whether this replica may decide now: always without replicas; with them, while it
        holds the lease and once every engine is fenced at its epoch (started here)."""
        if self.lease is None:
            return True
        if not self.lease.is_leader:
            return False
        if self.fenced == self.lease.epoch:
            return True
        if not self._fencing:
            self._fencing = True
            asyncio.get_running_loop().create_task(self._fence(self.lease.epoch))
        return False

    async def _fence(self, epoch: int) -> None:
        """A no-op `SwitchPhase` (the engine's own phase) at `epoch` on every up engine: from
        then on each refuses an older epoch. An engine that cannot be reached is fenced by this
        leader's first switch to it, which carries the epoch too."""
        up = [e for e in self.registry.engines.values() if e.state == "up"]
        try:
            results = await asyncio.gather(
                *(self.clients[e.node].switch_phase(e.phase, leader_epoch=epoch, timeout=10.0)
                  for e in up if e.node in self.clients),
                return_exceptions=True,
            )  # fmt: skip
            stale = [r for r in results if isinstance(r, StaleLeaderError)]
            if stale:
                log.warning("planner_fence_refused", epoch=epoch, reason=str(stale[0]))
                return
            self.fenced = epoch
            log.info("planner_leads", epoch=epoch, engines=len(up))
        finally:
            self._fencing = False

    async def _switch(self, nodes: list[int], to: Phase) -> None:
        try:
            await asyncio.gather(*(self._switch_one(n, to) for n in nodes))
        finally:
            self.planner.switch_done()

    async def _switch_one(self, node: int, to: Phase) -> None:
        d = self.registry
        try:
            r = await self.clients[node].switch_phase(
                to,
                drain_timeout_s=DRAIN_TIMEOUT_S,
                leader_epoch=self.epoch,
                timeout=DRAIN_TIMEOUT_S + 60.0,
            )
        except EngineControlError as e:
            # The engine keeps its old phase (a drain timeout) or is down: the health loop
            # learns which once the node is no longer marked as switching.
            self.switches.append(SwitchRecord(node, to, False, reason=str(e)))
            log.warning("switch_failed", node=node, to=to, reason=str(e))
        else:
            d.set_phase(node, r.phase)
            d.set_state(node, "up")
            self.switches.append(SwitchRecord(node, r.phase, True, r.drain_s, r.switch_s))
            log.info("switched", node=node, to=r.phase, drain_s=r.drain_s, switch_s=r.switch_s)
        finally:
            self._switching.discard(node)
