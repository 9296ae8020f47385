"""The event loop: a trace's requests through routers, nodes, transfers and the planner.

A heap of `(time, seq, callback, argument)`: `seq` breaks ties in insertion order, so a run is
deterministic for a seed. A request's life:
1. ready (the closed loop: `agents.AgentReplay`) -> the router picks a prefill node among the
   accepting ones (held in a cluster queue while none accepts); `evolving` registers the
   request's prompt as its branch's context (`branch_set`);
2. prefill (`node.Node`, chunked iterations) -> the router picks a decode node; the request waits
   there until its KV fits, then its KV moves (bytes / `pd_bandwidth`; blocks the decode node
   already holds stay) and the prefill node unpins it;
3. decode spans -> the response: the closed loop posts what it unblocks; `evolving` sets the
   branch's context to prompt + response, or ends the branch.
Planner ticks close a slice and may start a switch; sample ticks read the nodes' state for the
slices; metrics ticks close a timeline point.
"""

from __future__ import annotations

import gc
import heapq
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from evolving_infra._core import KvDirectory
from evolving_infra.nodemodel.kv import NodeKv
from evolving_infra.nodemodel.node import Node, NodeSettings
from evolving_infra.nodemodel.request import SimRequest
from evolving_infra.planner.slices import Slices
from evolving_infra.routing.base import NodeLoad, RouteRequest
from evolving_infra.routing.index import LoadIndex
from evolving_infra.sim.agents import AgentReplay
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.metrics import Recorder
from evolving_infra.sim.planning import Switcher, sample_nodes
from evolving_infra.sim.policies import PolicyContext, PolicySpec
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.truth import RooflineTruth
from evolving_infra.types import Phase, blocks_for
from evolving_infra.workloads.model import Trace

Progress = Callable[[float], None]


def derive_seed(seed: int, purpose: str) -> int:
    """A seed per purpose, so adding a random draw for one purpose moves no other."""
    return random.Random(f"{seed}/{purpose}").getrandbits(63)


@dataclass(slots=True)
class RunStats:
    events: int = 0
    wall_s: float = 0.0
    observed_prefill: int = 0
    observed_decode: int = 0


