"""`dynamo-load`: Dynamo 1.6.1's SLA load loop (`optimization_target: sla` with load scaling)
with upstream's guards, on hand-built slices (docs/baselines.md §2b)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from evolving_infra.planner import DynamoPlanner, SliceStats, Split
from evolving_infra.planner.common import merge, prefill_seconds
from evolving_infra.planner.slices import NodeSample, Slices
from evolving_infra.timing import DEFAULT_DEPLOYMENT
from evolving_infra.timing.model import IterationModel

MODEL = IterationModel(prior=DEFAULT_DEPLOYMENT)
CTX = 2_000.0  # mean KV tokens of a decoding request (upstream's `avg_decode_length`)
T_OWN = prefill_seconds(MODEL, 2_000, 0, 8192)  # the next (mean) request's prefill alone


def engines(
    *,
    queue: tuple[float, float, float] = (0.0, 0.0, 0.0),
    least: tuple[int, int] = (0, 0),
    most: tuple[int, int] = (0, 0),
    kv: float = 0.1,
    k: int = 0,
) -> SliceStats:
    """A 5 s slice of 100 arrivals of 2,000 fresh prompt tokens. `queue`: the prefill engines'
    (least, mean, busiest) queue drain in seconds; `least` / `most`: (KV tokens, requests) of the
    decode engine with the fewest / most KV tokens; `kv`: the fullest one's KV over its cache."""
    lo, mean, hi = queue
    return SliceStats(
        start=5.0 * k,
        end=5.0 * (k + 1),
        requests=100,
        prompt_tokens=200_000,
        uncached_tokens=200_000,
        cached_tokens=0,
        output_tokens=10_000,
        mean_decode_batch=(least[1] + most[1]) / 2,
        mean_context_tokens=CTX,
        prefill_queue_s=mean,
        kv_utilization=kv / 2,
        mean_input_tokens=2_000.0,
        max_decode_kv_demand=kv,
        min_prefill_queue_s=lo,
        max_prefill_queue_s=hi,
        min_decode_kv_tokens=least[0],
        min_decode_kv_requests=least[1],
        max_decode_kv_tokens=most[0],
        max_decode_kv_requests=most[1],
    )


def itl(tokens: float, requests: float) -> float:
    """Upstream's ITL estimate: the engine's KV and requests plus one next request."""
    return MODEL.predict_decode(math.ceil(requests) + 1, math.ceil(tokens + CTX))


def load(**kw: float) -> DynamoPlanner:
    return DynamoPlanner(mode="load", **kw)  # type: ignore[arg-type]


IDLE = (0, 0)  # a decode engine with nothing to do
BUSY = (2_600_000, 128)  # one whose step alone is over the 50 ms ITL SLA
SHORT = (1.0, 1.5, 2.0)  # every prefill engine's TTFT over 500 ms
SPARE = (0.0, 0.0, 0.0)  # prefill queues empty: one engine can go


def test_dynamo_load_defaults() -> None:
    p = load()
    assert (p.name, p.mode, p.interval, p.switch_mode) == ("dynamo-load", "load", 5.0, "restart")
    assert (p.ttft_sla, p.itl_sla, p.down_sensitivity) == (0.5, 0.05, 0.8)
    assert itl(*BUSY) > 0.05 > itl(*IDLE)


def test_dynamo_load_estimates_each_engine() -> None:
    """TTFT: the least loaded prefill engine's drain plus the next request's prefill; ITL: the
    least loaded decode engine's requests and KV plus one next request (`add_next_request`)."""
    s = engines(queue=(0.2, 0.9, 3.0), least=(16_000, 8), most=BUSY)
    ttft, est = load().estimates(s, MODEL)
    assert ttft == pytest.approx(0.2 + T_OWN)
    assert est == pytest.approx(MODEL.predict_decode(9, 18_000))


def test_dynamo_load_does_not_grow_prefill_while_one_engine_meets_the_sla() -> None:
    """Mean queue 1.5 s, busiest 3 s: the mean engine's TTFT is far over 500 ms, but the least
    loaded engine's (0.1 s + its own prefill) is not; upstream grows a phase only when every
    engine is over (`load_scaling.py:1124-1128`). Decode has a node to spare throughout."""
    uneven = engines(queue=(0.1, 1.5, 3.0), least=IDLE, most=IDLE)
    assert 0.1 + T_OWN < 0.5 < 1.5 + T_OWN
    assert load().decide(5.0, Split(4, 4), [uneven], MODEL) is None
    over = dataclasses.replace(uneven, min_prefill_queue_s=0.4)
    assert load().decide(5.0, Split(4, 4), [over], MODEL) == Split(5, 3)


