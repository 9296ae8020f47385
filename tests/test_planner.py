"""Phase-split planners on hand-built slices, with the prior-only default-deployment model."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from evolving_infra.planner import (
    PLANNERS,
    DynamoPlanner,
    EvolvingPlanner,
    Planner,
    SliceStats,
    Split,
    StaticPlanner,
    make_planner,
)
from evolving_infra.planner.common import (
    MeanRequest,
    kv_capacity_tokens,
    merge,
    prefill_rate,
    prefill_seconds,
)
from evolving_infra.planner.dynamo import (
    DECODE_DOWN,
    DECODE_UP,
    PREFILL_DOWN,
    PREFILL_UP,
    may_shrink,
)
from evolving_infra.planner.hits import SplitMemory
from evolving_infra.planner.throughput import SliceDemand, split_rate
from evolving_infra.timing import DEFAULT_DEPLOYMENT
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.ttft import DEFAULT_POOL_BANDWIDTH

NOW = 600.0
MODEL = IterationModel(prior=DEFAULT_DEPLOYMENT)


def sl(
    k: int,
    uncached: int,
    cached: int,
    output: float,
    *,
    n: int = 100,
    width: float = 60.0,
    batch: float = 16.0,
    context: float | None = None,
    queue_s: float = 0.0,
    kv: float = 0.5,
) -> SliceStats:
    """Slice k of `width` seconds in which `n` requests of this mean shape arrived."""
    ctx = uncached + cached + output / 2 if context is None else context
    return SliceStats(
        start=k * width,
        end=(k + 1) * width,
        requests=n,
        prompt_tokens=n * (uncached + cached),
        uncached_tokens=n * uncached,
        cached_tokens=n * cached,
        output_tokens=round(n * output),
        mean_decode_batch=batch,
        mean_context_tokens=ctx,
        prefill_queue_s=queue_s,
        kv_utilization=kv,
        mean_input_tokens=uncached + cached,
    )


def jitter(rng: random.Random, x: float, by: float = 0.1) -> int:
    return round(x * rng.uniform(1 - by, 1 + by))


def window(shape: tuple[int, int, int], seed: int = 0, n: int = 10) -> list[SliceStats]:
    rng = random.Random(seed)
    u, c, o = shape
    return [sl(k, jitter(rng, u), jitter(rng, c), max(jitter(rng, o), 1)) for k in range(n)]


PREFILL_HEAVY = (16_000, 0, 30)  # long fresh prompts, a few output tokens
DECODE_HEAVY = (400, 0, 2_000)  # short prompts, long answers
AGENTIC = (2_000, 28_000, 300)  # long cached prefix, short turn


# -- evolving -----------------------------------------------------------------------------------


def test_evolving_moves_toward_prefill_when_slices_are_prefill_heavy() -> None:
    p = EvolvingPlanner(8)
    target = p.decide(NOW, Split(4, 4), window(PREFILL_HEAVY), MODEL)
    assert target is not None
    assert target.prefill > 4
    assert p.last is not None
    assert p.last.target == target
    assert p.last.p_value < 0.05
    assert p.last.mean_gain >= 0.02


def test_evolving_moves_toward_decode_when_slices_are_decode_heavy() -> None:
    p = EvolvingPlanner(8)
    target = p.decide(NOW, Split(4, 4), window(DECODE_HEAVY), MODEL)
    assert target is not None
    assert target.decode > 4


def test_evolving_target_balances_the_rates() -> None:
    """The chosen split is the argmax over candidates of the slices' mean sustained rate
    (`throughput.split_rate`), each slice's demand priced here by hand."""
    w = window(AGENTIC, seed=1)
    kv = kv_capacity_tokens(DEFAULT_DEPLOYMENT)
    means = [m for m in map(MeanRequest.of, w) if m is not None]

    def demand(m: MeanRequest) -> SliceDemand:
        prompt = m.uncached + m.cached
        moved = prompt * DEFAULT_DEPLOYMENT.kv_bytes_per_token / (DEFAULT_POOL_BANDWIDTH * 4)
        return SliceDemand(
            mean=m,
            mu_p=prefill_rate(MODEL, m.uncached, m.cached, 8192),
            prefill_s=prefill_seconds(MODEL, m.uncached, m.cached, 8192),
            transfer_s=moved,
            early=True,
        )

    def theta(x: int) -> float:
        return sum(split_rate(MODEL, demand(m), x, 8 - x, kv, 256) for m in means) / len(means)

    best = max(range(1, 8), key=theta)
    ev = EvolvingPlanner(8).evaluate(NOW, Split(4, 4), w, MODEL)
    assert ev is not None
    assert ev.target == Split(best, 8 - best)
    assert ev.mean_theta == pytest.approx(theta(best))


