"""The planner's side of the loop: samples of the nodes, and switches carried out.

The planner's window (`planner.slices.Slices`, shared with the live router) is fed arrivals with
the cached and uncached split the prefill node estimated when they were queued, tokens decoded,
and samples of the nodes every `sample_interval` (`node_samples`: decode batch and context,
prefill queue drain time, decode KV use by running requests, as an engine reports it; the
busiest prefill queue in tokens and the highest decode KV demand; per engine, the least and the
most loaded prefill queue in seconds and decode node in KV tokens). The prefill queue is the
work a node has to do: requests in its bootstrap queue wait for decode KV, not for it, and count
for no planner (SGLang keeps them apart from its waiting queue too).

`Switcher` carries a planner's target split out (docs/simulator.md, "Phase switches"): the
least loaded nodes of the phase that shrinks stop accepting work, drain (their running requests
finish; a decode node's not-yet-admitted requests are routed elsewhere), go down for the switch
time (KV kept, or cleared for `in-place-drop` and `restart`) and come back in the other phase.
The planner hears `switch_done()` once every node of the switch is back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from evolving_infra.nodemodel.node import Node
from evolving_infra.nodemodel.request import SimRequest
from evolving_infra.planner.base import Planner, Split, SwitchMode
from evolving_infra.planner.slices import NodeSample, Slices


def sample_nodes(slices: Slices, nodes: Sequence[Node]) -> None:
    """`slices.sample(node_samples(nodes))` without a `NodeSample` per node (768 nodes every
    simulated second at 3,072 GPUs): the same sums, in the same order, and the same per-node
    figures (a simulated decode node never preempts: its queued decode KV is 0)."""
    decode = decoding = context = prefill = max_waiting = capacity = 0
    kv_used = queued = max_demand = min_demand = q_lo = q_hi = 0.0
    # (KV tokens, requests) of the least and the most loaded decode node, compared as tuples
    lo_t = lo_r = hi_t = hi_r = 0
    for n in nodes:
        if n.state == "down":
            continue
        if n.phase == "decode":
            used = n.kv_use()
            tokens, requests = n.batch_context, len(n.batch)
            cap = n.kv.l1_capacity * n.s.block_size
            if decode == 0:
                lo_t, lo_r = hi_t, hi_r = tokens, requests
                min_demand = max_demand = used
                capacity = cap
            else:
                if tokens < lo_t or (tokens == lo_t and requests < lo_r):
                    lo_t, lo_r = tokens, requests
                elif tokens > hi_t or (tokens == hi_t and requests > hi_r):
                    hi_t, hi_r = tokens, requests
                if used > max_demand:
                    max_demand = used
                elif used < min_demand:
                    min_demand = used
                if cap > capacity:
                    capacity = cap
            decode += 1
            decoding += requests
            context += tokens
            kv_used += used
        else:
            demand = n.prefill_demand_s()
            if prefill == 0:
                q_lo = q_hi = demand
            elif demand < q_lo:
                q_lo = demand
            elif demand > q_hi:
                q_hi = demand
            prefill += 1
            queued += demand
            max_waiting = max(max_waiting, n.waiting_prefill_tokens())
    slices.add_sample(
        decode,
        decoding,
        context,
        kv_used,
        prefill,
        queued,
        max_waiting,
        max_demand,
        min_prefill_queue_s=q_lo,
        max_prefill_queue_s=q_hi,
        min_decode_kv=(lo_t, lo_r),
        max_decode_kv=(hi_t, hi_r),
        min_kv_demand=min_demand,
        decode_kv_capacity_tokens=capacity,
    )


def node_samples(nodes: Sequence[Node]) -> list[NodeSample]:
    """The simulator's nodes as the planner's slices sample them (nodes that are up)."""
    out = []
    for n in nodes:
        if n.state == "down":
            continue
        decode = n.phase == "decode"
        out.append(
            NodeSample(
                phase=n.phase,
                queued_prefill_s=n.prefill_demand_s(),
                decoding=len(n.batch),
                context_tokens=n.batch_context,
                kv_used=n.kv_use(),
                queued_prefill_tokens=0 if decode else n.waiting_prefill_tokens(),
                kv_capacity_tokens=n.kv.l1_capacity * n.s.block_size if decode else 0,
            )
        )
    return out


@dataclass(slots=True)
class SwitchLog:
    """One node's switch, for the metrics."""

    node: int
    to: str
    requested: float
    drained: float = -1.0
    up: float = -1.0
    adopted: list[int] = field(default_factory=list)  # ids of requests it prefilled and then
    # decoded itself after the switch (`Switcher._adopt`)


