"""The cluster's routing index (`routing.index`) against the stateless path, on whole runs.

The simulator routes through a router's index, which hears only the nodes the cluster marks as
changed. Here every choice is also made the stateless way, from fresh views of every node
(`Cluster._loads`): the two must agree on each request, and the index's views must equal the
nodes' own, which catches a change the cluster forgot to mark.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from evolving_infra.planner.base import Split
from evolving_infra.routing.base import NodeLoad, Placement, RouteRequest
from evolving_infra.routing.index import LoadIndex
from evolving_infra.sim.cluster import Cluster
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.policies import policy, static
from evolving_infra.workloads.generators import SlotPlan, generate

T = TypeVar("T")


class Checked(LoadIndex):
    """Answers with the cluster's index after checking it against the stateless router."""

    def __init__(self, cluster: Cluster, inner: LoadIndex) -> None:
        super().__init__()
        self.cluster, self.inner = cluster, inner
        self.choices = 0

    def put(self, load: NodeLoad) -> None:
        self.inner.put(load)

    def accepting(self, phase: Any) -> int:
        n = self.inner.accepting(phase)
        assert n == sum(1 for x in self.cluster.nodes if x.accepting and x.phase == phase)
        return n

    def _views(self, phase: str) -> list[NodeLoad]:
        for n in self.cluster.nodes:  # Dynamo's load unit, kept as requests come and go
            bs = n.s.block_size
            if n.phase == "prefill" and n.state != "down":
                reqs = [*n.queue, *n.running, *n.held.values()]
                assert n.active_blocks == sum(-(-r.prompt_tokens // bs) for r in reqs)
            elif n.phase == "decode":
                reqs = [*n.batch, *n.joining, *n.waiting]
                # ... and the `inbound` ones, whose KV is in transfer (no list of them).
                assert n.active_blocks >= sum(-(-r.prompt_tokens // bs) for r in reqs)
        fresh = self.cluster._loads(phase)
        assert [x for x in fresh if x.accepting] == self.inner.members(phase)  # type: ignore[arg-type]
        return fresh

    def _both(self, stateless: Callable[[], T], indexed: Callable[[], T]) -> T:
        """Both answers, from the same random state when the router draws among ties (the
        index shares its router's generator): the same node and the same draws."""
        rng: random.Random | None = getattr(self.cluster.router, "rng", None)
        before = rng.getstate() if rng is not None else None
        want = stateless()
        after = rng.getstate() if rng is not None else None
        if rng is not None:
            rng.setstate(before)  # type: ignore[arg-type]
        assert indexed() == want
        assert (rng.getstate() if rng is not None else None) == after
        self.choices += 1
        return want

    def choose_prefill(self, request: RouteRequest) -> Placement:
        return self._both(
            lambda: self.cluster.router.choose_prefill(request, self._views("prefill")),
            lambda: self.inner.choose_prefill(request),
        )

    def choose_decode(self, request: RouteRequest) -> int:
        return self._both(
            lambda: self.cluster.router.choose_decode(request, self._views("decode")),
            lambda: self.inner.choose_decode(request),
        )


@pytest.mark.parametrize(
    ("name", "split"),
    [("evolving", None), ("dynamo", None), ("arrow", None), ("static", Split(2, 4))],
)
def test_every_choice_matches_the_stateless_router(name: str, split: Split | None) -> None:
    # 6 nodes, a tight KV and a start split far from the best: switches, drains, decode waits.
    trace = generate("cc", SlotPlan(agents=14, duration=900, seed=3))
    config = SimConfig(
        gpus=24,
        mem_fraction=0.7,
        host_memory_per_gpu=8 * 2**30,
        duration=1200,
        seed=2,
        initial_split=Split(4, 2),
        planner_interval=30.0,
    )
    spec = static(split) if split is not None else policy(name, config.nodes)
    cluster = Cluster(trace, config, spec)
    assert cluster.index is not None
    checked = Checked(cluster, cluster.index)
    cluster.index = checked
    cluster.run()
    assert checked.choices > 500
    if name in ("evolving", "arrow"):
        assert cluster.switcher is not None
        assert cluster.switcher.log, "no switch: membership changes went untested"
