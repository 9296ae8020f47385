"""The planner's window: one `SliceStats` per planner tick, accumulated by a driver.

Both drivers (the simulator and the live router) feed the same accumulator: arrivals with the
cached/uncached split estimated when the request was placed, prefills as they ran with the
split they really had, output tokens as they are decoded, and periodic samples of the nodes
(`NodeSample`s, which each driver builds from its own view of a node). The planner sees the
slices of the last `window_s` seconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from evolving_infra.planner.base import SliceStats, thin
from evolving_infra.planner.reuse import Reuse, ReuseTracker
from evolving_infra.types import Phase


@dataclass(frozen=True, slots=True)
class NodeSample:
    """One node that is up (not switching, not restarting), at one sampling instant."""

    phase: Phase
    queued_prefill_s: float  # predicted seconds of prefill work queued (prefill nodes)
    decoding: int  # requests in the running decode batch (decode nodes)
    context_tokens: int  # their total context
    # KV in use by running requests, 0..1 (an engine's token usage): the cache that fills the
    # rest of L1 is evictable, so it is not counted.
    kv_used: float
    # Uncached prompt tokens waiting in the prefill queue, not started (prefill nodes).
    queued_prefill_tokens: int = 0
    # Decode requests preempted back to the waiting queue and their KV tokens (an engine's
    # `queued_requests.num_decode_requests` / `sum_decode_kv_tokens`, which Dynamo's ITL
    # estimate adds). Neither driver's engines preempt (or report it): 0 there.
    queued_decode: int = 0
    queued_decode_tokens: int = 0
    # KV tokens the node's cache holds (decode nodes; 0 when unknown).
    kv_capacity_tokens: int = 0


class Slices:
    """Accumulates the current slice; `close` turns it into a `SliceStats`. With
    `block_tokens` (the drivers' page size) it also tracks how long ago each arrival's
    reusable prefix was last in a prompt (`reuse.ReuseTracker`), which arrivals then pass
    their block hashes for."""

    def __init__(self, window_s: float, block_tokens: int | None = None) -> None:
        self.window_s = window_s
        self.window: deque[SliceStats] = deque()
        self.reuse = ReuseTracker(block_tokens) if block_tokens is not None else None
        self._reset(0.0)

    def _reset(self, start: float) -> None:
        self.start = start
        self.requests = self.prompt = self.uncached = self.cached = self.output = 0
        self.arrived: list[tuple[int, int]] = []  # (uncached, cached) of every arrival
        self.arrived_reuse: list[Reuse] = []  # their reusable prefixes, when tracked
        self.think_sum = 0.0  # Σ of the arrivals' think times, where known
        self.think_n = 0
        self.response_sum = 0.0  # Σ of the answered requests' arrival-to-last-token times
        self.ttft_sum = 0.0
        self.answered_n = 0
        self.decode_nodes_sum = 0  # Σ over samples of the decode nodes up
        self.prefills = self.prefilled_prompt = self.prefilled_uncached = 0
        self.samples = 0
        self.batch_sum = 0.0  # Σ over samples of the mean batch per decode node
        self.context_sum = 0.0  # Σ over samples of the total context decoding
        self.decoding_sum = 0.0  # Σ over samples of the requests decoding
        self.queue_sum = 0.0  # Σ over samples of the mean prefill queue (s)
        self.kv_sum = 0.0  # Σ over samples of the mean decode KV use (0..1)
        self.max_queued_prefill = 0  # at the last sample: the busiest prefill node's queue
        # At the last sample: the fullest decode node's KV demand. Dynamo's signal adds the KV of
        # requests preempted back to the waiting queue; neither driver's engines preempt (or
        # report it), so it is the running batch's KV use, `kv_used`.
        self.max_kv_demand = 0.0
        # At the last sample, per engine (`SliceStats`' fields of the same names).
        self.min_prefill_queue_s = self.max_prefill_queue_s = 0.0
        self.min_decode_kv_tokens = self.min_decode_kv_requests = 0
        self.max_decode_kv_tokens = self.max_decode_kv_requests = 0
        self.min_kv_demand = 0.0  # at the last sample: the emptiest decode node's KV demand
        self.decode_kv_capacity = 0

    def arrival(
        self,
        prompt: int,
        uncached: int,
        cached: int,
        hashes: Sequence[int] = (),
        now: float = 0.0,
        *,
        sampled: bool = False,
        think_s: float | None = None,
    ) -> None:
        """A request arrived at `now`, its prompt estimated `uncached` + `cached` when placed;
        `hashes`: its blocks', for the reuse tracker (ignored without one); `sampled`: only
        every `reuse.REUSE_STRIDE`-th of them (another router replica's arrival); `think_s`:
        the time since its branch's last response (None: its branch's first request)."""
        if think_s is not None:
            self.think_sum += max(think_s, 0.0)
            self.think_n += 1
        if self.reuse is not None:
            self.arrived_reuse.append(self.reuse.observe(now, hashes, sampled=sampled))
        self.requests += 1
        self.prompt += prompt
        self.uncached += uncached
        self.cached += cached
        self.arrived.append((uncached, cached))

    def answered(self, ttft_s: float, response_s: float) -> None:
        """A request was answered: its first token `ttft_s` after it arrived, its last
        `response_s` after."""
        self.ttft_sum += max(ttft_s, 0.0)
        self.response_sum += max(response_s, 0.0)
        self.answered_n += 1

    def prefilled(self, prompt: int, uncached: int) -> None:
        """A prefill ran with `uncached` of its `prompt` tokens computed (the rest cached)."""
        self.prefills += 1
        self.prefilled_prompt += prompt
        self.prefilled_uncached += uncached

    def tokens(self, n: int) -> None:
        self.output += n

    def sample(self, nodes: Sequence[NodeSample]) -> None:
        decode = [n for n in nodes if n.phase == "decode"]
        prefill = [n for n in nodes if n.phase == "prefill"]
        queues = [max(n.queued_prefill_s, 0.0) for n in prefill]
        # A decode engine's ITL inputs: (KV tokens, requests), scheduled plus queued; `min` and
        # `max` compare them as `sim.planning.sample_nodes` does.
        loads = [
            (x.context_tokens + x.queued_decode_tokens, x.decoding + x.queued_decode)
            for x in decode
        ]
        least, most = (min(loads), max(loads)) if loads else ((0, 0), (0, 0))
        self.add_sample(
            len(decode),
            sum(n.decoding for n in decode),
            sum(n.context_tokens for n in decode),
            sum(n.kv_used for n in decode),
            len(prefill),
            sum(queues),
            max((n.queued_prefill_tokens for n in prefill), default=0),
            max((n.kv_used for n in decode), default=0.0),
            min_prefill_queue_s=min(queues, default=0.0),
            max_prefill_queue_s=max(queues, default=0.0),
            min_decode_kv=least,
            max_decode_kv=most,
            min_kv_demand=min((n.kv_used for n in decode), default=0.0),
            decode_kv_capacity_tokens=max((n.kv_capacity_tokens for n in decode), default=0),
        )

    def add_sample(
        self,
        decode_nodes: int,
        decoding: int,
        context_tokens: int,
        kv_used: float,
        prefill_nodes: int,
        queued_prefill_s: float,
        max_queued_prefill_tokens: int = 0,
        max_kv_demand: float = 0.0,
        *,
        min_prefill_queue_s: float = 0.0,
        max_prefill_queue_s: float = 0.0,
        min_decode_kv: tuple[int, int] = (0, 0),
        max_decode_kv: tuple[int, int] = (0, 0),
        min_kv_demand: float = 0.0,
        decode_kv_capacity_tokens: int = 0,
    ) -> None:
        """`sample` from the sums over the nodes (each sum in node order, as `sample` adds
        them) and the per-node figures, for a caller that has them without building a
        `NodeSample` per node. `min_decode_kv` / `max_decode_kv`: (KV tokens, requests) of the
        decode node with the least / most KV tokens, scheduled plus queued (ties: the fewer /
        more requests, then the first node)."""
        self.samples += 1
        self.decode_nodes_sum += decode_nodes
        self.max_queued_prefill = max_queued_prefill_tokens
        self.max_kv_demand = max_kv_demand
        self.min_prefill_queue_s = min_prefill_queue_s
        self.max_prefill_queue_s = max_prefill_queue_s
        self.min_decode_kv_tokens, self.min_decode_kv_requests = min_decode_kv
        self.max_decode_kv_tokens, self.max_decode_kv_requests = max_decode_kv
        self.min_kv_demand = min_kv_demand
        self.decode_kv_capacity = decode_kv_capacity_tokens
        if decode_nodes:
            self.decoding_sum += decoding
            self.batch_sum += decoding / decode_nodes
            self.context_sum += context_tokens
            self.kv_sum += kv_used / decode_nodes
        if prefill_nodes:
            self.queue_sum += queued_prefill_s / prefill_nodes

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
            prefills=self.prefills,
            prefilled_prompt_tokens=self.prefilled_prompt,
            prefilled_uncached_tokens=self.prefilled_uncached,
            max_queued_prefill_tokens=self.max_queued_prefill,
            max_decode_kv_demand=self.max_kv_demand,
            min_prefill_queue_s=self.min_prefill_queue_s,
            max_prefill_queue_s=self.max_prefill_queue_s,
            min_decode_kv_tokens=self.min_decode_kv_tokens,
            min_decode_kv_requests=self.min_decode_kv_requests,
            max_decode_kv_tokens=self.max_decode_kv_tokens,
            max_decode_kv_requests=self.max_decode_kv_requests,
            min_decode_kv_demand=self.min_kv_demand,
            decode_kv_capacity_tokens=self.decode_kv_capacity,
            arrivals=thin(self.arrived),
            arrival_reuse=thin(self.arrived_reuse),
            mean_decode_nodes=self.decode_nodes_sum / self.samples if self.samples else 0.0,
            think_s=self.think_sum / self.think_n if self.think_n else 0.0,
            think_requests=self.think_n,
            response_s=self.response_sum / self.answered_n if self.answered_n else 0.0,
            ttft_s=self.ttft_sum / self.answered_n if self.answered_n else 0.0,
            answered=self.answered_n,
        )
        self.window.append(s)
        while self.window and self.window[0].end <= now - self.window_s:
            self.window.popleft()
        self._reset(now)
        return s
