"""`arrow`: Arrow's instance flipping (arXiv 2505.11916 §5.3, §5.5, as `planner/arrow.py` reads
them) on hand-built slices, and its prefill signals on a simulated decode-starved run."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from evolving_infra.planner import ArrowPlanner, SliceStats, Split
from evolving_infra.planner.common import prefill_seconds
from evolving_infra.planner.slices import Slices
from evolving_infra.sim.cluster import Cluster
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.planning import sample_nodes
from evolving_infra.sim.policies import static
from evolving_infra.timing import DEFAULT_DEPLOYMENT
from evolving_infra.timing.model import IterationModel
from evolving_infra.workloads.generators import SlotPlan, generate

MODEL = IterationModel(prior=DEFAULT_DEPLOYMENT)
T_OWN = prefill_seconds(MODEL, 2_000, 0, 8192)  # the mean arrival's prefill alone, ~0.14 s
CAPACITY = 400_000  # KV tokens a decode node holds

LIGHT = (8, 2_000.0)  # decode batch and context: step ~17 ms, load ~0.34 (< shrink)
LOADED = (32, 10_000.0)  # step ~26 ms, load ~0.53 (>= shrink, < expand)
OVER = (64, 20_000.0)  # step ~56 ms, load ~1.1 (>= expand)


def arrow(
    k: int = 0,
    *,
    queue: tuple[float, float] = (0.0, 0.0),
    decode: tuple[int, float] = LIGHT,
    least_kv: int = 0,
    requests: int = 10,
) -> SliceStats:
    """One 1 s update interval: `requests` arrivals (and as many prefills) of 2,000 fresh prompt
    tokens; `queue`: the least loaded prefill node's drain and the pool's mean (s); `decode`:
    the mean decode batch and context; `least_kv`: the least loaded decode node's KV tokens."""
    lo, mean = queue
    batch, context = decode
    return SliceStats(
        start=float(k),
        end=float(k + 1),
        requests=requests,
        prompt_tokens=2_000 * requests,
        uncached_tokens=2_000 * requests,
        cached_tokens=0,
        output_tokens=batch,
        mean_decode_batch=batch,
        mean_context_tokens=context,
        prefill_queue_s=mean,
        kv_utilization=0.5,
        mean_input_tokens=2_000.0,
        prefills=requests,
        prefilled_prompt_tokens=2_000 * requests,
        prefilled_uncached_tokens=2_000 * requests,
        min_prefill_queue_s=lo,
        max_prefill_queue_s=mean * 2,
        min_decode_kv_tokens=least_kv,
        decode_kv_capacity_tokens=CAPACITY,
    )


SLO = 5.0  # the TTFT SLO
SHORT = (4.9, 6.0)  # the least loaded prefill node: 4.9 s + its own prefill > 5 s
UNEVEN = (4.8, 9.0)  # the mean is far over, but one prefill node still meets the TTFT SLO


def ask(p: ArrowPlanner, t: float, split: Split, s: SliceStats) -> Split | None:
    """`p`'s decision at `t` on the interval `s`; what it asked for is not carried out."""
    s = dataclasses.replace(s, start=t - 1.0, end=t)
    out = p.decide(t, split, [s], MODEL)
    p.switch_done()
    return out


def test_arrow_defaults() -> None:
    p = ArrowPlanner()
    assert (p.name, p.switch_mode, p.interval) == ("arrow", "in-place-drop", 1.0)
    assert (p.ttft_slo, p.tpot_slo, p.expand, p.shrink) == (SLO, 0.05, 1.0, 0.5)
    assert (p.cooldown, p.sustain, p.min_nodes) == (10.0, 3, 1)
    assert p.decode_load(arrow(decode=LIGHT), MODEL) < p.shrink
    assert p.shrink <= p.decode_load(arrow(decode=LOADED), MODEL) < p.expand
    assert p.decode_load(arrow(decode=OVER), MODEL) >= p.expand
    with pytest.raises(ValueError, match="shrink < expand"):
        ArrowPlanner(shrink=1.0)


