"""Phase switches: drain, then down for the switch time, KV kept or cleared as the mode says."""

from __future__ import annotations

from dataclasses import replace

import pytest

from evolving_infra.nodemodel.request import SimRequest
from evolving_infra.planner.base import Split, SwitchMode
from evolving_infra.sim.cluster import Cluster
from evolving_infra.sim.config import DecodeAllocation, SimConfig
from evolving_infra.sim.policies import PolicyContext, static
from evolving_infra.workloads.generators import SlotPlan, generate
from sim_helpers import OneSwitch


@pytest.mark.parametrize(
    ("mode", "down_s", "keeps"),
    [("restart", 700.0, False), ("in-place-drop", 6.2, False), ("in-place-keep", 6.2, True)],
)
def test_switch_modes(mode: SwitchMode, down_s: float, keeps: bool) -> None:
    trace = generate("cc", SlotPlan(agents=4, duration=300, seed=3))
    planner = OneSwitch(mode, Split(1, 3))

    def make(ctx: PolicyContext) -> OneSwitch:
        return planner

    spec = replace(static(Split(2, 2)), name="one-switch", planner=make)
    cluster = Cluster(trace, SimConfig(gpus=16, duration=1200, seed=1), spec)
    seen_down: list[tuple[float, int, bool]] = []

    def check() -> None:
        for n in cluster.nodes:
            if n.state == "down":
                # Unavailable: nothing routed to it, nothing runs on it.
                assert not n.accepting
                for work in (n.queue, n.running, n.batch, n.joining, n.waiting):
                    assert not work
                assert n.inbound == 0
                holds = bool(cluster.directory.eviction_order(n.id, "L1", 1))
                seen_down.append((cluster.now, n.kv.l1_held, holds))

    cluster.run(check=check)
    assert cluster.switcher is not None
    log = cluster.switcher.log
    assert len(log) == 1
    s = log[0]
    assert s.requested == pytest.approx(30.0)
    assert s.drained >= s.requested
    assert s.up - s.drained == pytest.approx(down_s)
    assert seen_down, "the node was never seen down"
    assert all(s.drained <= t <= s.up for t, _, _ in seen_down)
    node = cluster.nodes[s.node]
    assert node.phase == "decode"
    assert node.state == "active"
    assert cluster.switcher.split() == Split(1, 3)
    assert planner.done == 1
    if keeps:
        assert all(held > 0 and holds for _, held, holds in seen_down)
    else:
        assert all(held == 0 and not holds for _, held, holds in seen_down)
    summary = cluster.metrics.summary(1200.0, log)
    assert summary["switches"] == 1
    assert summary["switch_down_s"] == pytest.approx(down_s)
    assert max(planner.windows) <= 600 / planner.interval + 1  # a 10-minute window of slices


def test_a_target_while_switching_is_refused_and_reported_done() -> None:
    trace = generate("cc", SlotPlan(agents=2, duration=120, seed=3))
    planner = OneSwitch("restart", Split(3, 1))
    cluster = Cluster(
        trace,
        SimConfig(gpus=16, duration=60),
        replace(static(Split(2, 2)), planner=lambda ctx: planner),
    )
    assert cluster.switcher is not None
    assert cluster.switcher.request(Split(3, 1), 0.0)
    assert not cluster.switcher.request(Split(1, 3), 0.0)  # one in flight: refused...
    assert planner.done == 1  # ...and the planner hears it is over
    with pytest.raises(ValueError, match="not a split"):
        cluster.switcher.request(Split(4, 1), 0.0)


