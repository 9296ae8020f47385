"""The ablations (`sim.policies.ABLATIONS`): `evolving` with exactly one mechanism switched off.

Each must differ from `evolving` in that mechanism alone (else the table of what a mechanism is
worth measures two things at once), and the mechanism must really be off in a run.
"""

from __future__ import annotations

import dataclasses

import pytest

from evolving_infra.planner.base import Split
from evolving_infra.routing.dynamo import DynamoRouter
from evolving_infra.routing.evolving import EvolvingRouter
from evolving_infra.sim.cluster import Cluster
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.policies import ABLATIONS, EVOLVING, PolicyContext, policy
from evolving_infra.timing.model import IterationModel
from evolving_infra.workloads.generators import SlotPlan, generate

# What each ablation changes of `evolving`'s spec (the planner's switch mode is the planner's).
CHANGED = {
    "evolving-lru": {"eviction", "branch_counts"},
    "evolving-dynamo-cost": {"router"},
    "evolving-no-pool": {"shared_pool", "prefetch"},
    "evolving-drop": {"planner"},
    "evolving-fixed": {"planner"},
}


def fields(spec: object) -> dict[str, object]:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ABLATIONS, ids=lambda s: s.name)
def test_an_ablation_changes_one_mechanism_of_evolving(spec: object) -> None:
    mine, base = fields(spec), fields(EVOLVING)
    changed = {k for k in mine if k != "name" and mine[k] != base[k]}
    assert changed == CHANGED[mine["name"]]  # type: ignore[index]
    assert policy(mine["name"], 9) is spec  # type: ignore[arg-type]


def test_what_the_ablated_parts_are() -> None:
    ctx = PolicyContext(9, 16, SimConfig(gpus=36), IterationModel())
    by_name = {s.name: s for s in ABLATIONS}
    assert isinstance(EVOLVING.router(ctx), EvolvingRouter)
    router = by_name["evolving-dynamo-cost"].router(ctx)
    assert isinstance(router, DynamoRouter)
    assert router.count_shared_cache
    assert EVOLVING.planner is not None
    assert EVOLVING.planner(ctx).switch_mode == "in-place-keep"
    drop = by_name["evolving-drop"].planner
    assert drop is not None
    assert drop(ctx).switch_mode == "in-place-drop"
    assert EVOLVING.planner(ctx).switch_mode == "in-place-keep"  # the class is untouched
    assert by_name["evolving-fixed"].planner is None


def test_in_a_run_the_ablated_mechanism_is_off() -> None:
    trace = generate("cc", SlotPlan(agents=10, duration=600, seed=3))
    # A start split far from the best, so that the planner moves (evolving-fixed must not).
    config = SimConfig(
        gpus=16, duration=700, seed=1, initial_split=Split(3, 1), planner_interval=30.0
    )
    runs = {}
    for name in ("evolving", "evolving-fixed", "evolving-no-pool", "evolving-drop"):
        cluster = Cluster(trace, config, policy(name, config.nodes))
        cluster.run()
        runs[name] = cluster
    moved = runs["evolving"].switcher
    assert moved is not None
    assert moved.log
    fixed = runs["evolving-fixed"]
    assert fixed.switcher is None or not fixed.switcher.log
    assert str(fixed.switcher.split() if fixed.switcher else Split(3, 1)) == "3P1D"
    drop = runs["evolving-drop"].switcher
    assert drop is not None
    assert drop.mode == "in-place-drop"
    assert drop.log
    assert moved.mode == "in-place-keep"
    # Without the pool a node reads only its own tiers and fetches nothing ahead.
    assert all(not n.s.shared_pool and not n.s.prefetch for n in runs["evolving-no-pool"].nodes)
    assert all(n.s.shared_pool and n.s.prefetch for n in runs["evolving"].nodes)
