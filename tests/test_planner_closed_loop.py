"""The evolving planner's move must also gain in what a closed loop of agents would send
(`throughput.closed_loop_rate`, rule 3), not in capacity alone, where the cluster is mostly
idle."""

from __future__ import annotations

import dataclasses
import random

import pytest

from evolving_infra.planner import EvolvingPlanner, SliceStats, Split
from evolving_infra.planner.common import (
    MeanRequest,
    kv_capacity_tokens,
    merge,
    prefill_rate,
    prefill_seconds,
)
from evolving_infra.planner.slices import Slices
from evolving_infra.planner.throughput import (
    Loop,
    SliceDemand,
    answer,
    closed_loop_rate,
    split_rate,
)
from evolving_infra.timing import DEFAULT_DEPLOYMENT
from evolving_infra.timing.model import IterationModel

MODEL = IterationModel(prior=DEFAULT_DEPLOYMENT)
KV = kv_capacity_tokens(DEFAULT_DEPLOYMENT)
NOW = 600.0


def demand(uncached: float, cached: float, output: float) -> SliceDemand:
    m = MeanRequest(uncached, cached, output, uncached + cached + output / 2)
    return SliceDemand(
        mean=m,
        mu_p=prefill_rate(MODEL, uncached, cached, 8192),
        prefill_s=prefill_seconds(MODEL, uncached, cached, 8192),
        transfer_s=0.05,
        early=True,
    )


AGENTIC = demand(2_000, 28_000, 300)


def test_closed_loop_rate_solves_littles_law_below_capacity() -> None:
    capacity = split_rate(MODEL, AGENTIC, 4, 4, KV, 256)
    loop = Loop(agents=40.0, think_s=30.0)
    rate = closed_loop_rate(MODEL, AGENTIC, 4, 4, capacity, loop, 256)
    assert 0 < rate < capacity
    a = answer(MODEL, AGENTIC, rate, 4, 4, 256)
    assert a is not None
    assert rate * (loop.think_s + a.total()) == pytest.approx(loop.agents, rel=1e-4)
    # An answer observed twice as long as the model's: the same agents come back less often.
    slower = closed_loop_rate(
        MODEL, AGENTIC, 4, 4, capacity, dataclasses.replace(loop, scale=2.0), 256
    )
    assert slower < rate


def test_closed_loop_rate_is_the_capacity_when_agents_ask_for_more() -> None:
    capacity = split_rate(MODEL, AGENTIC, 4, 4, KV, 256)
    many = Loop(agents=1e6, think_s=1.0)
    assert closed_loop_rate(MODEL, AGENTIC, 4, 4, capacity, many, 256) == capacity
    assert closed_loop_rate(MODEL, AGENTIC, 4, 4, capacity, Loop(0.0, 1.0), 256) == capacity


def test_long_thinking_agents_see_splits_alike_that_differ_in_capacity() -> None:
    """Agents that think a minute between answers of a second or two: splits whose capacities
    differ by a third serve them within a few percent, since each only answers faster."""
    caps = {x: split_rate(MODEL, AGENTIC, x, 8 - x, KV, 256) for x in (2, 4)}
    assert caps[2] / caps[4] > 1.3
    loop = Loop(agents=0.2 * caps[4] * 60.0, think_s=60.0)
    rates = {x: closed_loop_rate(MODEL, AGENTIC, x, 8 - x, caps[x], loop, 256) for x in (2, 4)}
    assert abs(rates[2] / rates[4] - 1) < 0.02


def test_answer_waits_longer_for_prefill_times_that_vary() -> None:
    plain = answer(MODEL, AGENTIC, 0.5 * AGENTIC.mu_p, 1, 7, 256)
    mixed = answer(
        MODEL, dataclasses.replace(AGENTIC, service_scv=3.0), 0.5 * AGENTIC.mu_p, 1, 7, 256
    )
    assert plain is not None
    assert mixed is not None
    assert mixed.wait_s == pytest.approx(4.0 * plain.wait_s)
    assert answer(MODEL, AGENTIC, AGENTIC.mu_p, 1, 7, 256) is None  # the queue grows without end


# -- the planner ---------------------------------------------------------------------------------


def looped(k: int, rng: random.Random, *, n: int, think_s: float, response_s: float) -> SliceStats:
    """A one-minute slice of `n` agentic arrivals (long cached prefix, short turn) whose agents
    thought `think_s` and were answered in `response_s`."""
    u, c, o = (round(x * rng.uniform(0.9, 1.1)) for x in (2_000, 28_000, 300))
    return SliceStats(
        start=60.0 * k,
        end=60.0 * (k + 1),
        requests=n,
        prompt_tokens=n * (u + c),
        uncached_tokens=n * u,
        cached_tokens=n * c,
        output_tokens=n * o,
        mean_decode_batch=4.0,
        mean_context_tokens=u + c + o / 2,
        prefill_queue_s=0.0,
        kv_utilization=0.3,
        mean_input_tokens=u + c,
        arrivals=tuple((u, c) for _ in range(min(n, 64))),
        think_s=think_s,
        think_requests=n,
        response_s=response_s,
        ttft_s=0.5,
        answered=n,
    )