def crossover_output(u: int, c: int) -> float:
    """Output tokens per request at which 4P4D and 5P3D sustain the same rate
    (`throughput.split_rate`, as the planner prices a slice)."""
    kv = kv_capacity_tokens(DEFAULT_DEPLOYMENT)
    planner = EvolvingPlanner(8)
    mu_p = prefill_rate(MODEL, u, c, 8192)
    lo, hi = 1.0, 1e5
    for _ in range(100):
        o = (lo + hi) / 2
        mean = MeanRequest(u, c, o, u + c + o / 2)
        d = dataclasses.replace(planner._demand(MODEL, mean), mu_p=mu_p)
        four, five = (split_rate(MODEL, d, x, 8 - x, kv, 256) for x in (4, 5))
        lo, hi = (o, hi) if four < five else (lo, o)
    return (lo + hi) / 2


def ran(s: SliceStats, uncached_share: float) -> SliceStats:
    """`s` whose arrivals' prefills ran, with `uncached_share` of their prompt computed."""
    return dataclasses.replace(
        s,
        prefills=s.requests,
        prefilled_prompt_tokens=s.prompt_tokens,
        prefilled_uncached_tokens=round(s.prompt_tokens * uncached_share),
    )


def ticks(
    planner: EvolvingPlanner,
    split: Split,
    found: float,
    minutes: int,
    seed: int = 0,
    start: int = 0,
) -> list[Split | None]:
    """`minutes` one-minute decisions at `split` (not carried out) from minute `start`, each
    handed the last ten AGENTIC slices, whose prefills found `found` of the prompt uncached."""
    slices = [ran(s, found) for s in window(AGENTIC, seed, start + minutes)]
    out = []
    for k in range(start, start + minutes):
        planner.in_flight = False  # the decision is not carried out: ask again next minute
        out.append(planner.decide(60.0 * (k + 1), split, slices[max(0, k - 9) : k + 1], MODEL))
    return out


ESTIMATED = 2_000 / 30_000  # AGENTIC's uncached share as placed


def test_evolving_leaves_a_split_whose_prefills_lose_their_cache() -> None:
    """Placements estimate 93% of the prompt cached; at 2P6D the prefills find 20% (the blocks
    were evicted while the requests queued). Trusting the estimate, 2P6D is the best split; once
    2P6D has run a settled window, the planner sizes prefill work by what its prefills computed
    and adds prefill nodes."""
    assert all(d is None for d in ticks(EvolvingPlanner(8), Split(2, 6), ESTIMATED, 14))
    p = EvolvingPlanner(8)
    decisions = ticks(p, Split(2, 6), 0.8, 14)
    settled = round(p.memory.settle_s / 60)
    assert decisions[:settled] == [None] * settled  # the switch's transient is not evidence
    moved = [d for d in decisions if d is not None]
    assert moved
    assert moved[0].prefill > 2
    loss = p.memory.measured(2)
    assert loss is not None
    assert loss == pytest.approx(0.8 / ESTIMATED, rel=0.1)
    # An untried split gets the nearest tried split's loss, not the bare estimate.
    assert p.memory.measured(3) is None
    assert p.memory.loss(3) == loss


def test_evolving_does_not_return_to_a_split_it_found_lossy() -> None:
    """Trusting the estimate, the best split from 3P5D is 2P6D. The planner ran 2P6D, whose
    prefills lost 80% of the estimated cache, then 3P5D, where the estimate held: 2P6D is not
    proposed again."""
    w = window(AGENTIC, seed=5)
    fresh = EvolvingPlanner(8).evaluate(NOW, Split(3, 5), w, MODEL)
    assert fresh is not None
    assert fresh.target == Split(2, 6)
    tried = EvolvingPlanner(8)
    ticks(tried, Split(2, 6), 0.8, 12)
    ticks(tried, Split(3, 5), ESTIMATED, 12, start=12)
    assert tried.memory.measured(2) is not None
    assert tried.memory.measured(3) == pytest.approx(1.0, rel=0.05)
    w = [dataclasses.replace(s, start=s.start + 840, end=s.end + 840) for s in w]
    again = tried.evaluate(NOW + 840, Split(3, 5), w, MODEL)
    assert again is not None
    assert again.target != Split(2, 6)