class Cluster:
    """One run of one policy on one trace (build, then `run` once)."""

    def __init__(self, trace: Trace, config: SimConfig, policy: PolicySpec) -> None:
        self.trace, self.config, self.policy = trace, config, policy
        bs = config.block_size or trace.block_size
        self.block_size = bs
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        self.stats = RunStats()
        self.directory = KvDirectory()
        self.truth = RooflineTruth(
            config.deployment, noise=config.noise, seed=derive_seed(config.seed, "truth")
        )
        self.model = IterationModel(config.deployment)
        ctx = PolicyContext(config.nodes, bs, config, self.model)
        self.router = policy.router(ctx)
        # The router's index when it has one (`routing.index`): told of the nodes whose views
        # changed (`_dirty`) before each choice, instead of a view of every node per request.
        make = getattr(self.router, "index", None)
        self.index: LoadIndex | None = make() if make is not None else None
        planner = policy.planner(ctx) if policy.planner is not None else None
        split = policy.split or config.split()
        # Built once: `SimConfig`'s node figures build one on every read, and the transfers and
        # fetches below read them per request.
        hw = self.hardware = config.hardware
        settings = NodeSettings(
            block_size=bs,
            block_bytes=hw.block_bytes(bs),
            chunk_tokens=config.chunk_tokens,
            span_cap=config.decode_span_cap,
            l2_bandwidth=hw.l2_bandwidth,
            pool_bandwidth=hw.pool_bandwidth,
            net_bandwidth=hw.pd_bandwidth,
            shared_pool=policy.shared_pool,
            prefetch=policy.prefetch,
            accepted=config.deployment.mtp_accepted,
        )
        self.l1_blocks = hw.l1_blocks(bs)
        l2 = hw.l2_blocks(bs)
        self.nodes = [
            Node(
                i,
                "prefill" if i < split.prefill else "decode",
                NodeKv(
                    i,
                    self.directory,
                    self.l1_blocks,
                    l2,
                    pooled=policy.shared_pool and config.pool_one_copy,
                ),
                self.directory,
                settings,
                self,
            )
            for i in range(config.nodes)
        ]
        self.replay = AgentReplay(trace, self._post_ready)
        self.metrics = Recorder(bs)
        # Reuse tracking costs a dict update per arrival: only for a planner that reads it.
        tracked = planner is not None and planner.reads_reuse
        self.slices = Slices(config.slices_window_s, block_tokens=bs if tracked else None)
        self.planner = planner
        # One record per decision of a planner that prices candidates (`Planner.decision`).
        self.decisions: list[dict[str, Any]] = []
        self.switcher: Switcher | None = None
        if planner is not None:
            down = {
                "in-place-keep": config.switch_in_place_s,
                "in-place-drop": config.switch_in_place_s,
                "restart": config.switch_restart_s,
            }[planner.switch_mode]
            self.switcher = Switcher(
                self.nodes,
                planner,
                down,
                self.at,
                self._route_decode,
                self._retry_pending,
                self._route_prefill,
                self._take_prefilled,
                self.decode_reserved,
                self._moved,
            )
        self.pending_prefill: deque[SimRequest] = deque()
        self.pending_decode: deque[SimRequest] = deque()
        self.outstanding = 0  # posted by the replay, not yet answered
        self.last_response = 0.0
        # When each branch's last request was answered, until its next arrives (the think time
        # the planner's window counts, as the live router reads it from its branch tracker).
        self._last_answer: dict[str, float] = {}
        self._observed = {"prefill": -1e300, "decode": -1e300}
        self._observe_gap = 1.0 / config.observe_per_s if config.observe_per_s > 0 else 0.0
        self._has_observe_fetch = hasattr(self.router, "observe_fetch")
        self._dirty: set[int] = set(range(len(self.nodes)))  # views `index` has not seen
        self._early = config.decode_allocation == "early"
        self._admit_first = self._early and policy.admission

    # -- the loop -----------------------------------------------------------------------------

    def at(self, t: float, fn: Callable[[Any], None], arg: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, arg))

    def run(
        self, progress: Progress | None = None, check: Callable[[], None] | None = None
    ) -> float:
        """Runs to `config.duration` (or until every request is answered); returns the end.
        `check()`, if given, runs after every event (tests assert invariants with it)."""
        import time

        started = time.perf_counter()
        c = self.config
        end = c.duration if c.duration is not None else c.max_time
        self.replay.start()
        self._progress = progress
        self.at(c.sample_interval, self._sample_tick, None)
        self.at(c.metrics_interval, self._metrics_tick, None)
        if self.planner is not None:
            self._planner_interval = c.planner_interval or self.planner.interval
            self.at(self._planner_interval, self._planner_tick, None)
        heap, pop, events = self._heap, heapq.heappop, 0
        # NOTE: the trace (millions of requests and block tuples at 3,072 GPUs) lives as long as
        # the run, and each full collection of the cyclic GC walked all of it (a sixth of the
        # run at 3,072 GPUs, 2,000 agents). Frozen objects are never scanned, nor freed: none is
        # garbage before the run ends and unfreezes them (and whatever a caller had frozen).
        # What the run itself allocates is collected as usual.
        gc.freeze()
        try:
            while heap:
                t, _, fn, arg = heap[0]
                if t > end:
                    break
                pop(heap)
                self.now = t
                fn(arg)
                events += 1
                if check is not None:
                    check()
        finally:
            gc.unfreeze()
        self.stats.events = events
        self.stats.wall_s = time.perf_counter() - started
        # With a duration the run covers it; without, it ends at the last response (the ticks
        # that follow it measure nothing).
        return c.duration if c.duration is not None else self.last_response

    def _idle(self) -> bool:
        """Nothing will ever happen again (runs without a duration stop their ticks)."""
        return self.config.duration is None and self.outstanding == 0

    def _sample_tick(self, _: object) -> None:
        sample_nodes(self.slices, self.nodes)
        if self._progress is not None:
            self._progress(self.now)
        if not self._idle():
            self.at(self.now + self.config.sample_interval, self._sample_tick, None)

    def _metrics_tick(self, _: object) -> None:
        self._point()
        if not self._idle():
            self.at(self.now + self.config.metrics_interval, self._metrics_tick, None)

    def _point(self) -> None:
        span = self.config.metrics_interval
        last = self.metrics.timeline[-1].t if self.metrics.timeline else 0.0
        if self.now > last:
            span = self.now - last
        p = sum(1 for n in self.nodes if n.phase == "prefill" and n.state == "active")
        d = sum(1 for n in self.nodes if n.phase == "decode" and n.state == "active")
        self.metrics.point(self.now, span, p, d, len(self.nodes) - p - d)

    def _planner_tick(self, _: object) -> None:
        assert self.planner is not None
        assert self.switcher is not None
        self.slices.close(self.now)
        target = self.planner.decide(
            self.now, self.switcher.split(), list(self.slices.window), self.model
        )
        decided = self.planner.decision(self.now, target)
        if decided is not None:
            self.decisions.append(decided)
        if target is not None:
            self.switcher.request(target, self.now)
        if not self._idle():
            self.at(self.now + self._planner_interval, self._planner_tick, None)

    # -- requests -----------------------------------------------------------------------------

    def _post_ready(self, t: float, req: SimRequest) -> None:
        self.outstanding += 1
        self.at(t, self._ready, req)

    def _ready(self, req: SimRequest) -> None:
        req.issued = self.now
        self.metrics.issued += 1
        limit = self.config.context_length
        if blocks_for(req.prompt_tokens + req.output_tokens, self.block_size) > self.l1_blocks or (
            # a request asks for at least one token (the API's max_tokens >= 1)
            limit is not None and req.prompt_tokens + max(req.output_tokens, 1) > limit
        ):
            req.done = self.now
            self.metrics.done(req, rejected=True)
            self._respond(req, served=False)
            return
        if self.policy.branch_counts and req.hashes:
            self.directory.branch_set(req.key, req.hashes)
        if self._admit_first and req.output_tokens > 0:
            # The router's decode-KV gate (`PolicySpec.admission`): the decode node reserves
            # first, the prefill node is chosen once it has (`decode_reserved`).
            self._route_decode(req)
        else:
            self._route_prefill(req)

    def _loads(self, phase: str) -> list[NodeLoad]:
        # A router without an index gets a view of each of the phase's nodes per request (~3 µs
        # a node: fine at 9 nodes, the driver's largest cost at 768; see `_accepting`).
        return [n.load() for n in self.nodes if n.phase == phase]

    def _moved(self, node: Node) -> None:
        """`node`'s view may have changed (its queue, batch, KV, state or phase)."""
        self._dirty.add(node.id)

    def _accepting(self, phase: Phase) -> bool:
        """Whether a node of `phase` accepts work; brings the index up to date first."""
        index = self.index
        if index is None:
            return any(n.accepting and n.phase == phase for n in self.nodes)
        if self._dirty:
            nodes = self.nodes
            for i in self._dirty:
                index.put(nodes[i].load())
            self._dirty.clear()
        return index.accepting(phase) > 0

    def _route_prefill(self, req: SimRequest) -> None:
        if not self._accepting("prefill"):
            self.pending_prefill.append(req)
            return
        # One match for the router and the node's cached-prefix estimate: nothing changes the
        # directory in between.
        rr = RouteRequest.matched(self.directory, req.hashes, req.prompt_tokens, 0, req.key)
        match = rr.prefix()
        if self.index is not None:
            p = self.index.choose_prefill(rr).node
        else:
            p = self.router.choose_prefill(rr, self._loads("prefill")).node
        node = self._check(p, "prefill")
        # A request a draining node handed back (placed before) is not a new arrival.
        first = req.prefill_node < 0
        req.prefill_node = p
        # Early decode allocation (SGLang's default) without the router's gate: the prefill node
        # is chosen now, with the decode node, as SGLang's gateway dispatches, and holds the
        # request in its bootstrap queue until the decode node has reserved (`decode_reserved`).
        hold = self._early and req.output_tokens > 0 and not req.bootstrapped
        u, c = (node.hold if hold else node.enqueue)(req, self.now, match)
        self._dirty.add(p)
        if first:
            answered = self._last_answer.pop(req.key, None)
            think = None if answered is None else req.issued - answered
            self.slices.arrival(req.prompt_tokens, u, c, req.hashes, self.now, think_s=think)
            if hold:
                self._route_decode(req)

    def _route_decode(self, req: SimRequest) -> None:
        if not self._accepting("decode"):
            self.pending_decode.append(req)
            return
        # The output the node reserves, as the live router passes `max_tokens`.
        rr = RouteRequest(req.hashes, req.prompt_tokens, req.output_tokens, req.key)
        if self.index is not None:
            d = self.index.choose_decode(rr)
        else:
            d = self.router.choose_decode(rr, self._loads("decode"))
        admitted = self._check(d, "decode").offer(req, self.now)
        self._dirty.add(d)
        if admitted:
            self.decode_reserved(req)

    def _check(self, node: int, phase: str) -> Node:
        n = self.nodes[node] if 0 <= node < len(self.nodes) else None
        if n is None or n.phase != phase or not n.accepting:
            raise RuntimeError(
                f"router {self.router.name!r} chose {node}, not an accepting {phase} node"
            )
        return n

    def _take_prefilled(self, prefill_node: int) -> list[SimRequest]:
        """Requests prefilled on `prefill_node` that wait for a decode node, taken out of the
        decode nodes' queues and the cluster's (the node adopts them, `Switcher._adopt`)."""
        out: list[SimRequest] = []
        for n in self.nodes:
            if n.phase == "decode" and n.waiting:
                out.extend(n.take_waiting_from(prefill_node, self.now))
                self._dirty.add(n.id)
        mine = [r for r in self.pending_decode if r.prefill_node == prefill_node]
        if mine:
            self.pending_decode = deque(
                r for r in self.pending_decode if r.prefill_node != prefill_node
            )
            out.extend(mine)
        return out

    def _retry_pending(self) -> None:
        for queue, route in (
            (self.pending_prefill, self._route_prefill),
            (self.pending_decode, self._route_decode),
        ):
            waiting = list(queue)
            queue.clear()
            for r in waiting:
                route(r)

    def _arrived(self, req: SimRequest) -> None:
        self.nodes[req.prefill_node].release(req, self.now)
        req.first_token = self.now
        self.metrics.produced(1)
        self.slices.tokens(1)
        self.nodes[req.decode_node].arrive(req, self.now)
        self._dirty.add(req.prefill_node)
        self._dirty.add(req.decode_node)

    def _respond(self, req: SimRequest, served: bool = True) -> None:
        self.outstanding -= 1
        self.last_response = self.now
        ended = self.replay.complete(req, self.now)
        if served:
            self.slices.answered(req.first_token - req.issued, self.now - req.issued)
        if not ended:
            self._last_answer[req.key] = self.now
        if self.policy.branch_counts:
            if ended:
                self.directory.branch_end(req.key)
            elif served and req.hashes:
                # What the live router knows once the response is in: the branch's context is
                # now its prompt and the response (its next prompt will extend them).
                self.directory.branch_set(req.key, req.hashes + req.out_hashes)

    # -- the nodes' environment (`node.Env`) --------------------------------------------------

    def observe_prefill(self, pairs: list[tuple[int, int]], seconds: float) -> None:
        if self.now - self._observed["prefill"] >= self._observe_gap:
            self._observed["prefill"] = self.now
            self.stats.observed_prefill += 1
            self.model.observe_prefill(pairs, seconds, self.now)

    def observe_decode(self, batch: int, context: int, seconds: float) -> None:
        if self.now - self._observed["decode"] >= self._observe_gap:
            self._observed["decode"] = self.now
            self.stats.observed_decode += 1
            self.model.observe_decode(batch, context, seconds, self.now)

    def fetched(self, l2_blocks: int, remote_blocks: int, seconds: float) -> None:
        if not self._has_observe_fetch:
            return
        hw = self.hardware
        bb = hw.block_bytes(self.block_size)
        observe = self.router.observe_fetch  # type: ignore[attr-defined]
        if l2_blocks > 0:
            observe("l2", l2_blocks * bb, l2_blocks * bb / hw.l2_bandwidth)
        if remote_blocks > 0:
            observe("pool", remote_blocks * bb, remote_blocks * bb / hw.pool_bandwidth)

    def prefilled(self, req: SimRequest) -> None:
        self.metrics.prefilled(req)
        self.slices.prefilled(req.prompt_tokens, req.uncached)
        if req.output_tokens <= 0:
            self.nodes[req.prefill_node].release(req, self.now)
            req.first_token = req.done = self.now
            self.metrics.done(req)
            self._respond(req)
            return
        if self._early:
            self.decode_reserved(req)  # reserved before the prefill was queued
        else:
            self._route_decode(req)

    def decode_reserved(self, req: SimRequest) -> None:
        """A decode node has reserved `req`'s KV: the KV moves now, or, with early allocation
        before the prefill ran, the prefill node queues the request (SGLang's prefill node
        queues it once bootstrapped), chosen now under the router's gate. A request handed back
        by a draining prefill node and not placed again yet (`pending_prefill`) is queued when
        it is."""
        if req.prefill_done < 0:
            req.bootstrapped = True
            if req.prefill_node < 0:
                self._route_prefill(req)  # the gate's way: the prefill node is chosen now
            else:
                self.nodes[req.prefill_node].bootstrap(req, self.now)
                self._dirty.add(req.prefill_node)
            return
        moved = max(req.prompt_tokens - req.h_d * self.block_size, 0)
        hw = self.hardware
        seconds = self.config.transfer_latency + moved * hw.kv_bytes_per_token / hw.pd_bandwidth
        self.at(self.now + seconds, self._arrived, req)

    def span_done(self, tokens: int) -> None:
        self.metrics.produced(tokens)
        self.slices.tokens(tokens)

    def decoded(self, req: SimRequest) -> None:
        self.metrics.done(req)
        self._respond(req)

    def next_hashes(self, req: SimRequest) -> list[int] | None:
        return self.replay.next_hashes(req)

    def changed(self, node: Node) -> None:
        self._dirty.add(node.id)
        if node.state == "draining" and self.switcher is not None:
            self.switcher.check(node, self.now)
