"""The evolving planner's reuse model (`planner/reuse.py`): how long ago each arrival's reusable
prefix was last in a prompt, the retention time that explains what the placements found cached,
and the cache another split would have (issue 25: the hit rate depends on the split)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evolving_infra.planner import EvolvingPlanner, SliceStats, Split
from evolving_infra.planner.reuse import (
    FULL_REUSE,
    Reuse,
    ReuseTracker,
    SliceReuse,
    found_share,
    kept_share,
)
from evolving_infra.planner.slices import Slices
from evolving_infra.timing import DEFAULT_DEPLOYMENT
from evolving_infra.timing.model import IterationModel

MODEL = IterationModel(prior=DEFAULT_DEPLOYMENT)
BLOCK = 16


def chain(root: int, n: int) -> list[int]:
    """n chain hashes under `root`: block k's hash fixes blocks 0..k."""
    return [root * 1_000_000 + k for k in range(n)]


# -- the tracker --------------------------------------------------------------------------------


def test_a_first_prompt_has_nothing_to_reuse() -> None:
    t = ReuseTracker(BLOCK, stride=4)
    assert t.observe(0.0, chain(1, 64)) == Reuse()


def test_a_repeated_prefix_is_reusable_with_its_gap() -> None:
    t = ReuseTracker(BLOCK, stride=4)
    t.observe(0.0, chain(1, 64))
    r = t.observe(30.0, chain(1, 96))  # the last turn's 64 blocks, and 32 new ones
    assert r.tokens == 64 * BLOCK
    assert r.runs == ((64 * BLOCK, 30.0),)


def test_gaps_grow_along_the_chain() -> None:
    """A shared head touched more recently than the rest: two runs, the recent one first."""
    t = ReuseTracker(BLOCK, stride=4)
    t.observe(0.0, chain(1, 64))
    t.observe(100.0, chain(1, 16))  # another prompt with the first 16 blocks only
    r = t.observe(110.0, chain(1, 64))
    assert r.runs == ((16 * BLOCK, 10.0), (48 * BLOCK, 110.0))
    gaps = [g for _, g in r.runs]
    assert gaps == sorted(gaps)


def test_gaps_within_a_bin_are_one_run() -> None:
    t = ReuseTracker(BLOCK, stride=4)
    t.observe(0.0, chain(1, 64))
    t.observe(2.0, chain(1, 32))
    r = t.observe(100.0, chain(1, 64))  # gaps 98 s and 100 s: within a factor of 1.25
    assert r.runs == ((64 * BLOCK, 98.0),)


def test_the_horizon_forgets() -> None:
    t = ReuseTracker(BLOCK, stride=4, horizon_s=100.0)
    t.observe(0.0, chain(1, 64))
    assert len(t) == 16
    assert t.observe(150.0, chain(1, 64)) == Reuse()  # older than the horizon: never seen
    t.observe(150.0, chain(2, 8))  # a sweep is due (a quarter of the horizon passed)
    assert len(t) == 16 + 2  # chain 1 seen again at 150, chain 2's two sampled blocks


def _observe_block_by_block(
    last: dict[int, float], now: float, kept: list[int], span: int, horizon: float
) -> Reuse:
    """The tracker's rule, one sampled block at a time (what `observe` does by groups)."""
    runs: list[tuple[int, float]] = []
    for h in kept:
        seen = last.get(h)
        if seen is None or now - seen >= horizon:
            break
        gap = max(now - seen, 0.0)
        lo, hi = sorted((runs[-1][1], gap)) if runs else (gap, gap)
        if runs and hi <= max(lo, 1.0) * 1.25:
            runs[-1] = (runs[-1][0] + span, runs[-1][1])
        else:
            runs.append((span, gap))
    last.update(dict.fromkeys(kept, now))
    return Reuse(tuple(runs))


@settings(max_examples=100, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(st.integers(1, 3), st.integers(0, 80), st.floats(0.0, 400.0)),
        min_size=1,
        max_size=12,
    )
)
def test_observing_by_groups_is_observing_block_by_block(
    prompts: list[tuple[int, int, float]],
) -> None:
    t = ReuseTracker(BLOCK, stride=1, horizon_s=1000.0)
    last: dict[int, float] = {}
    now = 0.0
    for root, n, step in prompts:
        now += step
        hashes = chain(root, n)
        assert t.observe(now, hashes) == _observe_block_by_block(last, now, hashes, BLOCK, 1000.0)