def test_split_memory_settles_expires_and_ignores_switches() -> None:
    m = SplitMemory(settle_s=120, memory_s=600, min_prefills=10)
    s = [ran(sl(k, 1_000, 9_000, 100), 0.5) for k in range(30)]
    m.note(60, Split(2, 2), s[:1], switching=False)  # a new split: its transient starts
    m.note(120, Split(2, 2), s[:2], switching=False)
    m.note(180, Split(2, 2), s[:3], switching=False)
    assert m.loss(2) is None  # slices 1 and 2 began within 120 s of the split
    m.note(240, Split(2, 2), s[:4], switching=False)
    assert m.measured(2) == pytest.approx(5.0)  # 0.5 computed where 0.1 was estimated
    assert m.measured(3) is None
    assert m.loss(3) == pytest.approx(5.0)  # untried: the nearest tried split's
    assert m.losses([1, 2, 3]) == [m.loss(1), m.loss(2), m.loss(3)]
    m.note(300, Split(2, 2), s[:5], switching=True)  # a switch in flight: nothing counts
    m.note(360, Split(3, 1), s[:6], switching=False)
    m.note(420, Split(3, 1), s[:7], switching=False)
    assert m.tried() == {2: pytest.approx(5.0)}
    m.note(240 + 600, Split(3, 1), s[:14], switching=False)  # slice 3 (ends at 240) expired
    assert m.measured(2) is None
    assert set(m.tried()) == {3}
    with pytest.raises(ValueError, match="min_prefills"):
        SplitMemory(min_prefills=0)


def settled(m: SplitMemory, split: Split, share: float, minutes: int, start: int = 0) -> None:
    """`minutes` one-minute decisions at `split` from minute `start`, each slice's prefills
    finding `share` of the prompt uncached where placements estimated 0.1."""
    s = [ran(sl(k, 1_000, 9_000, 100), share) for k in range(start + minutes)]
    for k in range(start, start + minutes):
        m.note(60.0 * (k + 1), split, s[max(0, k - 9) : k + 1], switching=False)


def test_split_memory_interpolates_untried_splits_between_tried_ones() -> None:
    """Losses grow with the prefill nodes in cc-high (4.1 at 3P6D, 7.2 at 4P5D, 16.3 at 5P4D):
    an untried split between two tried ones gets the line between their losses, one beyond
    them the nearest one's, not the best tried one's (which made every untried neighbour of a
    good split look better than it)."""
    m = SplitMemory(settle_s=120, memory_s=3600, min_prefills=10)
    settled(m, Split(2, 6), 0.2, 5)  # loss 2
    settled(m, Split(6, 2), 0.6, 5, start=5)  # loss 6
    assert m.tried() == {2: pytest.approx(2.0), 6: pytest.approx(6.0)}
    assert m.losses([1, 2, 3, 4, 5, 6, 7]) == pytest.approx([2, 2, 3, 4, 5, 6, 6])
    assert m.loss(4) == pytest.approx(4.0)


def test_split_memory_keeps_the_running_splits_figure_until_newer_slices_replace_it() -> None:
    """Evidence expires after `memory_s`, except the running split's: its old figure stays
    until its own newer slices reach `min_prefills`, so a split the planner came back to is not
    forgotten while it settles again (in cc-high, forgetting 3P6D that way sent the planner to
    an untried split)."""
    m = SplitMemory(settle_s=120, memory_s=600, min_prefills=10)
    settled(m, Split(3, 3), 0.4, 4)  # settled slices end at minutes 3 and 4: loss 4
    settled(m, Split(2, 4), 0.2, 8, start=4)  # minutes 5-12; settled from minute 8: loss 2
    m.note(60.0 * 13, Split(3, 3), [], switching=True)  # back to 3P3D
    settled(m, Split(3, 3), 0.8, 2, start=13)  # minutes 14-15: its transient, no evidence yet
    # Minute 4's slice ended 660 s before minute 15, past memory_s: 3P3D runs, so it stays.
    assert m.measured(3) == pytest.approx(4.0)
    assert m.measured(2) == pytest.approx(2.0)  # not expired yet either (ended at minute 12)
    settled(m, Split(3, 3), 0.8, 10, start=15)  # settled from minute 18: the mix changed
    assert m.measured(3) == pytest.approx(8.0)  # the old figure gave way to the new slices
    assert m.measured(2) is None  # 2P4D is not running: its slices expired


