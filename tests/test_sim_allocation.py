"""When a decode node reserves a request's KV (`SimConfig.decode_allocation`, SGLang's
`--disaggregation-decode-allocation-policy`): after the prefill (`prefill_complete`, the prefill
node keeps the KV pinned until a decode node has room) or first (`early`, SGLang's default: the
prefill waits for the reservation)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from evolving_infra.planner.base import Split
from evolving_infra.sim.cluster import Cluster
from evolving_infra.sim.config import DecodeAllocation, SimConfig
from evolving_infra.sim.planning import node_samples
from evolving_infra.sim.policies import static
from evolving_infra.workloads.generators import SlotPlan, generate
from sim_helpers import OneSwitch, in_system

# Three prefill nodes and one decode node under 40 agents: the decode node is the bottleneck.
DECODE_STARVED = Split(3, 1)


def _run(allocation: DecodeAllocation, admission: bool) -> tuple[Cluster, dict[str, int]]:
    trace = generate("cc", SlotPlan(agents=40, duration=600, seed=4))
    config = SimConfig(gpus=16, duration=400, seed=1, decode_allocation=allocation)
    spec = replace(static(DECODE_STARVED), admission=admission)
    cluster = Cluster(trace, config, spec)
    seen = {"prefilled_waiting": 0, "queued_prefills": 0, "held": 0, "events": 0}

    def check() -> None:
        seen["events"] += 1
        waiting = [r for n in cluster.nodes if n.phase == "decode" for r in n.waiting]
        waiting += list(cluster.pending_decode)
        seen["prefilled_waiting"] += sum(r.prefill_done >= 0 for r in waiting)
        if allocation == "early":
            for r in waiting:
                assert r.prefill_done < 0
                assert not r.bootstrapped
                if admission:
                    # Not reserved yet, so not routed to a prefill node either.
                    assert r.prefill_node < 0
                else:
                    # Not reserved yet: its prefill node (chosen at dispatch) holds it in its
                    # bootstrap queue, off the prefill queue.
                    p = cluster.nodes[r.prefill_node]
                    assert p.held.get(r.id) is r or r in cluster.pending_prefill
            for n in cluster.nodes:
                if n.phase != "prefill":
                    continue
                for r in (*n.queue, *n.running):
                    seen["queued_prefills"] += 1
                    # A decode node holds the room of every request a prefill node queues.
                    assert r.bootstrapped
                    assert r.decode_node >= 0
                    d = cluster.nodes[r.decode_node]
                    assert d.phase == "decode"
                    assert r.res_d + r.pin_d > 0
                    assert r not in d.waiting
                for r in n.held.values():
                    assert not r.bootstrapped
                    assert r.res_d + r.pin_d == 0
        seen["held"] += sum(len(n.held) for n in cluster.nodes)

    cluster.run(check=check)
    return cluster, seen


@pytest.mark.parametrize("admission", [False, True])
def test_early_allocation_prefills_only_requests_a_decode_node_has_room_for(
    admission: bool,
) -> None:
    """With the router's decode-KV gate (`PolicySpec.admission`) a request meets its prefill
    node once its decode node has reserved; without it, at dispatch, and waits there."""
    late, late_seen = _run("prefill_complete", admission)
    early, early_seen = _run("early", admission)
    # The workload does starve the decode node: after their prefill, requests waited for it...
    assert late_seen["prefilled_waiting"] > 0
    assert late_seen["held"] == 0
    # ...which early allocation never lets happen (and it did prefill, under the check above).
    assert early_seen["prefilled_waiting"] == 0
    assert early_seen["queued_prefills"] > 0
    assert (early_seen["held"] > 0) != admission
    for cluster in (late, early):
        m = cluster.metrics
        assert m.completed > 0
        # Every issued request was answered or is found in the system, once.
        assert m.issued == m.completed + m.rejected + len(in_system(cluster))


def test_held_bootstrap_requests_are_not_prefill_demand() -> None:
    """Requests in a prefill node's bootstrap queue wait for decode KV, not for the node: a
    planner must not read a decode shortage as prefill demand (issue 24). Routing still counts
    them (`queued_s`): they will run there."""
    trace = generate("cc", SlotPlan(agents=40, duration=600, seed=4))
    config = SimConfig(gpus=16, duration=400, seed=1, decode_allocation="early")
    cluster = Cluster(trace, config, replace(static(DECODE_STARVED), admission=False))
    seen = {"held_only": 0, "held": 0}

    def check() -> None:
        for n in cluster.nodes:
            if n.phase != "prefill" or n.state == "down":
                continue
            held = list(n.held.values())
            assert n.held_s == pytest.approx(sum(r.pred_s for r in held), abs=1e-9)
            assert n.held_tokens == sum(r.uncached for r in held)
            assert n.prefill_demand_s() == pytest.approx(max(n.queued_s - n.held_s, 0.0))
            waiting = sum(r.uncached for r in n.queue)
            assert n.waiting_prefill_tokens() == waiting
            if held:
                seen["held"] += 1
                if not (n.queue or n.running):
                    # All it has is held work: routing sees a queue, the planner sees none.
                    seen["held_only"] += 1
                    assert n.queued_s > 0
                    assert n.prefill_demand_s() == pytest.approx(0.0, abs=1e-9)
                    assert n.waiting_prefill_tokens() == 0
        samples = node_samples(cluster.nodes)
        up = [n for n in cluster.nodes if n.state != "down"]
        for n, sample in zip(up, samples, strict=True):
            if n.phase == "prefill":
                assert sample.queued_prefill_s == n.prefill_demand_s()
                assert sample.queued_prefill_tokens == n.waiting_prefill_tokens()
            else:
                assert sample.kv_used == n.kv_use()

    cluster.run(check=check)
    assert seen["held"] > 0
    assert seen["held_only"] > 0  # the decode-starved run does leave nodes with held work only


@pytest.mark.parametrize("target", [Split(1, 3), Split(3, 1)])
def test_switches_drain_under_early_allocation(target: Split) -> None:
    """A draining decode node hands back the requests it has not reserved for (they have no
    prefill yet) and waits for those it has; a draining prefill node hands its queue back."""
    trace = generate("cc", SlotPlan(agents=30, duration=600, seed=5))
    planner = OneSwitch("in-place-keep", target, when=120.0)
    spec = replace(static(Split(2, 2)), name="one-switch", planner=lambda ctx: planner)
    cluster = Cluster(
        trace, SimConfig(gpus=16, duration=500, seed=2, decode_allocation="early"), spec
    )
    cluster.run()
    assert cluster.switcher is not None
    [s] = cluster.switcher.log
    assert s.up > s.drained >= s.requested
    assert cluster.switcher.split() == target
    m = cluster.metrics
    assert m.issued == m.completed + m.rejected + len(in_system(cluster))
    assert m.completed > 0


def test_an_unknown_allocation_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="decode_allocation must be one of"):
        SimConfig(decode_allocation="late")  # type: ignore[arg-type]