def test_arrow_flips_to_prefill_when_no_prefill_instance_meets_the_ttft_slo() -> None:
    """Algorithm 1: a decode instance joins prefill at once (no sustained trigger, no cooldown)
    when the least loaded prefill instance cannot meet the TTFT SLO for the mean arrival."""
    assert SHORT[0] + T_OWN > SLO > UNEVEN[0] + T_OWN
    assert ask(ArrowPlanner(), 1.0, Split(4, 4), arrow(queue=SHORT)) == Split(5, 3)
    # The mean prefill queue is 9 s, but one instance still meets the SLO: it takes the request.
    assert ask(ArrowPlanner(), 1.0, Split(4, 4), arrow(queue=UNEVEN)) is None
    # Without arrivals there is no request to place.
    assert ask(ArrowPlanner(), 1.0, Split(4, 4), arrow(queue=SHORT, requests=0)) is None


def test_arrow_keeps_decode_instances_while_decode_is_loaded() -> None:
    """The D->P flip aborts while decode load is high, "to avoid scenarios where a large number
    of requests occupy memory resources without progressing beyond the prefill phase"."""
    assert ask(ArrowPlanner(), 1.0, Split(4, 4), arrow(queue=SHORT, decode=LOADED)) is None


def test_arrow_needs_decode_load_held_over_a_period_of_time() -> None:
    """Algorithm 2: prefill idle while decode is loaded, held `sustain` intervals, moves one
    prefill instance to decode; an interval without the trigger starts the count again."""
    p = ArrowPlanner()
    idle = arrow(decode=LOADED)  # prefill load 0 <= shrink <= decode load
    assert [ask(p, t, Split(4, 4), idle) for t in (1.0, 2.0)] == [None, None]
    assert ask(p, 3.0, Split(4, 4), arrow()) is None  # decode light: the count restarts
    assert [ask(p, t, Split(4, 4), idle) for t in (4.0, 5.0, 6.0)] == [None, None, Split(3, 5)]
    assert p.last_by == "algorithm2"


def test_arrow_moves_prefill_to_decode_on_decode_load_alone() -> None:
    """Algorithm 2's first trigger reads decode load only: decode over `expand` takes a prefill
    instance even while prefill is loaded too. A fixed-total pressure rule (`both short: no
    donor`) would hold; Arrow does not."""
    p = ArrowPlanner()
    both = arrow(queue=(4.0, 6.0), decode=OVER)  # prefill load 1.2, decode load ~1.1
    assert [ask(p, t, Split(4, 4), both) for t in (1.0, 2.0, 3.0)] == [None, None, Split(3, 5)]


def test_arrow_cooldown_holds_prefill_to_decode_only() -> None:
    """The cooldown applies to P->D, "to prevent oscillation in instance assignment"; D->P never
    waits: TTFT "requires rapid instance scheduling"."""
    p = ArrowPlanner()
    full = arrow(least_kv=CAPACITY * 2)  # no decode instance holds a 2,000-token request
    assert ask(p, 1.0, Split(4, 4), full) == Split(3, 5)  # Algorithm 1, decode side: at once
    assert p.last_by == "algorithm1"
    assert ask(p, 5.0, Split(3, 5), full) is None  # within 10 s of the last P->D
    assert ask(p, 5.0, Split(3, 5), arrow(queue=SHORT)) == Split(4, 4)  # D->P: not gated
    assert ask(p, 11.0, Split(4, 4), full) == Split(3, 5)