def test_bad_tracker_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        ReuseTracker(0)


# -- the model ----------------------------------------------------------------------------------


def reuse(*runs: tuple[int, float]) -> Reuse:
    return Reuse(tuple(runs))


def test_kept_share_grows_with_retention() -> None:
    rs = [reuse((1000, 10.0), (1000, 100.0)), reuse((2000, 300.0))]
    shares = [kept_share(rs, tau) for tau in (10.0, 100.0, 1000.0, 1e6)]
    assert shares == sorted(shares)
    assert shares[-1] == pytest.approx(1.0, abs=1e-6)
    assert found_share([2000, 0], rs) == pytest.approx(0.5)
    assert found_share([0], [Reuse()]) is None


def slice_arrivals() -> tuple[list[tuple[int, int]], list[Reuse]]:
    """40 arrivals of 10k tokens, 8k reusable each: recent turns found cached, old ones lost."""
    arrivals, rs = [], []
    for i in range(40):
        gap = 20.0 + 20.0 * i  # 20 s .. 800 s since the last turn
        cached = 8000 if gap < 300 else 0
        arrivals.append((10_000 - cached, cached))
        rs.append(reuse((8000, gap)))
    return arrivals, rs


def test_the_retention_time_explains_what_was_found() -> None:
    arrivals, rs = slice_arrivals()
    m = SliceReuse.of(arrivals, rs, 5.0)
    assert m is not None
    found = found_share([c for _, c in arrivals], rs)
    assert m.share(1.0) == pytest.approx(found, rel=1e-6)


def test_nothing_lost_says_nothing_about_a_smaller_cache() -> None:
    rs = [reuse((8000, 500.0))] * 4
    assert SliceReuse.of([(2000, 8000)] * 4, rs, 5.0) is None
    assert FULL_REUSE < 1.0


def test_another_cache_moves_cached_tokens_by_the_kept_share() -> None:
    arrivals, rs = slice_arrivals()
    m = SliceReuse.of(arrivals, rs, 5.0)
    assert m is not None
    ideal = sum(r.tokens for r in rs)
    assert m.at(1.0) == arrivals
    for scale in (0.5, 0.8, 1.25, 2.0):
        at = m.at(scale)
        assert [u + c for u, c in at] == [u + c for u, c in arrivals]  # prompts unchanged
        assert sum(c for _, c in at) / ideal == pytest.approx(m.share(scale), abs=2e-3)
    smaller, larger = m.at(0.5), m.at(2.0)
    assert sum(c for _, c in smaller) < sum(c for _, c in arrivals) < sum(c for _, c in larger)
    assert all(c <= 8000 for _, c in larger)  # never beyond the reusable prefix


def test_mismatched_records_are_refused() -> None:
    with pytest.raises(ValueError, match="reuse records"):
        SliceReuse.of([(1, 1)], [], 5.0)


# -- the accumulator and the planner ------------------------------------------------------------


def test_slices_record_reuse_aligned_with_arrivals() -> None:
    s = Slices(600.0, block_tokens=BLOCK)
    s.arrival(64 * BLOCK, 64 * BLOCK, 0, chain(1, 64), now=0.0)
    s.arrival(96 * BLOCK, 32 * BLOCK, 64 * BLOCK, chain(1, 96), now=30.0)
    s.add_sample(5, 0, 0, 0.0, 4, 0.0)
    s.add_sample(7, 0, 0, 0.0, 2, 0.0)
    out = s.close(60.0)
    assert len(out.arrival_reuse) == len(out.arrivals) == 2
    assert out.arrival_reuse[1].tokens == 64 * BLOCK
    assert out.mean_decode_nodes == pytest.approx(6.0)
    plain = Slices(600.0)  # no tracker: no records, whatever the hashes
    plain.arrival(10, 10, 0, chain(1, 4), now=0.0)
    assert plain.close(60.0).arrival_reuse == ()


