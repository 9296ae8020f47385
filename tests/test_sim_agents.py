"""The simulator's closed loop: requests become ready exactly when the trace model says.

Two checks: with a fixed service time the replay reproduces `timeline.trace_timeline` (the
nominal replay the generators and h* use); on the real cluster, every request is issued exactly
`wait` after the latest of its branch's previous response, its joins' ends, its branch's start
(the parent's response + delay) and, for an agent that follows another, that agent's end.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import pytest

from evolving_infra.nodemodel.request import SimRequest
from evolving_infra.planner.base import Split
from evolving_infra.sim.agents import AgentReplay
from evolving_infra.sim.cluster import Cluster
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.policies import static
from evolving_infra.workloads.generators import SlotPlan, generate
from evolving_infra.workloads.model import (
    Agent,
    AgentId,
    BlockId,
    Branch,
    BranchId,
    BranchKind,
    Request,
    Trace,
    validate,
)
from evolving_infra.workloads.timeline import nominal_service, trace_timeline

BS = 16


def req(
    wait: float,
    ids: Sequence[int],
    out: int,
    join: tuple[str, ...] = (),
    end: bool = False,
) -> Request:
    return Request(
        wait=wait,
        prompt_tokens=len(ids) * BS + 3,  # a partial last page, never cached
        output_tokens=out,
        blocks=tuple(BlockId(i) for i in ids),
        join=tuple(BranchId(j) for j in join),
        end=end,
    )


def branch(
    bid: str,
    kind: BranchKind,
    requests: Sequence[Request],
    parent: str | None = None,
    after: int | None = None,
    delay: float = 0.0,
) -> Branch:
    return Branch(
        id=BranchId(bid),
        kind=kind,
        parent=BranchId(parent) if parent else None,
        after=after,
        delay=delay,
        requests=tuple(requests),
    )


def small_trace() -> Trace:
    """Agent a: a root that spawns a sub-agent after its first response and joins it, and a
    fork after its second; agent b follows a; agent c runs alongside."""
    base = list(range(40))
    root = branch(
        "main",
        BranchKind.ROOT,
        [
            req(0.0, base[:10], 60),
            req(2.0, base[:16], 40, join=("sub",)),
            req(1.0, base[:24], 30, end=True),
        ],
    )
    sub = branch(
        "sub",
        BranchKind.SUBAGENT,
        [req(0.0, [100, 101, 102], 20), req(3.0, [100, 101, 102, 103, 104], 20, end=True)],
        parent="main",
        after=0,
        delay=0.5,
    )
    fork = branch(
        "fork",
        BranchKind.FORK,
        [req(0.0, [*base[:16], 200, 201], 25, end=True)],
        parent="main",
        after=1,
        delay=0.25,
    )
    a = Agent(AgentId("a"), "test", "ns-a", (root, sub, fork), start=1.0)
    b = Agent(
        AgentId("b"),
        "test",
        "ns-b",
        (
            branch(
                "main", BranchKind.ROOT, [req(0.0, [1, 2], 10), req(1.5, [1, 2, 3], 10, end=True)]
            ),
        ),
        start=2.0,
        follows=AgentId("a"),
    )
    c = Agent(
        AgentId("c"),
        "test",
        "ns-c",
        (branch("main", BranchKind.ROOT, [req(0.0, [7, 8, 9], 50, end=True)]),),
    )
    trace = Trace("hand-built", BS, (a, b, c))
    validate(trace)
    return trace


def fixed_service_replay(trace: Trace) -> dict[tuple[str, str, int], float]:
    """Issue times when every request takes `nominal_service` and nothing queues."""
    heap: list[tuple[float, int, str, Any]] = []
    seq = [0]

    def post(t: float, r: SimRequest) -> None:
        seq[0] += 1
        heapq.heappush(heap, (t, seq[0], "ready", r))

    replay = AgentReplay(trace, post)
    replay.start()
    issued: dict[tuple[str, str, int], float] = {}
    while heap:
        t, _, kind, r = heapq.heappop(heap)
        if kind == "ready":
            issued[(r.agent.id, r.branch.id, r.index)] = t
            seq[0] += 1
            heapq.heappush(heap, (t + nominal_service(r.spec), seq[0], "done", r))
        else:
            replay.complete(r, t)
    return issued


@pytest.mark.parametrize("which", ["hand-built", "cc", "osworld", "shift-step"])
def test_fixed_service_matches_the_nominal_timeline(which: str) -> None:
    trace = (
        small_trace()
        if which == "hand-built"
        else generate(which, SlotPlan(agents=3, duration=600, seed=3))
    )
    issued = fixed_service_replay(trace)
    expected = {(x.agent.id, x.branch, x.index): x.issued for x in trace_timeline(trace)}
    assert issued.keys() == expected.keys()
    for key, t in expected.items():
        assert issued[key] == pytest.approx(t, abs=1e-9), key


def test_an_agent_starting_after_its_until_is_skipped_and_its_follower_starts_then() -> None:
    """a ends at 1 + 10/10,000 + 5/40 s; b follows it but may start only until 0.5 s, so it is
    skipped; c follows b and starts 2 s after a's end (b's would-be start)."""
    one = (branch("main", BranchKind.ROOT, [req(0.0, [1], 5, end=True)]),)
    a = Agent(AgentId("a"), "test", "ns-a", one, start=1.0)
    b = Agent(AgentId("b"), "test", "ns-b", one, follows=AgentId("a"), until=0.5)
    c = Agent(AgentId("c"), "test", "ns-c", one, start=2.0, follows=AgentId("b"), until=9.0)
    trace = Trace("phases", BS, (a, b, c))
    validate(trace)
    a_end = 1.0 + nominal_service(a.root.requests[0])
    expected = {("a", "main", 0): 1.0, ("c", "main", 0): a_end + 2.0}
    assert {(x.agent.id, x.branch, x.index): x.issued for x in trace_timeline(trace)} == (
        pytest.approx(expected)
    )
    assert fixed_service_replay(trace) == pytest.approx(expected)
    replay = AgentReplay(trace, lambda _t, _r: None)
    replay.start()
    assert replay.skipped_agents == 0  # decided when a ends
    cluster = Cluster(trace, SimConfig(gpus=8, noise=0.0), static(Split(1, 1)))
    cluster.run()
    assert cluster.replay.skipped_agents == 1


def test_requests_wait_for_their_branch_joins_parents_and_followed_agents() -> None:
    trace = small_trace()
    cluster = Cluster(trace, SimConfig(gpus=8, noise=0.0), static(Split(1, 1)))
    seen: list[SimRequest] = []
    ready = cluster._ready

    def record(r: SimRequest) -> None:
        seen.append(r)
        ready(r)

    cluster._ready = record  # type: ignore[method-assign, assignment]
    cluster.run()
    assert len(seen) == trace.request_count
    done = {(r.agent.id, r.branch.id, r.index): r.done for r in seen}
    assert all(t > 0 for t in done.values())
    agents = {a.id: a for a in trace.agents}
    agent_end = {a: max(t for (x, _, _), t in done.items() if x == a) for a in agents}
    for r in seen:
        a, b, i = r.agent, r.branch, r.index
        if i > 0:
            prev = done[(a.id, b.id, i - 1)]
        elif b.parent is None:
            start = a.start + (agent_end[a.follows] if a.follows else 0.0)
            prev = start + b.delay
        else:
            assert b.after is not None  # this trace's children start after a response
            prev = done[(a.id, b.parent, b.after)] + b.delay
        ends = [
            max(done[(a.id, j, k)] for k in range(len(_branch(a, j).requests))) for j in r.spec.join
        ]
        assert r.issued == pytest.approx(max([prev, *ends]) + r.spec.wait, abs=1e-9), r
        assert r.done > r.first_token >= r.issued


def _branch(agent: Agent, bid: str) -> Branch:
    return next(b for b in agent.branches if b.id == bid)