def test_arrow_flips_to_decode_when_no_decode_instance_holds_the_request() -> None:
    """Algorithm 1's decode side: the least loaded decode instance's tokens plus the request's
    exceed MT (the TPOT-bound tokens), or the emptiest decode node's cache has no room for the
    request's whole KV. One instance with room is enough to hold it."""
    p = ArrowPlanner()
    mt = p.max_tokens(MODEL, 2_000.0)
    assert MODEL.predict_decode(int(mt // 2_000), round(mt)) <= 0.05  # 256 x 2,000 tokens
    assert ask(p, 1.0, Split(4, 4), arrow(least_kv=round(mt) - 1_000)) == Split(3, 5)
    assert ask(ArrowPlanner(), 1.0, Split(4, 4), arrow(least_kv=round(mt) - 3_000)) is None
    # The cache: the emptiest node has 1,000 tokens free, the request needs its prompt (2,000)
    # and its output (the window's tokens decoded per arrival).
    full = dataclasses.replace(arrow(), min_decode_kv_demand=1 - 1_000 / CAPACITY)
    assert ask(ArrowPlanner(), 1.0, Split(4, 4), full) == Split(3, 5)
    room = dataclasses.replace(full, min_decode_kv_demand=1 - 3_000 / CAPACITY, output_tokens=0)
    assert ask(ArrowPlanner(), 1.0, Split(4, 4), room) is None
    assert ask(
        ArrowPlanner(), 1.0, Split(4, 4), dataclasses.replace(room, output_tokens=20_000)
    ) == (Split(3, 5))
    # Both sides of Algorithm 1 fire: the ungated D->P goes.
    both = dataclasses.replace(arrow(queue=SHORT), min_decode_kv_demand=1.0)
    assert ask(ArrowPlanner(), 1.0, Split(4, 4), both) == Split(5, 3)


def test_arrow_moves_one_instance_and_never_empties_a_pool() -> None:
    p = ArrowPlanner()
    assert ask(p, 1.0, Split(7, 1), arrow(queue=SHORT)) is None  # |S| > 1
    assert ask(p, 1.0, Split(1, 7), arrow(least_kv=CAPACITY * 2)) is None
    assert ask(p, 1.0, Split(6, 2), arrow(queue=SHORT)) == Split(7, 1)
    # No new decision while a switch is in flight.
    q = ArrowPlanner()
    assert q.decide(1.0, Split(4, 4), [arrow(queue=SHORT)], MODEL) == Split(5, 3)
    assert q.decide(2.0, Split(4, 4), [arrow(1, queue=SHORT)], MODEL) is None
    assert q.decide(2.0, Split(4, 4), [], MODEL) is None


def test_arrow_reads_no_bootstrap_queue_as_prefill_demand() -> None:
    """Three prefill nodes and one decode node under 40 agents (early allocation): prefill
    nodes hold requests in their bootstrap queue, waiting for decode KV. Arrow's prefill load
    and its per-instance TTFT check read each node's own work (`prefill_demand_s`), never
    routing's view of its queue (`queued_s`, which counts them)."""
    trace = generate("cc", SlotPlan(agents=40, duration=600, seed=4))
    config = SimConfig(gpus=16, duration=300, seed=1, decode_allocation="early")
    cluster = Cluster(trace, config, dataclasses.replace(static(Split(3, 1)), admission=False))
    p = ArrowPlanner()
    seen = {"samples": 0, "held": 0}  # events, and samples at which held work was left out

    def check() -> None:
        seen["samples"] += 1
        if seen["samples"] % 50:
            return
        slices = Slices(60.0)
        sample_nodes(slices, cluster.nodes)
        s = slices.close(cluster.now)
        prefill = [n for n in cluster.nodes if n.phase == "prefill" and n.state != "down"]
        demand = [n.prefill_demand_s() for n in prefill]
        assert s.min_prefill_queue_s == min(demand)
        assert s.max_prefill_queue_s == max(demand)
        assert p.prefill_load(s) == pytest.approx(statistics.fmean(demand) / p.ttft_slo)
        if sum(n.queued_s for n in prefill) > sum(demand) + 1e-6:
            seen["held"] += 1  # routing sees more queued work here than any planner may

    cluster.run(check=check)
    assert seen["held"] > 0