def test_evolving_does_not_flip_on_one_bursty_slice() -> None:
    """Nine calm slices on which 4P4D and 5P3D tie (gains ±2%) and one burst of long fresh
    prompts on which 5P3D gains 25%: the best mean is 5P3D and the mean gain clears min_gain,
    but one slice is no evidence. The t-test alone holds the split."""
    u, c = 2_000, 8_000
    o = crossover_output(u, c)
    # 1000 requests a slice: the output per request is exact to 1e-3 tokens.
    calm = [sl(k, u, c, o * (1 - 0.02 * (-1) ** k), n=1000) for k in range(9)]
    burst = sl(9, 16_000, 0, 30, n=5000)
    # A mean gain that clears min_gain, and no tie (within the default 4% the near tie alone
    # would hold the split, rule 2): the t-test decides.
    p = EvolvingPlanner(8, min_gain=0.02, tie=0.0)
    assert p.decide(NOW, Split(4, 4), [*calm, burst], MODEL) is None
    ev = p.last
    assert ev is not None
    assert ev.target == Split(5, 3)
    assert ev.mean_gain >= p.min_gain  # the gain is large enough on average...
    assert ev.p_value > 0.05  # ...but not significant across slices
    # The same burst sustained over the window is significant: the planner then moves.
    sustained = [sl(k, 16_000, 0, 30, n=5000) for k in range(10)]
    assert EvolvingPlanner(8).decide(NOW, Split(4, 4), sustained, MODEL) is not None


def test_evolving_does_not_switch_below_min_gain() -> None:
    w = window(PREFILL_HEAVY)
    ev = EvolvingPlanner(8).evaluate(NOW, Split(4, 4), w, MODEL)
    assert ev is not None
    assert ev.p_value < 0.05
    above = EvolvingPlanner(8, min_gain=ev.mean_gain * 1.01)
    assert above.decide(NOW, Split(4, 4), w, MODEL) is None
    below = EvolvingPlanner(8, min_gain=ev.mean_gain * 0.99)
    assert below.decide(NOW, Split(4, 4), w, MODEL) == ev.target


def test_evolving_steps_waits_and_needs_slices() -> None:
    w = window(PREFILL_HEAVY)
    p = EvolvingPlanner(8, max_step=1)
    assert p.decide(NOW, Split(4, 4), w, MODEL) == Split(5, 3)
    assert p.decide(NOW + 60, Split(4, 4), w, MODEL) is None  # the switch is in flight
    p.switch_done()
    assert p.decide(NOW + 60, Split(5, 3), w, MODEL) == Split(6, 2)
    # Slices without arrivals say nothing; two with arrivals are too few for a test.
    idle = [sl(k, 1, 0, 1, n=0) for k in range(8)] + window(PREFILL_HEAVY)[8:]
    assert EvolvingPlanner(8).decide(NOW, Split(4, 4), idle, MODEL) is None
    with pytest.raises(ValueError, match="split"):
        EvolvingPlanner(8).decide(NOW, Split(4, 5), w, MODEL)


def test_evolving_rebins_finer_slices() -> None:
    """Sixty 10-s slices decide like ten 60-s slices of the same traffic."""
    coarse = window(PREFILL_HEAVY)
    fine = [
        dataclasses.replace(s, start=s.start + 10 * i, end=s.start + 10 * (i + 1))
        for s in coarse
        for i in range(6)
    ]
    a = EvolvingPlanner(8).evaluate(NOW, Split(4, 4), coarse, MODEL)
    b = EvolvingPlanner(8).evaluate(NOW, Split(4, 4), fine, MODEL)
    assert a is not None
    assert b is not None
    assert a.target == b.target
    assert b.mean_theta == pytest.approx(a.mean_theta)
    assert merge(fine[:6]).requests == 6 * coarse[0].requests


# -- dynamo: the `throughput` target (Dynamo 1.6.1's default) ----------------------------------

CTX = 131_072  # the context length the planner divides queued prefill tokens by


def busiest(queued_ctx: float, kv: float, k: int = 0) -> SliceStats:
    """A 5 s slice whose busiest prefill engine has `queued_ctx` context lengths of prompt
    tokens waiting and whose fullest decode engine a KV demand of `kv`."""
    return dataclasses.replace(
        sl(k, 2_000, 0, 100, width=5.0),
        max_queued_prefill_tokens=round(queued_ctx * CTX),
        max_decode_kv_demand=kv,
    )