def test_planner_keeps_a_split_that_serves_what_its_agents_ask() -> None:
    """An agentic mix at a tenth of the cluster's capacity: by capacity 1P7D is worth moving
    away from, but its agents spend a minute thinking for each two-second answer, so what they
    would send any split is the same within a few percent, and the planner keeps it."""
    rng = random.Random(0)
    w = [looped(k, rng, n=30, think_s=60.0, response_s=2.0) for k in range(10)]
    by_capacity = EvolvingPlanner(8, headroom=None)
    assert by_capacity.decide(NOW, Split(1, 7), w, MODEL) is not None
    assert by_capacity.last is not None
    assert by_capacity.last.mean_gain > 0.2
    assert by_capacity.last.loop_gain == by_capacity.last.mean_gain
    closed = EvolvingPlanner(8)
    assert closed.decide(NOW, Split(1, 7), w, MODEL) is None
    assert closed.last is not None
    assert closed.last.target == by_capacity.last.target  # the target is still by capacity
    assert closed.last.mean_gain == by_capacity.last.mean_gain
    assert closed.last.loop_gain < closed.min_gain
    assert "loop_gain" in closed.last.record(None)


def test_planner_tests_capacity_where_the_split_lacks_headroom() -> None:
    """Agents at two thirds of 1P7D's capacity: it has not the headroom for rule 3's closed
    loop (three times their rate), which a busier hour may need, and the planner moves as by
    capacity."""
    rng = random.Random(0)
    w = [looped(k, rng, n=180, think_s=10.0, response_s=20.0) for k in range(10)]
    closed = EvolvingPlanner(8)
    target = closed.decide(NOW, Split(1, 7), w, MODEL)
    assert target is not None
    assert target.prefill > 1
    assert closed.last is not None
    assert closed.last.loop_gain == closed.last.mean_gain
    # With a 1.01x headroom the same slices are priced as a closed loop wherever they fit.
    loose = EvolvingPlanner(8, headroom=1.01).evaluate(NOW, Split(1, 7), w, MODEL)
    assert loose is not None
    assert loose.loop_gain != loose.mean_gain
    with pytest.raises(ValueError, match="headroom"):
        EvolvingPlanner(8, headroom=0.5)


def test_planner_reads_the_idle_regime_over_the_window_not_per_slice() -> None:
    """Three busier slices among seven calm ones, each busier one at more than a third of
    1P7D's capacity on its own, the window at a fifth of it: every slice is priced by its
    agents (rule 3), so the busier slices' capacity gains do not carry the window, and the
    planner keeps 1P7D. Priced one slice at a time they moved it (the loop gain was theirs)."""
    rng = random.Random(0)
    w = [
        looped(k, rng, n=120 if k in (3, 6, 8) else 30, think_s=60.0, response_s=2.0)
        for k in range(10)
    ]
    capacity = EvolvingPlanner(8, headroom=None).evaluate(NOW, Split(1, 7), w, MODEL)
    assert capacity is not None
    assert capacity.mean_gain > 0.2
    planner = EvolvingPlanner(8)
    assert planner.decide(NOW, Split(1, 7), w, MODEL) is None
    assert planner.last is not None
    assert planner.last.loop_gain < planner.min_gain


def test_planner_prices_capacity_without_think_times() -> None:
    """Slices that know no think time (a driver that does not track it) are tested by
    capacity alone."""
    rng = random.Random(0)
    w = [
        dataclasses.replace(looped(k, rng, n=30, think_s=0.0, response_s=2.0), think_requests=0)
        for k in range(10)
    ]
    ev = EvolvingPlanner(8).evaluate(NOW, Split(1, 7), w, MODEL)
    assert ev is not None
    assert ev.loop_gain == ev.mean_gain


# -- what the window counts ------------------------------------------------------------------------


def test_slices_average_think_and_answer_times_over_the_requests_that_have_them() -> None:
    s = Slices(600.0)
    s.arrival(100, 50, 50, now=1.0)  # a branch's first request: no think time
    s.arrival(100, 50, 50, now=2.0, think_s=10.0)
    s.arrival(100, 50, 50, now=3.0, think_s=20.0)
    s.answered(0.5, 2.0)
    s.answered(1.5, 4.0)
    a = s.close(60.0)
    assert (a.requests, a.think_requests, a.think_s) == (3, 2, 15.0)
    assert (a.answered, a.ttft_s, a.response_s) == (2, 1.0, 3.0)
    s.arrival(100, 50, 50, now=61.0, think_s=30.0)
    b = s.close(120.0)
    assert b.answered == 0
    both = merge([a, b])
    assert both.think_requests == 3
    assert both.think_s == pytest.approx(20.0)  # weighed by requests, not by slice
    assert (both.answered, both.response_s) == (2, 3.0)
