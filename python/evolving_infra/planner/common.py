"""What the planners share: slice arithmetic, per-node service rates, the in-flight gate.

Service rates come from the fitted `IterationModel` (what the policies believe an iteration
costs; DESIGN §3, "Phase split"), never from the simulator's ground truth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from evolving_infra.planner.base import SliceStats, Split, thin
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.specs import Deployment

# SGLang's default `chunked_prefill_size`: the token budget of one prefill iteration.
CHUNK_TOKENS = 8192
# Assumptions for a decode node's batch when nothing better is known: SGLang reserves ~10% of
# HBM beyond weights and KV (`mem_fraction_static` ~0.9), a few GiB per GPU go to activations
# and CUDA graphs, and the running batch is capped (`max_running_requests`).
MAX_DECODE_BATCH = 256


class PlannerGate:
    """The in-flight gate: after asking for a split, a planner waits for `switch_done()`.

    Without it a planner re-asks for the same target every tick while the driver drains
    nodes (the split it is handed is still the old one), and a ±1 planner would step twice.
    """

    reads_reuse = False  # `Planner.reads_reuse`

    def __init__(self) -> None:
        self.in_flight = False

    def switch_done(self) -> None:
        self.in_flight = False

    def decision(self, now: float, asked: Split | None) -> dict[str, Any] | None:
        """`Planner.decision`: a planner that prices no candidates has none to give."""
        return None

    def _propose(self, split: Split, target: Split | None) -> Split | None:
        if target is None or target == split:
            return None
        self.in_flight = True
        return target


@dataclass(frozen=True, slots=True)
class MeanRequest:
    """A slice's average request: what the planners size service rates by."""

    uncached: float  # prompt tokens computed per request
    cached: float  # prompt tokens served from cache per request
    output: float  # decoded tokens per request (>= 1)
    context: float  # mean context of a decoding request, tokens

    @classmethod
    def of(cls, s: SliceStats) -> MeanRequest | None:
        """None for a slice without arrivals: it says nothing about the mix."""
        if s.requests <= 0:
            return None
        r = s.requests
        uncached, cached = s.uncached_tokens / r, s.cached_tokens / r
        # NOTE: output tokens are those decoded in the slice, not those of its arrivals; in a
        # slice long against a request's life the two ratios agree.
        output = max(s.output_tokens / r, 1.0)
        context = s.mean_context_tokens
        if context <= 0:
            context = uncached + cached + output / 2  # midway through an average decode
        return cls(max(uncached, 1.0), cached, output, context)


def merge(slices: Sequence[SliceStats]) -> SliceStats:
    """One slice covering `slices`: counts add, averages weigh by duration (context by
    duration x batch, as it is a mean over decoding requests)."""
    if not slices:
        raise ValueError("merge needs at least one slice")
    dur = [max(s.end - s.start, 1e-9) for s in slices]

    def avg(values: Sequence[float], weights: Sequence[float]) -> float:
        w = sum(weights)
        return sum(v * x for v, x in zip(values, weights, strict=True)) / w if w > 0 else 0.0

    batch_w = [d * s.mean_decode_batch for d, s in zip(dur, slices, strict=True)]
    # The peaks and per-engine figures are instantaneous (the last sample's): the latest's.
    last = max(slices, key=lambda s: s.end)
    requests = sum(s.requests for s in slices)
    prompt = sum(s.prompt_tokens for s in slices)
    ordered = sorted(slices, key=lambda s: s.start)
    # Reuse records only when every slice has one per arrival (thinned at the same positions).
    tracked = all(len(s.arrival_reuse) == len(s.arrivals) for s in slices)
    return SliceStats(
        start=min(s.start for s in slices),
        end=max(s.end for s in slices),
        requests=requests,
        prompt_tokens=prompt,
        uncached_tokens=sum(s.uncached_tokens for s in slices),
        cached_tokens=sum(s.cached_tokens for s in slices),
        output_tokens=sum(s.output_tokens for s in slices),
        mean_decode_batch=avg([s.mean_decode_batch for s in slices], dur),
        mean_context_tokens=avg(
            [s.mean_context_tokens for s in slices], batch_w if sum(batch_w) > 0 else dur
        ),
        prefill_queue_s=avg([s.prefill_queue_s for s in slices], dur),
        kv_utilization=avg([s.kv_utilization for s in slices], dur),
        mean_input_tokens=(
            prompt / requests if requests else avg([s.mean_input_tokens for s in slices], dur)
        ),
        prefills=sum(s.prefills for s in slices),
        prefilled_prompt_tokens=sum(s.prefilled_prompt_tokens for s in slices),
        prefilled_uncached_tokens=sum(s.prefilled_uncached_tokens for s in slices),
        max_queued_prefill_tokens=last.max_queued_prefill_tokens,
        max_decode_kv_demand=last.max_decode_kv_demand,
        min_prefill_queue_s=last.min_prefill_queue_s,
        max_prefill_queue_s=last.max_prefill_queue_s,
        min_decode_kv_tokens=last.min_decode_kv_tokens,
        min_decode_kv_requests=last.min_decode_kv_requests,
        max_decode_kv_tokens=last.max_decode_kv_tokens,
        max_decode_kv_requests=last.max_decode_kv_requests,
        min_decode_kv_demand=last.min_decode_kv_demand,
        decode_kv_capacity_tokens=last.decode_kv_capacity_tokens,
        arrivals=thin([a for s in ordered for a in s.arrivals]),
        arrival_reuse=thin([r for s in ordered for r in s.arrival_reuse]) if tracked else (),
        mean_decode_nodes=avg([s.mean_decode_nodes for s in slices], dur),
        think_s=avg([s.think_s for s in slices], [s.think_requests for s in slices]),
        think_requests=sum(s.think_requests for s in slices),
        response_s=avg([s.response_s for s in slices], [s.answered for s in slices]),
        ttft_s=avg([s.ttft_s for s in slices], [s.answered for s in slices]),
        answered=sum(s.answered for s in slices),
    )


