"""Decode spans (many iterations per event) against stepping one iteration per event."""

from __future__ import annotations

import pytest

from evolving_infra.planner.base import Split
from evolving_infra.sim.cluster import Cluster
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.policies import static
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