def test_dynamo_load_grows_a_phase_only_with_an_opposing_shrink() -> None:
    """At the GPU ceiling a phase grows only when the other's own decision says shrink in the
    same tick (`core/budget.py:481-502`); no donor is invented."""
    band = (600_000, 48)  # decode in its band: its ITL under the SLA, one engine fewer over 0.8
    assert itl(*band) < 0.05
    assert itl(band[0] * 4 / 3, band[1] * 4 / 3) >= 0.05 * 0.8
    assert load().decide(5.0, Split(4, 4), [engines(queue=SHORT, most=band)], MODEL) is None
    assert load().decide(5.0, Split(4, 4), [engines(queue=SHORT, most=IDLE)], MODEL) == (
        Split(5, 3)
    )
    # Decode short: prefill gives a node only when its own guard lets one go.
    assert load().decide(5.0, Split(4, 4), [engines(least=BUSY, most=BUSY)], MODEL) == (Split(3, 5))
    busy = engines(queue=(0.0, 0.2, 0.3), least=BUSY, most=BUSY)  # 0.3 x 4/3 > (0.5 - t) x 0.8
    assert load().decide(5.0, Split(4, 4), [busy], MODEL) is None
    # Both short, or both spare: nothing moves.
    assert load().decide(
        5.0, Split(4, 4), [engines(queue=SHORT, least=BUSY, most=BUSY)], MODEL
    ) is (None)
    assert load().decide(5.0, Split(4, 4), [engines(queue=SPARE)], MODEL) is None


def test_dynamo_load_does_not_drain_decode_when_the_survivors_kv_would_not_fit() -> None:
    """Prefill is short and every decode engine's ITL is far under its SLA, but the fullest
    decode engine's KV x N/(N-1) reaches its cache (`load_scaling.py:603-609`): decode keeps
    its engines. 0.8 x 4/3 >= 1 on four engines; 0.7 x 4/3 < 1."""
    full = engines(queue=SHORT, most=IDLE, kv=0.8)
    assert load().decide(5.0, Split(4, 4), [full], MODEL) is None
    fits = dataclasses.replace(full, max_decode_kv_demand=0.7)
    assert load().decide(5.0, Split(4, 4), [fits], MODEL) == Split(5, 3)
    # With eight decode engines 0.8 x 8/7 < 1: one may go.
    assert load().decide(5.0, Split(4, 8), [full], MODEL) == Split(5, 7)


def test_dynamo_load_prefill_shrinks_within_its_queue_budget() -> None:
    """Prefill shrinks when the busiest engine's queue x N/(N-1) stays below
    (ttft_sla - t_own) x 0.8 (`load_scaling.py:486-539`); decode is short."""
    budget = (0.5 - T_OWN) * 0.8
    q = budget * 0.7  # x 4/3 fits the budget, x 2/1 does not
    s = engines(queue=(0.0, q / 2, q), least=BUSY, most=BUSY)
    assert load().decide(5.0, Split(4, 4), [s], MODEL) == Split(3, 5)
    assert load().decide(5.0, Split(2, 6), [s], MODEL) is None


def test_dynamo_load_counts_queued_decode_kv_in_its_itl() -> None:
    """Upstream's ITL estimate includes queued (preempted) decode requests and their KV
    (`include_queued_decode=True`). The same scheduled batch with a preempted backlog is over
    the SLA on every engine; without it, it is far under."""

    def slice_of(queued: int, tokens: int) -> SliceStats:
        slices = Slices(60.0)
        for _ in range(100):
            slices.arrival(2_000, 2_000, 0)
        nodes = [NodeSample("prefill", 0.0, 0, 0, 0.0) for _ in range(4)]
        nodes += [
            NodeSample(
                "decode", 0.0, 8, 16_000, 0.1, queued_decode=queued, queued_decode_tokens=tokens
            )
            for _ in range(4)
        ]
        slices.sample(nodes)
        return slices.close(5.0)

    backlog = slice_of(120, 2_400_000)
    assert (backlog.min_decode_kv_tokens, backlog.min_decode_kv_requests) == (2_416_000, 128)
    _, est = load().estimates(backlog, MODEL)
    assert est == pytest.approx(MODEL.predict_decode(129, 2_416_000 + 2_000))
    assert est > 0.05
    assert load().decide(5.0, Split(4, 4), [backlog], MODEL) == Split(3, 5)
    plain = slice_of(0, 0)
    assert load().estimates(plain, MODEL)[1] < 0.05
    assert load().decide(5.0, Split(4, 4), [plain], MODEL) is None


def test_dynamo_load_reads_the_latest_sample_and_waits_for_its_switch() -> None:
    p = load()
    calm, short = engines(queue=SPARE, k=0), engines(queue=SHORT, k=1)
    merged = merge([short, calm])  # merge takes the per-engine figures of the latest slice
    assert merged.min_prefill_queue_s == short.min_prefill_queue_s
    assert merged.max_prefill_queue_s == short.max_prefill_queue_s
    assert p.decide(10.0, Split(4, 4), [calm, short], MODEL) == Split(5, 3)
    assert p.decide(15.0, Split(4, 4), [engines(queue=SHORT, k=2)], MODEL) is None  # in flight
    p.switch_done()
    assert p.decide(20.0, Split(5, 3), [engines(queue=SHORT, k=3)], MODEL) == Split(6, 2)
    # The last decode engine never goes.
    assert load().decide(5.0, Split(7, 1), [engines(queue=SHORT)], MODEL) is None