def rebin(window: Sequence[SliceStats], now: float, span: float, bins: int) -> list[SliceStats]:
    """`window` regrouped into `bins` equal slices covering (now - span, now], by each slice's
    midpoint; bins nothing fell into are left out. The driver may hand slices of any length;
    the planner's statistics are over its own slices."""
    width = span / bins
    groups: list[list[SliceStats]] = [[] for _ in range(bins)]
    for s in window:
        k = math.floor(((s.start + s.end) / 2 - (now - span)) / width)
        if 0 <= k < bins:
            groups[k].append(s)
        elif k == bins:  # a midpoint exactly at `now`
            groups[-1].append(s)
    return [merge(g) for g in groups if g]


def recent(window: Sequence[SliceStats], now: float, span: float) -> SliceStats | None:
    """The slices ending within `span` of `now` merged (else the latest slice; None if none)."""
    if not window:
        return None
    fresh = [s for s in window if s.end > now - span]
    return merge(fresh) if fresh else max(window, key=lambda s: s.end)


def prefill_seconds(model: IterationModel, uncached: float, cached: float, chunk: int) -> float:
    """One request's prefill alone on a node: its uncached tokens in chunks of `chunk`, each
    chunk's cached part the prefix plus the chunks before it (SGLang chunked prefill)."""
    u, c, t = max(uncached, 1.0), max(cached, 0.0), 0.0
    while u > 0:
        step = min(u, float(chunk))
        t += model.predict_prefill_one(step, c)
        u, c = u - step, c + step
    return t


def prefill_rate(model: IterationModel, uncached: float, cached: float, chunk: int) -> float:
    """Requests/s one prefill node serves of this request: iterations batch as many whole
    requests as fit the chunk budget; a longer request takes several chunked iterations."""
    u, c = max(round(uncached), 1), max(round(cached), 0)
    if u > chunk:
        return 1.0 / prefill_seconds(model, u, c, chunk)
    k = chunk // u
    return k / model.predict_prefill([(u, c)] * k)


def packed_prefill_rate(
    model: IterationModel, arrivals: Sequence[tuple[float, float]], chunk: int
) -> float:
    """Requests/s one prefill node serves of `arrivals` ((uncached, cached) each), batched as
    SGLang's chunked prefill does: each iteration takes `chunk` tokens in arrival order, a
    request longer than what is left of the budget continuing in the next iteration over its
    own first chunks. Iterations are priced by the model's prefill features summed over their
    requests (it is linear in them), so the requests' own spread of uncached and cached tokens
    counts, not their mean's."""
    seconds, budget = 0.0, float(chunk)
    tokens, pairs, cached = 0.0, 0.0, 0.0
    for u0, c0 in arrivals:
        u, c = max(float(u0), 1.0), max(float(c0), 0.0)
        while u > 0:
            step = min(u, budget)
            tokens += step
            pairs += step * c + step * (step + 1) * 0.5
            cached += c
            u, c, budget = u - step, c + step, budget - step
            if budget <= 0:
                seconds += model.predict_prefill_totals(tokens, pairs, cached)
                tokens, pairs, cached, budget = 0.0, 0.0, 0.0, float(chunk)
    if tokens > 0:
        seconds += model.predict_prefill_totals(tokens, pairs, cached)
    return len(arrivals) / seconds if seconds > 0 else 0.0


def kv_capacity_tokens(deployment: Deployment) -> int:
    """KV tokens one node holds (docs/simulator.md, "Nodes and KV"): tp x HBM x 0.9 minus the
    weights and an activation reserve, over the node's KV bytes per token (MLA keeps its
    latent on every GPU)."""
    return max(int(deployment.kv_bytes() // deployment.kv_bytes_per_token), 1)