def lossy_slice(k: int, lost: bool) -> SliceStats:
    """Minute k at 4P5D: long prompts whose turns come back after 60-400 s; with `lost`, the
    placements found the older half uncached."""
    arrivals, rs = [], []
    for i in range(64):
        gap = 60.0 + 5.0 * i
        cached = 0 if lost and gap > 220 else 60_000
        arrivals.append((64_000 - cached, cached))
        rs.append(reuse((60_000, gap)))
    n = 120
    unc = sum(u for u, _ in arrivals) * n // 64
    return SliceStats(
        start=k * 60.0,
        end=(k + 1) * 60.0,
        requests=n,
        prompt_tokens=n * 64_000,
        uncached_tokens=unc,
        cached_tokens=n * 64_000 - unc,
        output_tokens=n * 400,
        mean_decode_batch=16.0,
        mean_context_tokens=64_200.0,
        prefill_queue_s=0.0,
        kv_utilization=0.5,
        mean_input_tokens=64_000.0,
        arrivals=tuple(arrivals),
        arrival_reuse=tuple(rs),
        mean_decode_nodes=5.0,
    )


def test_a_split_with_more_decode_nodes_is_priced_with_its_larger_cache() -> None:
    """Reuse lost at 4P5D: the planner expects fewer uncached tokens at the splits with more
    decode nodes (more of Θ there than without the reuse records) and none of it where nothing
    was lost."""
    p = EvolvingPlanner(9)
    lossy = [lossy_slice(k, lost=True) for k in range(5)]
    blind = [dataclasses.replace(s, arrival_reuse=()) for s in lossy]
    with_model = p.evaluate(300.0, Split(4, 5), lossy, MODEL)
    without = p.evaluate(300.0, Split(4, 5), blind, MODEL)
    assert with_model is not None
    assert without is not None
    gain = [a / b for a, b in zip(with_model.thetas, without.thetas, strict=True)]
    assert gain[3] == pytest.approx(1.0)  # 4P5D itself: the cache it has
    assert gain[2] > 1.0
    assert gain[1] > gain[2]
    assert gain[5] < 1.0  # 6P3D: a smaller one
    whole = [lossy_slice(k, lost=False) for k in range(5)]
    same = p.evaluate(300.0, Split(4, 5), whole, MODEL)
    plain = p.evaluate(
        300.0, Split(4, 5), [dataclasses.replace(s, arrival_reuse=()) for s in whole], MODEL
    )
    assert same is not None
    assert plain is not None
    assert same.thetas == plain.thetas


def test_decode_kv_full_of_running_requests_keeps_the_estimate() -> None:
    """The same lossy slices with the decode nodes' KV full of running requests: they keep no
    cache between turns, so their count says nothing about a candidate's cache, and every
    candidate is priced as without the reuse records."""
    p = EvolvingPlanner(9)
    full = [dataclasses.replace(lossy_slice(k, lost=True), kv_utilization=0.99) for k in range(5)]
    blind = [dataclasses.replace(s, arrival_reuse=()) for s in full]
    with_records = p.evaluate(300.0, Split(4, 5), full, MODEL)
    without = p.evaluate(300.0, Split(4, 5), blind, MODEL)
    assert with_records is not None
    assert without is not None
    assert with_records.thetas == without.thetas


def test_the_decode_exponent_sets_how_much_a_decode_node_keeps() -> None:
    """`decode_exponent` (the reuse model's τ ∝ decode nodes^exponent): 0 prices every split
    with the cache that ran (as without the reuse records), a larger one prices the splits with
    more decode nodes higher and those with fewer lower; out of range is refused."""
    lossy = [lossy_slice(k, lost=True) for k in range(5)]
    blind = [dataclasses.replace(s, arrival_reuse=()) for s in lossy]
    flat = EvolvingPlanner(9, decode_exponent=0.0).evaluate(300.0, Split(4, 5), lossy, MODEL)
    plain = EvolvingPlanner(9).evaluate(300.0, Split(4, 5), blind, MODEL)
    low = EvolvingPlanner(9, decode_exponent=0.5).evaluate(300.0, Split(4, 5), lossy, MODEL)
    high = EvolvingPlanner(9, decode_exponent=2.0).evaluate(300.0, Split(4, 5), lossy, MODEL)
    assert flat is not None
    assert plain is not None
    assert low is not None
    assert high is not None
    assert flat.thetas == pytest.approx(plain.thetas)
    assert high.thetas[3] == pytest.approx(low.thetas[3])  # 4P5D: the cache it has
    assert high.thetas[1] > low.thetas[1]  # 2P7D: a larger cache still
    assert high.thetas[5] < low.thetas[5]  # 6P3D: a smaller one
    with pytest.raises(ValueError, match="decode_exponent"):
        EvolvingPlanner(9, decode_exponent=-1.0)