def test_dynamo_defaults_are_dynamo_161s() -> None:
    p = DynamoPlanner()
    assert (p.name, p.mode, p.interval, p.switch_mode) == ("dynamo", "throughput", 5.0, "restart")
    assert p.context_length == CTX
    assert (PREFILL_UP, PREFILL_DOWN, DECODE_UP, DECODE_DOWN) == (1.0, 0.1, 1.0, 0.6)
    assert DynamoPlanner(mode="load").name == "dynamo-load"
    with pytest.raises(ValueError, match="unknown mode"):
        DynamoPlanner(mode="utilization")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("queued_ctx", "kv", "want"),
    [
        (1.0, 0.5, Split(5, 3)),  # a full context queued on one prefill engine, decode spare
        (0.99, 0.5, None),  # just under the prefill threshold
        (0.05, 1.01, Split(3, 5)),  # decode's waiting KV does not fit, prefill spare
        (0.05, 1.0, None),  # decode at exactly 1.0 is not above it
        (1.5, 0.8, None),  # prefill short but decode in its band: no donor at the ceiling
        (0.5, 1.5, None),  # decode short but prefill in its band: no donor either
        (2.0, 2.0, None),  # both short
        (0.0, 0.0, None),  # both spare: a lone scale-down idles nothing here, nothing moves
    ],
)
def test_dynamo_moves_a_node_only_when_one_phase_grows_and_the_other_shrinks(
    queued_ctx: float, kv: float, want: Split | None
) -> None:
    assert DynamoPlanner().decide(5.0, Split(4, 4), [busiest(queued_ctx, kv)], MODEL) == want


def test_dynamo_does_not_drain_a_phase_whose_survivors_would_go_over() -> None:
    # Decode KV demand 0.55 is "spare" (< 0.6), but spread over one engine fewer it reaches the
    # scale-up threshold: 0.55 x 2/1 = 1.1 >= 1.0 on two decode engines; 0.55 x 4/3 < 1 on four.
    assert may_shrink(0.55, 4, DECODE_UP, 1)
    assert not may_shrink(0.55, 2, DECODE_UP, 1)
    assert DynamoPlanner().decide(5.0, Split(6, 2), [busiest(1.2, 0.55)], MODEL) is None
    assert DynamoPlanner().decide(5.0, Split(4, 4), [busiest(1.2, 0.55)], MODEL) == Split(5, 3)
    # Prefill: 0.09 context lengths queued over 6 engines -> 0.108 over 5: still below 1.
    assert DynamoPlanner().decide(5.0, Split(6, 2), [busiest(0.09, 1.2)], MODEL) == Split(5, 3)
    # The last engine of a phase never goes (min_endpoint 1).
    assert not may_shrink(0.0, 1, PREFILL_UP, 1)
    assert DynamoPlanner().decide(5.0, Split(1, 7), [busiest(0.0, 1.2)], MODEL) is None


def test_dynamo_reads_the_latest_sample_and_waits_for_its_switch() -> None:
    p = DynamoPlanner()
    calm, busy = busiest(0.0, 0.3, k=0), busiest(1.0, 0.3, k=1)
    # The peaks are instantaneous: the latest slice's count, not an average with older ones.
    assert merge([calm, busy]).max_queued_prefill_tokens == busy.max_queued_prefill_tokens
    assert p.decide(10.0, Split(4, 4), [calm, busy], MODEL) == Split(5, 3)
    assert p.decide(15.0, Split(4, 4), [busiest(1.0, 0.3, k=2)], MODEL) is None  # in flight
    p.switch_done()
    assert p.decide(20.0, Split(5, 3), [busiest(1.0, 0.3, k=3)], MODEL) == Split(6, 2)
    # A context length of its own (a model with a shorter context fills it sooner).
    short = DynamoPlanner(context_length=CTX // 4)
    assert short.decide(5.0, Split(4, 4), [busiest(0.25, 0.3)], MODEL) == Split(5, 3)


# -- static and the registry (dynamo-load: tests/test_planner_dynamo_load.py; arrow:
# tests/test_planner_arrow.py) ---------------------------------------------------------------


def test_static_never_switches() -> None:
    p = StaticPlanner(Split(3, 5))
    assert p.name == "static:3P5D"
    for shape in (PREFILL_HEAVY, DECODE_HEAVY):
        assert p.decide(NOW, Split(3, 5), window(shape), MODEL) is None
    p.switch_done()


def test_registry() -> None:
    planners: list[Planner] = [make_planner(name, 8) for name in PLANNERS]
    assert [p.name for p in planners] == list(PLANNERS)
    assert all(math.isfinite(p.interval) and p.interval > 0 for p in planners)
    assert make_planner("static:2p6d", 8).name == "static:2P6D"
    with pytest.raises(ValueError, match="does not split"):
        make_planner("static:2P5D", 8)
    with pytest.raises(ValueError, match="unknown planner"):
        make_planner("greedy", 8)