class Switcher:
    """Drains, flips and restarts nodes toward a planner's target split."""

    def __init__(
        self,
        nodes: Sequence[Node],
        planner: Planner,
        down_s: float,
        at: Callable[[float, Callable[[Node], None], Node], None],
        reroute: Callable[[SimRequest], None],
        back: Callable[[], None],
        reroute_prefill: Callable[[SimRequest], None],
        take_prefilled: Callable[[int], list[SimRequest]] | None = None,
        decode_reserved: Callable[[SimRequest], None] | None = None,
        moved: Callable[[Node], None] | None = None,
    ) -> None:
        self.nodes = nodes
        self.planner = planner
        self.mode: SwitchMode = planner.switch_mode
        self.down_s = down_s
        self._at = at
        self._reroute = reroute  # a decode node's waiting requests, sent elsewhere
        self._reroute_prefill = reroute_prefill  # a prefill node's queued ones
        self._back = back  # a node is back: the cluster retries what waited for one
        # in-place-keep, prefill -> decode: requests prefilled on the node and still waiting for
        # a decode node (taken out of the queues they wait in), and how they start decoding.
        self._take_prefilled = take_prefilled
        self._decode_reserved = decode_reserved
        # A node's state, phase or KV changed here: the cluster's routing index must hear it
        # before the next routing decision (the reroutes below make some at once).
        self._moved = moved if moved is not None else _ignore
        self.adopted: dict[int, list[SimRequest]] = {}
        self.in_flight: dict[int, SwitchLog] = {}
        self.log: list[SwitchLog] = []

    def split(self) -> Split:
        p = sum(1 for n in self.nodes if n.phase == "prefill")
        return Split(p, len(self.nodes) - p)

    def request(self, target: Split, now: float) -> bool:
        """Starts switching toward `target`; False (the planner is told at once) when a switch
        is still in flight or `target` is the current split."""
        n = len(self.nodes)
        if target.prefill + target.decode != n or target.prefill < 1 or target.decode < 1:
            raise ValueError(
                f"planner {self.planner.name!r} asked for {target}, not a split of {n}"
            )
        current = self.split()
        if self.in_flight or target == current:
            self.planner.switch_done()
            return False
        shrink = "prefill" if target.prefill < current.prefill else "decode"
        count = abs(target.prefill - current.prefill)
        cands = [x for x in self.nodes if x.phase == shrink and x.state == "active"]
        cands.sort(key=_load_key)
        for node in cands[:count]:
            log = SwitchLog(node.id, "decode" if shrink == "prefill" else "prefill", now)
            self.in_flight[node.id] = log
            self.log.append(log)
            node.state = "draining"
            node.drain_start = now
            self._moved(node)
            for r in node.take_waiting():
                self._reroute(r)
            for r in node.take_queued(now):
                self._reroute_prefill(r)
            self._moved(node)
            self.check(node, now)
        return True

    def check(self, node: Node, now: float) -> None:
        """Called whenever a draining node may have finished its work."""
        if node.state != "draining":
            return
        log = self.in_flight[node.id]
        if not node.drained() and not self._adopt(node, log):
            return
        log.drained = now
        node.state = "down"
        if self.mode != "in-place-keep":
            node.kv.clear()
        self._moved(node)
        self._at(now + self.down_s, self._up, node)

    def _adopt(self, node: Node, log: SwitchLog) -> bool:
        """Whether a prefill node switching to decode in place may go down although it still
        pins KV: when all it pins is the KV of requests it prefilled that wait for a decode
        node, it takes them (it keeps their KV through the switch; once it decodes it admits
        those that fit and sends the rest back to wait for any decode node, `_up`). Without
        this the drain waits until saturated decode nodes admit them, which can take the whole
        of the shortage the switch is meant to relieve."""
        if (
            self.mode != "in-place-keep"
            or log.to != "decode"
            or self._take_prefilled is None
            or node.busy
            or node.queue
            or node.running
        ):
            return False
        adopted = self.adopted.setdefault(node.id, [])
        adopted.extend(self._take_prefilled(node.id))
        log.adopted = [r.id for r in adopted]
        # Transfers from this node in flight still pin their KV until they land.
        return node.kv.pinned == sum(r.pin_p for r in adopted)

    def _up(self, node: Node) -> None:
        log = self.in_flight.pop(node.id)
        node.phase = "prefill" if log.to == "prefill" else "decode"
        node.state = "active"
        log.up = node.env.now
        rest: list[SimRequest] = []
        for r in self.adopted.pop(node.id, []):
            # Its prompt is in this node's L1: the decode admission finds it all (h_d) and
            # the transfer moves nothing.
            if node.adopt(r, log.up):
                if self._decode_reserved is not None:
                    self._decode_reserved(r)
            else:
                rest.append(r)
        self._moved(node)
        # What does not fit here now waits for a decode node like any prefilled request (this
        # one included): the requests came from every decode node's queue, and queueing them
        # all here left the other decode nodes idle while this one worked through them (the
        # shift scenario: 230 adopted, 35 minutes at a ninth of the best split's throughput).
        for r in rest:
            self._reroute(r)
        if not self.in_flight:
            self.planner.switch_done()
        self._back()


def _ignore(node: Node) -> None:
    pass


def _load_key(n: Node) -> tuple[float, int, int]:
    if n.phase == "prefill":
        return (n.queued_s, len(n.queue) + len(n.running), n.id)
    return (float(len(n.batch) + len(n.joining) + n.inbound), n.kv.used, n.id)
