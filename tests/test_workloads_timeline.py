"""Nominal replay order: exact issue times of a hand-built agent with a fork, a sub-agent and a
join, and of agents that follow each other."""

from __future__ import annotations

import pytest

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
from evolving_infra.workloads.timeline import (
    NOMINAL_DECODE_TPS,
    NOMINAL_PREFILL_TPS,
    agent_timeline,
    trace_timeline,
)

# One block of prefill is exactly 1 s, each 40 output tokens exactly 1 s: times stay exact.
BLOCK = 10_000
assert BLOCK / NOMINAL_PREFILL_TPS == 1.0
assert NOMINAL_DECODE_TPS == 40.0

ROOT, SUB, FORK = BranchId("root"), BranchId("sub"), BranchId("fork")


def req(
    wait: float,
    output_tokens: int,
    *,
    prompt: bool = True,
    join: tuple[BranchId, ...] = (),
    end: bool = False,
) -> Request:
    blocks = (BlockId(1),) if prompt else ()
    return Request(wait, BLOCK * len(blocks), output_tokens, blocks, join=join, end=end)


def agent(name: str, start: float = 0.0, follows: str | None = None) -> Agent:
    root = Branch(
        ROOT,
        BranchKind.ROOT,
        delay=0.5,
        requests=(
            req(0.0, 40),  # 1 s prefill + 1 s decode
            req(1.0, 40, join=(SUB,), end=True),  # after the sub-agent's end, then 1 s
        ),
    )
    sub = Branch(
        SUB,
        BranchKind.SUBAGENT,
        parent=ROOT,
        after=0,
        delay=0.25,
        requests=(req(0.0, 80, prompt=False), req(0.5, 40, prompt=False, end=True)),
    )
    fork = Branch(FORK, BranchKind.FORK, parent=ROOT, after=0, requests=(req(1.0, 40, end=True),))
    return Agent(
        AgentId(name),
        "test",
        name,
        (root, sub, fork),
        start=start,
        follows=AgentId(follows) if follows else None,
    )


def test_agent_with_a_fork_a_subagent_and_a_join() -> None:
    a = agent("a")
    validate(Trace("t", BLOCK, (a,)))
    timed = agent_timeline(a, start=2.0)
    got = [(x.branch, x.index, x.issued, x.done) for x in timed]
    # root[0]: start 2 + delay 0.5, 2 s of service. The sub-agent starts 0.25 s after that
    # response (4.75), the fork right at it (4.5) and waits 1 s. root[1] waits for the
    # sub-agent's end (8.25), then 1 s.
    assert sorted(got, key=lambda g: g[2]) == [
        (ROOT, 0, 2.5, 4.5),
        (SUB, 0, 4.75, 6.75),
        (FORK, 0, 5.5, 7.5),
        (SUB, 1, 7.25, 8.25),
        (ROOT, 1, 9.25, 11.25),
    ]


def test_trace_order_follows_and_ties() -> None:
    first = agent("a", start=2.0)
    single = Branch(ROOT, BranchKind.ROOT, requests=(req(0, 40, end=True),))
    tied = Agent(AgentId("b"), "test", "b", (single,), start=2.5)
    after = agent("c", start=1.0, follows="a")  # starts 1 s after a's last response (11.25)
    trace = Trace("t", BLOCK, (first, tied, after))
    validate(trace)
    got = [(x.agent.id, x.branch, x.index, x.issued) for x in trace_timeline(trace)]
    assert got == [
        ("a", ROOT, 0, 2.5),
        ("b", ROOT, 0, 2.5),  # a tie: the agent listed first goes first
        ("a", SUB, 0, 4.75),
        ("a", FORK, 0, 5.5),
        ("a", SUB, 1, 7.25),
        ("a", ROOT, 1, 9.25),
        ("c", ROOT, 0, 12.75),
        ("c", SUB, 0, 15.0),
        ("c", FORK, 0, 15.75),
        ("c", SUB, 1, 17.5),
        ("c", ROOT, 1, 19.5),
    ]


def test_custom_service_time() -> None:
    timed = agent_timeline(agent("a"), start=0.0, service=lambda r: 0.0)
    assert sorted((x.issued, x.branch, x.index) for x in timed) == [
        (0.5, ROOT, 0),
        (0.75, SUB, 0),
        (1.25, SUB, 1),
        (1.5, FORK, 0),
        (2.25, ROOT, 1),
    ]


def test_circular_joins_raise() -> None:
    root = Branch(ROOT, BranchKind.ROOT, requests=(req(0, 40, join=(SUB,), end=True),))
    sub = Branch(
        SUB, BranchKind.SUBAGENT, parent=ROOT, requests=(req(0, 40, join=(ROOT,), end=True),)
    )
    with pytest.raises(ValueError, match="circular"):
        agent_timeline(Agent(AgentId("x"), "test", "x", (root, sub)), start=0.0)
