"""What a phase-split planner sees and decides (pure decisions over state handed in; DESIGN §3).

Every `interval` seconds the driver hands the planner the slices of the recent past (what
arrived and how the nodes fared) and the current split; the planner answers with the split it
wants, or None to keep it. The driver carries the switch out (drain, then flip in place, or a
restart, as the policy's switch mode says) and calls `switch_done()` when it has finished (or
was abandoned): a planner asks for no new split while its last one is in flight, as Dynamo's
planner does ("no new action until the previous completes", notes/dynamo-kv-router.md §6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from evolving_infra.planner.reuse import Reuse
from evolving_infra.timing.model import IterationModel

T = TypeVar("T")
SwitchMode = Literal["in-place-keep", "in-place-drop", "restart"]


@dataclass(frozen=True, slots=True)
class Split:
    prefill: int
    decode: int

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True, slots=True)
class SliceStats:
    """One slice of time: demand that arrived and what the cluster looked like."""

    start: float
    end: float
    requests: int  # requests that arrived
    prompt_tokens: int  # their prompt tokens
    uncached_tokens: int  # prompt tokens not served from cache (prefill work)
    cached_tokens: int
    output_tokens: int  # tokens decoded in the slice (decode work)
    mean_decode_batch: float  # average running decode batch per decode node
    mean_context_tokens: float  # average context per decoding request
    prefill_queue_s: float  # mean predicted prefill queue drain time over prefill nodes
    kv_utilization: float  # mean L1 use of decode nodes, 0..1
    mean_input_tokens: float  # average prompt length (Dynamo's coarse signal)
    # Prefills that ran in the slice (whenever their requests arrived): what the prefill nodes
    # actually computed. The arrivals' split above is estimated when a request is placed and
    # assumes its cached blocks survive until it runs; under load they often do not.
    prefills: int = 0
    prefilled_prompt_tokens: int = 0
    prefilled_uncached_tokens: int = 0
    # Per-engine peaks at the slice's last sample, for planners that decide on the busiest
    # engine (Dynamo's "any engine above, all engines below" thresholds): the most uncached
    # prompt tokens waiting in one prefill node's queue, and the highest decode KV demand
    # (running batch plus preempted requests, over L1; above 1 when those do not fit).
    max_queued_prefill_tokens: int = 0
    max_decode_kv_demand: float = 0.0
    # Per-engine figures at the slice's last sample, for planners that estimate each engine's
    # latency (Dynamo's SLA loop: scale up only when every engine is over its SLA, guard a
    # scale-down on the busiest one; Arrow: can any prefill engine still meet the TTFT SLO).
    # The least and the most loaded prefill node's predicted queue drain, seconds: the work it
    # has to do, queued and running, not its bootstrap queue's (`Node.prefill_demand_s`).
    min_prefill_queue_s: float = 0.0
    max_prefill_queue_s: float = 0.0
    # The decode node with the fewest KV tokens (scheduled plus queued, "queued" being requests
    # preempted back to the waiting queue) and the one with the most: each one's KV tokens and
    # its requests (scheduled plus queued), the inputs of its ITL (equal tokens: the fewer, or
    # the more, requests; then the first node).
    min_decode_kv_tokens: int = 0
    min_decode_kv_requests: int = 0
    max_decode_kv_tokens: int = 0
    max_decode_kv_requests: int = 0
    # The lowest decode KV demand (as `max_decode_kv_demand`, 0..1): the emptiest decode node.
    min_decode_kv_demand: float = 0.0
    # KV tokens one decode node's cache holds (the largest; 0 when the driver does not know).
    decode_kv_capacity_tokens: int = 0
    # (uncached, cached) tokens of up to `ARRIVAL_SAMPLE` of the slice's arrivals, evenly
    # spaced in arrival order: what a prefill node's iterations will batch. A mean request
    # misprices them: the cold first prompts have many uncached tokens and no cache, the warm
    # turns a few uncached tokens over a long cached prefix, so the mean request's attention
    # (mean uncached x mean cached) is about twice the mean of theirs on Claude Code.
    arrivals: tuple[tuple[int, int], ...] = ()
    # The same arrivals' reusable prefixes by age (`reuse.Reuse`, one per arrival; empty when
    # the driver tracks none): how a split with another cache would have served them.
    arrival_reuse: tuple[Reuse, ...] = ()
    # Decode nodes up, averaged over the slice's samples (0: no samples): the cache that
    # `arrival_reuse`'s cached tokens were found in.
    mean_decode_nodes: float = 0.0
    # The mean time between a branch's response and its next request (an agent's tool call or
    # thought: the part of its turn no split serves), over the slice's arrivals whose branch
    # had an answered request before (`think_requests` of them; 0: none, or not tracked). The
    # closed loop's population: a split that answers faster brings its agents back sooner by
    # as much as the answer is of their cycle, think time and answer together.
    think_s: float = 0.0
    think_requests: int = 0
    # The mean time from arrival to the last token of the requests answered in the slice
    # (`answered` of them; 0: none, or not tracked): the other part of an agent's cycle.
    response_s: float = 0.0
    ttft_s: float = 0.0  # the same requests' mean time from arrival to their first token
    answered: int = 0


ARRIVAL_SAMPLE = 64


def thin(items: Sequence[T], k: int = ARRIVAL_SAMPLE) -> tuple[T, ...]:
    """At most `k` of `items`, evenly spaced (all of them when there are no more; the same
    positions for any two sequences of one length)."""
    n = len(items)
    if n <= k:
        return tuple(items)
    return tuple(items[i * n // k] for i in range(k))


class Planner(Protocol):
    name: str
    interval: float  # seconds between decisions
    switch_mode: SwitchMode
    # Whether `decide` reads `SliceStats.arrival_reuse`: the driver tracks each arrival's
    # reusable prefix (`reuse.ReuseTracker`, a dict update per arrival) only for one that does.
    reads_reuse: bool

    def decide(
        self,
        now: float,
        split: Split,
        window: Sequence[SliceStats],
        model: IterationModel,
    ) -> Split | None: ...

    def switch_done(self) -> None:
        """The switch the last decision asked for has finished (or was abandoned)."""
        ...

    def decision(self, now: float, asked: Split | None) -> dict[str, Any] | None:
        """Why the decision at `now` kept the split or asked for `asked`, as a flat JSON-ready
        record for logs and results (the evolving planner's: Θ per candidate and its test);
        None from a planner that prices no candidates, or made no decision then."""
        ...