@pytest.mark.parametrize(
    ("allocation", "admission"), [("prefill_complete", True), ("early", False)]
)
def test_a_draining_prefill_node_hands_its_queue_to_the_others(
    allocation: DecodeAllocation, admission: bool
) -> None:
    """Queued, not-started prefills move to the other prefill nodes at once, and so do those
    held for their decode node's reservation (early allocation without the router's gate): the
    switch waits only for the iterations already running, not for the whole queue."""
    trace = generate("cc", SlotPlan(agents=60, duration=600, seed=5))
    planner = OneSwitch("in-place-keep", Split(1, 3), when=120.0)
    spec = replace(static(Split(2, 2)), name="one-switch", planner=lambda ctx: planner)
    cluster = Cluster(
        trace,
        SimConfig(gpus=16, duration=400, seed=2, decode_allocation=allocation),
        replace(spec, admission=admission),
    )
    before: dict[int, int] = {}  # prefill queue lengths after the last event before the switch
    queued_when_asked: list[int] = []

    def check() -> None:
        assert cluster.switcher is not None
        if not cluster.switcher.in_flight and not queued_when_asked:
            before.clear()
            before.update(
                (n.id, len(n.queue) + len(n.held)) for n in cluster.nodes if n.phase == "prefill"
            )
        elif cluster.switcher.in_flight and not queued_when_asked:
            queued_when_asked.extend(before[i] for i in cluster.switcher.in_flight)
        for n in cluster.nodes:
            if n.state == "draining" and n.phase == "prefill":
                # Handed back the moment draining began.
                assert not n.queue
                assert not n.held

    cluster.run(check=check)
    assert cluster.switcher is not None
    [s] = cluster.switcher.log
    assert queued_when_asked
    assert queued_when_asked[0] >= 3, "the scenario must queue work on the switching node"
    # Only the running chunked iterations remain: seconds, not the minutes of a long queue.
    assert s.drained - s.requested < 20.0


@pytest.mark.parametrize("mode", ["in-place-keep", "in-place-drop"])
def test_a_prefill_node_switching_to_decode_adopts_the_requests_it_prefilled(
    mode: SwitchMode,
) -> None:
    """Decode saturated (Putnam's long outputs on one decode node) under `prefill_complete`
    allocation: finished prefills wait with their KV pinned on the prefill nodes. Keeping its
    KV, a prefill node switching to decode takes the ones it prefilled and decodes them itself,
    instead of draining until the saturated node admits them; a switch that drops the KV
    cannot, and waits. (Under early allocation no finished prefill waits for a decode node.)"""
    trace = generate("putnam", SlotPlan(agents=12, duration=900, seed=4))
    planner = OneSwitch(mode, Split(2, 2), when=120.0)
    cluster = Cluster(
        trace,
        SimConfig(gpus=16, duration=600, seed=2, decode_allocation="prefill_complete"),
        replace(static(Split(3, 1)), name="one-switch", planner=lambda ctx: planner),
    )
    assert cluster.switcher is not None
    taken: list[SimRequest] = []
    take = cluster.switcher._take_prefilled
    assert take is not None

    def recording(node: int) -> list[SimRequest]:
        out = take(node)
        taken.extend(out)
        return out

    cluster.switcher._take_prefilled = recording
    cluster.run()
    [s] = cluster.switcher.log
    if mode == "in-place-keep":
        assert s.adopted
        assert sorted(s.adopted) == sorted(r.id for r in taken)
        assert 0 <= s.drained - s.requested < 30.0
        assert s.up > 0
        # Each adopted request was decoded to the end, or is decoding, moving to or waiting for
        # a decode node: none is lost.
        queued = {r.id for n in cluster.nodes for r in (*n.batch, *n.joining, *n.waiting)} | {
            r.id for r in cluster.pending_decode
        }
        for r in taken:
            moving = r.decode_node >= 0 and r.first_token < 0
            assert r.id in cluster.metrics.done_ids or r.id in queued or moving, r.id
        # The switched node decoded what fit at once; the rest waited for any decode node (all
        # of them queued on the switched node left the other decode node idle).
        assert any(r.decode_node == s.node and r.done >= 0 for r in taken)
        assert any(r.decode_node != s.node and r.done >= 0 for r in taken)
    else:
        assert not s.adopted
        assert s.drained < 0 or s.drained - s.requested >= 30.0
