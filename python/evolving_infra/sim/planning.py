"""The planner's side of the loop: slices of what happened, and switches carried out.

`Slices` accumulates one `SliceStats` per planner tick: arrivals and their prompt tokens (with
the cached and uncached split the prefill node estimated when they were queued), tokens decoded,
and time averages of the nodes' state sampled every `sample_interval` (decode batch and context,
prefill queue drain time, decode KV use by running requests, as an engine reports it). The
planner sees the slices of the last `planner_window_s`.

`Switcher` carries a planner's target split out (docs/simulator.md, "Phase switches"): the
least loaded nodes of the phase that shrinks stop accepting work, drain (their running requests
finish; a decode node's not-yet-admitted requests are routed elsewhere), go down for the switch
time (KV kept, or cleared for `in-place-drop` and `restart`) and come back in the other phase.
The planner hears `switch_done()` once every node of the switch is back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from evolving_infra.planner.base import Planner, SliceStats, Split, SwitchMode
from evolving_infra.sim.agents import SimRequest
from evolving_infra.sim.node import Node


class Slices:
    """Accumulates the current slice; `close` turns it into a `SliceStats`."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.window: deque[SliceStats] = deque()
        self._reset(0.0)

    def _reset(self, start: float) -> None:
        self.start = start
        self.requests = self.prompt = self.uncached = self.cached = self.output = 0
        self.samples = 0
        self.batch_sum = 0.0  # Σ over samples of the mean batch per decode node
        self.context_sum = 0.0  # Σ over samples of the total context decoding
        self.decoding_sum = 0.0  # Σ over samples of the requests decoding
        self.queue_sum = 0.0  # Σ over samples of the mean prefill queue (s)
        self.kv_sum = 0.0  # Σ over samples of the mean decode KV use (0..1)

    def arrival(self, prompt: int, uncached: int, cached: int) -> None:
        self.requests += 1
        self.prompt += prompt
        self.uncached += uncached
        self.cached += cached

    def tokens(self, n: int) -> None:
        self.output += n

    def sample(self, nodes: Sequence[Node]) -> None:
        decode = [n for n in nodes if n.phase == "decode" and n.state != "down"]
        prefill = [n for n in nodes if n.phase == "prefill" and n.state != "down"]
        self.samples += 1
        if decode:
            b = sum(len(n.batch) for n in decode)
            self.decoding_sum += b
            self.batch_sum += b / len(decode)
            self.context_sum += sum(r.context for n in decode for r in n.batch)
            # KV in use by running requests (an engine's token usage): the cache that fills the
            # rest of L1 is evictable, so it is not counted.
            self.kv_sum += sum(
                min(n.kv.reserved + n.kv.pinned, n.kv.l1_capacity) / n.kv.l1_capacity
                for n in decode
            ) / len(decode)
        if prefill:
            self.queue_sum += sum(max(n.queued_s, 0.0) for n in prefill) / len(prefill)

    def close(self, now: float) -> SliceStats:
        k = max(self.samples, 1)
        s = SliceStats(
            start=self.start,
            end=now,
            requests=self.requests,
            prompt_tokens=self.prompt,
            uncached_tokens=self.uncached,
            cached_tokens=self.cached,
            output_tokens=self.output,
            mean_decode_batch=self.batch_sum / k,
            mean_context_tokens=self.context_sum / self.decoding_sum if self.decoding_sum else 0.0,
            prefill_queue_s=self.queue_sum / k,
            kv_utilization=self.kv_sum / k,
            mean_input_tokens=self.prompt / self.requests if self.requests else 0.0,
        )
        self.window.append(s)
        while self.window and self.window[0].end <= now - self.window_s:
            self.window.popleft()
        self._reset(now)
        return s


@dataclass(slots=True)
class SwitchLog:
    """One node's switch, for the metrics."""

    node: int
    to: str
    requested: float
    drained: float = -1.0
    up: float = -1.0


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
    ) -> None:
        self.nodes = nodes
        self.planner = planner
        self.mode: SwitchMode = planner.switch_mode
        self.down_s = down_s
        self._at = at
        self._reroute = reroute  # a decode node's waiting requests, sent elsewhere
        self._reroute_prefill = reroute_prefill  # a prefill node's queued ones
        self._back = back  # a node is back: the cluster retries what waited for one
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
            for r in node.take_waiting():
                self._reroute(r)
            for r in node.take_queued(now):
                self._reroute_prefill(r)
            self.check(node, now)
        return True

    def check(self, node: Node, now: float) -> None:
        """Called whenever a draining node may have finished its work."""
        if node.state != "draining" or not node.drained():
            return
        log = self.in_flight[node.id]
        log.drained = now
        node.state = "down"
        if self.mode != "in-place-keep":
            node.kv.clear()
        self._at(now + self.down_s, self._up, node)

    def _up(self, node: Node) -> None:
        log = self.in_flight.pop(node.id)
        node.phase = "prefill" if log.to == "prefill" else "decode"
        node.state = "active"
        log.up = node.env.now
        if not self.in_flight:
            self.planner.switch_done()
        self._back()


def _load_key(n: Node) -> tuple[float, int, int]:
    if n.phase == "prefill":
        return (n.queued_s, len(n.queue) + len(n.running), n.id)
    return (float(len(n.batch) + len(n.joining) + n.inbound), n.kv.used, n.id)
