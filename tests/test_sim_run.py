"""Whole runs: determinism, conservation, KV capacity, the directory mirroring the nodes, h*.

Small traces (a few agents, minutes of simulated time) on 4 nodes; each test says which
invariant it holds the simulator to.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from evolving_infra.nodemodel.kv import BlockParents
from evolving_infra.planner.base import Split
from evolving_infra.planner.slices import Slices
from evolving_infra.routing.dynamo import DynamoRouter
from evolving_infra.sim.cluster import Cluster
from evolving_infra.sim.config import DecodeAllocation, SimConfig
from evolving_infra.sim.planning import node_samples, sample_nodes
from evolving_infra.sim.policies import PolicyContext, PolicySpec, policy, static
from evolving_infra.sim.run import BEST_STATIC, compare
from evolving_infra.timing.model import IterationModel
from evolving_infra.workloads.blocks import PromptHasher
from evolving_infra.workloads.generators import SlotPlan, generate
from evolving_infra.workloads.model import Trace
from evolving_infra.workloads.stats import trace_stats
from sim_helpers import in_system


def cc_trace(agents: int = 4, duration: float = 600.0, seed: int = 1) -> Trace:
    return generate("cc", SlotPlan(agents=agents, duration=duration, seed=seed))


def tight(**kw: Any) -> SimConfig:
    """4 nodes with a third of the usual KV room and a small L2: evictions, L2 drops and decode
    admission waits all happen within minutes."""
    return SimConfig(gpus=16, mem_fraction=0.65, host_memory_per_gpu=4 * 2**30, **kw)


def strip_runtime(results: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in results.items() if k != "runtime"}, sort_keys=True)


def test_same_seed_same_results_and_another_seed_differs() -> None:
    trace = cc_trace(agents=3, duration=400)
    config = SimConfig(gpus=16, duration=900, seed=5)
    names = ["evolving", "arrow"]
    a = compare(trace, config, names)
    b = compare(trace, config, names)
    assert strip_runtime(a) == strip_runtime(b)
    c = compare(trace, SimConfig(gpus=16, duration=900, seed=6), names)
    assert strip_runtime(a) != strip_runtime(c)  # the ground truth's noise follows the seed


def test_policies_run_in_processes_give_the_same_results() -> None:
    """`jobs=3`: three forked workers for four runs (best-static's splits included) give the
    figures of one run after the other, in the same order, and runtime entries for every run."""
    trace = cc_trace(agents=3, duration=300)
    config = SimConfig(gpus=12, duration=600, seed=2)
    names = ["evolving", "dynamo", BEST_STATIC]
    one = compare(trace, config, names)
    many = compare(trace, config, names, jobs=3)
    assert strip_runtime(many) == strip_runtime(one)
    assert list(many["policies"]) == list(one["policies"])
    runs = {"evolving", "dynamo", "static:1P2D", "static:2P1D"}
    assert set(many["runtime"]) == set(one["runtime"]) == runs
    with pytest.raises(ValueError, match="jobs"):
        compare(trace, config, names, jobs=0)


@pytest.mark.parametrize("allocation", ["prefill_complete", "early"])
@pytest.mark.parametrize("name", ["evolving", "dynamo", "arrow"])
def test_conservation_and_kv_capacity(name: str, allocation: DecodeAllocation) -> None:
    trace = cc_trace(agents=6, duration=600, seed=2)
    config = tight(duration=900, seed=1, decode_allocation=allocation)
    cluster = Cluster(trace, config, policy(name, config.nodes))

    def check() -> None:
        for n in cluster.nodes:
            kv = n.kv
            assert kv.reserved >= 0
            assert 0 <= kv.pinned <= kv.l1_held + kv.reserved
            assert kv.l1_held + kv.reserved <= kv.l1_capacity, n.id
            assert kv.l2_held <= kv.l2_capacity
            # The counts kept incrementally are the ones a full recount gives.
            assert kv.l1_held == cluster.directory.held(n.id, "L1")
            assert kv.l2_held == cluster.directory.held(n.id, "L2")
            assert n.batch_context == sum(r.context for r in n.batch)

    cluster.run(check=check)
    m = cluster.metrics
    inside = in_system(cluster)
    ids = [r.id for r in inside]
    assert len(ids) == len(set(ids)), "a request is in two places"
    assert not set(ids) & m.done_ids, "an answered request is still in the system"
    assert m.issued == m.completed + m.rejected + len(inside)
    assert m.issued > 0
    assert m.completed > 0
    assert len(m.done_ids) == m.completed + m.rejected
    assert sum(n.kv.evicted for n in cluster.nodes) > 0  # the capacity limit was exercised
    assert sum(n.kv.dropped for n in cluster.nodes) > 0


def test_a_run_to_the_end_answers_every_request_and_h_star_is_the_traces() -> None:
    trace = cc_trace(agents=3, duration=300, seed=4)
    cluster = Cluster(trace, SimConfig(gpus=16, seed=2), policy("evolving", 4))
    end = cluster.run()
    m = cluster.metrics
    assert m.issued == m.completed + m.rejected == trace.request_count
    assert m.ideal_hit_rate == pytest.approx(trace_stats(trace).ideal_hit_rate, rel=1e-12)
    assert 0.0 < m.hit_rate <= m.ideal_hit_rate <= 1.0
    assert end == cluster.last_response
    for n in cluster.nodes:  # nothing is left running, so nothing is pinned or reserved
        assert n.kv.pinned == 0
        assert n.kv.reserved == 0
        assert n.drained()


@pytest.mark.parametrize("name", ["evolving", "dynamo"])
def test_the_directory_holds_what_the_nodes_say(name: str) -> None:
    trace = cc_trace(agents=6, duration=600, seed=7)
    cluster = Cluster(trace, tight(duration=700, seed=3), policy(name, 4))
    cluster.run()
    d = cluster.directory
    stats = d.stats()
    assert sum(n.kv.l1_held for n in cluster.nodes) == stats["locations_l1"]
    assert sum(n.kv.l2_held for n in cluster.nodes) == stats["locations_l2"]
    # Every block the cluster saw is a block of some prompt of the trace (a response's blocks
    # are the next prompt's): their chains, recorded here, give each leaf's path.
    chains, hasher = BlockParents(), PromptHasher(trace)
    for agent in trace.agents:
        for branch in agent.branches:
            for r in branch.requests:
                chains.register(hasher.hashes(agent, branch, r))
    pos = chains.pos
    checked = 0
    for n in cluster.nodes:
        for leaf in d.eviction_order(n.id, "L1"):
            # Every block a node holds in L1 lies on the path to one of its leaves; the whole
            # path (from the first page) is held there: L1 stays prefix-closed.
            arr, i = pos[leaf]
            chain = [int(h) for h in arr[: i + 1]]
            assert d.match(chain).nodes[n.id][0] == len(chain)
            checked += 1
    assert checked > 0
    # Per node, the counts are exact: clearing a node's tier removes exactly what it counted.
    for n in cluster.nodes:
        for tier, held in (("L1", n.kv.l1_held), ("L2", n.kv.l2_held)):
            before = d.stats()[f"locations_{tier.lower()}"]
            d.clear(n.id, tier)  # type: ignore[arg-type]
            assert before - d.stats()[f"locations_{tier.lower()}"] == held


def test_best_static_reports_the_best_split() -> None:
    trace = cc_trace(agents=3, duration=300, seed=5)
    config = SimConfig(gpus=12, duration=600)
    out = compare(trace, config, [BEST_STATIC, "static:1P2D"])
    best = out["policies"][BEST_STATIC]
    splits = best["splits"]
    assert set(splits) == {"1P2D", "2P1D"}
    assert best["throughput_tokens_per_s"] == max(splits.values())
    assert splits["1P2D"] == out["policies"]["static:1P2D"]["throughput_tokens_per_s"]
    assert set(out["runtime"]) == {"static:1P2D", "static:2P1D"}


def test_policy_specs() -> None:
    assert policy("static:3P5D", 8).split == Split(3, 5)
    with pytest.raises(ValueError, match="not a split"):
        policy("static:3P4D", 8)
    with pytest.raises(ValueError, match="unknown policy"):
        policy("nope", 8)
    spec = static(Split(1, 1))
    with pytest.raises(ValueError, match="branch_counts"):
        PolicySpec("bad", spec.router, None, "lru", True, False, True)


@pytest.mark.parametrize(
    ("name", "base"),
    [
        ("static", "evolving"),
        ("dynamo-static", "dynamo"),
        ("dynamo-hicache-static", "dynamo-hicache"),
        ("arrow-static", "arrow"),
    ],
)
def test_a_static_split_keeps_its_infrastructure_and_drops_its_planner(
    name: str, base: str
) -> None:
    spec, of = policy(f"{name}:3P5D", 8), policy(base, 8)
    assert spec.name == f"{name}:3P5D"
    assert spec.split == Split(3, 5)
    assert (spec.eviction, spec.shared_pool, spec.prefetch, spec.admission) == (
        of.eviction, of.shared_pool, of.prefetch, of.admission
    )  # fmt: skip
    assert spec.router is of.router
    if name != "static":  # ours runs a StaticPlanner; theirs none
        assert spec.planner is None
    with pytest.raises(ValueError, match="not a split"):
        policy(f"{name}:3P4D", 8)


def test_oversized_requests_are_rejected_not_lost() -> None:
    # A GPU with barely more memory than the weights: the longer prompts cannot fit a node.
    from evolving_infra.timing.specs import LLAMA3_70B, Deployment, GpuSpec

    small = GpuSpec("small", 989.4e12, 3.35e12, 46e9, 450e9)
    config = SimConfig(gpus=8, deployment=Deployment(LLAMA3_70B, small, 4), duration=600)
    trace = cc_trace(agents=2, duration=300, seed=1)
    cluster = Cluster(trace, config, policy("arrow", 2))
    cluster.run()
    m = cluster.metrics
    assert m.rejected > 0
    assert m.issued == m.completed + m.rejected + len(in_system(cluster))


def test_sampling_without_node_samples_adds_the_same_sums() -> None:
    trace = cc_trace(agents=6, duration=300, seed=7)
    cluster = Cluster(trace, tight(duration=200, seed=3), policy("evolving", 4))
    a, b = Slices(600.0), Slices(600.0)

    def check() -> None:
        a.sample(node_samples(cluster.nodes))
        sample_nodes(b, cluster.nodes)

    cluster.run(check=check)
    assert a.samples > 0
    assert a.context_sum > 0
    assert vars(a) == vars(b)  # every sum equal, to the last bit


def test_dynamo_hicache_is_dynamo_with_a_shared_tier_its_router_credits() -> None:
    base, hicache = policy("dynamo", 8), policy("dynamo-hicache", 8)
    assert hicache.planner is base.planner
    assert (hicache.eviction, hicache.prefetch, hicache.admission) == ("lru", False, False)
    assert (base.shared_pool, hicache.shared_pool) == (False, True)
    ctx = PolicyContext(8, 16, SimConfig(gpus=32), IterationModel())
    router = hicache.router(ctx)
    assert isinstance(router, DynamoRouter)
    assert router.count_shared_cache
    assert router.shared_cache_multiplier == 0.5
    plain = base.router(ctx)
    assert isinstance(plain, DynamoRouter)
    assert not plain.count_shared_cache


def test_the_planners_window_counts_think_times_and_answers_as_a_router_sees_them() -> None:
    """The closed loop the evolving planner prices (`planner/throughput.closed_loop_rate`):
    each request after a branch's first arrives its trace `wait` after the branch's previous
    answer (OSWorld has no joins), and every answer is counted with its TTFT and end."""
    trace = generate("osworld", SlotPlan(agents=3, duration=200, seed=2))
    cluster = Cluster(trace, SimConfig(gpus=16, seed=2), policy("evolving", 4))
    assert cluster.run() < cluster.slices.window_s  # the window holds the whole run
    window = list(cluster.slices.window)
    assert cluster.slices.think_n == 0  # the run ends with the last answer, not an arrival
    waits = [r.wait for a in trace.agents for b in a.branches for r in b.requests[1:]]
    assert sum(s.think_requests for s in window) == len(waits) > 0
    assert sum(s.think_s * s.think_requests for s in window) == pytest.approx(sum(waits))
    m = cluster.metrics
    assert sum(s.answered for s in window) + cluster.slices.answered_n == m.completed
    answered = [s for s in window if s.answered]
    assert answered
    assert all(0.0 < s.ttft_s <= s.response_s for s in answered)
