"""Decode spans (many iterations per event) against stepping one iteration per event."""

from __future__ import annotations

import pytest

from evolving_infra.planner.base import Split
from evolving_infra.sim.cluster import Cluster
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.policies import static
from evolving_infra.timing.specs import H100, LLAMA3_70B, Deployment
from evolving_infra.workloads.generators import SlotPlan, generate


def run(cap: int) -> tuple[float, float, int, int]:
    trace = generate("osworld", SlotPlan(agents=4, duration=240, seed=2))
    # One decode node, so that requests share its batch; no noise, so both runs see the truth.
    config = SimConfig(gpus=8, noise=0.0, decode_span_cap=cap, duration=300)
    cluster = Cluster(trace, config, static(Split(1, 1)))
    cluster.run()
    m = cluster.metrics
    decode_s = sum(e - t for e, t in zip(m.e2e, m.ttft, strict=True))  # first token -> done
    return decode_s, sum(m.e2e), cluster.stats.events, m.completed


def test_spans_match_stepping() -> None:
    spans = run(64)
    steps = run(1)
    assert spans[3] == steps[3] > 20  # the same requests completed
    assert spans[0] == pytest.approx(steps[0], rel=0.01)  # total decode time within 1%
    assert spans[1] == pytest.approx(steps[1], rel=0.01)
    assert spans[2] * 5 < steps[2]  # ... for a fraction of the events


# -- multi-token prediction --------------------------------------------------------------------

MTP_TRACE = generate("osworld", SlotPlan(agents=4, duration=240, seed=2))


def mtp_run(accepted: float, cap: int = 64) -> Cluster:
    deployment = Deployment(LLAMA3_70B, H100, tp=4, mtp_draft_tokens=3, mtp_accepted=accepted)
    config = SimConfig(gpus=8, deployment=deployment, noise=0.0, decode_span_cap=cap, duration=300)
    cluster = Cluster(MTP_TRACE, config, static(Split(1, 1)))
    cluster.run()
    return cluster


def decode_seconds(cluster: Cluster) -> float:
    m = cluster.metrics
    return sum(e - t for e, t in zip(m.e2e, m.ttft, strict=True))


def mean_itl(cluster: Cluster) -> float:
    itl = cluster.metrics.itl
    return sum(itl) / len(itl)


def test_mtp_credits_accepted_tokens_per_iteration() -> None:
    """With 2.5 tokens accepted per step a request needs ~1/2.5 of the iterations; each
    iteration (draft + verify) costs more, so tokens come faster, but by less than 2.5x."""
    one, fast = mtp_run(1.0), mtp_run(2.5)
    assert fast.metrics.completed > one.metrics.completed > 20  # a closed loop: more turns
    ratio = mean_itl(one) / mean_itl(fast)
    assert 1.3 < ratio < 2.5


def test_mtp_spans_match_stepping() -> None:
    """Spans credit fractional tokens as stepping one iteration per event does."""
    spans, steps = mtp_run(2.5, cap=64), mtp_run(2.5, cap=1)
    assert spans.metrics.completed == steps.metrics.completed
    assert decode_seconds(spans) == pytest.approx(decode_seconds(steps), rel=0.01)


def test_mtp_accepted_is_bounded_by_the_draft() -> None:
    with pytest.raises(ValueError, match="mtp_accepted"):
        Deployment(LLAMA3_70B, H100, tp=4, mtp_draft_tokens=1, mtp_accepted=2.5)
    with pytest.raises(ValueError, match="mtp_accepted"):
        Deployment(LLAMA3_70B, H100, tp=4, mtp_accepted=0.5)
