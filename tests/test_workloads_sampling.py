"""N concurrent agents drawn from a trace set: each drawn session a copy in its own namespace."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from evolving_infra.cli import main
from evolving_infra.workloads import (
    PromptHasher,
    Trace,
    bundled_trace_dir,
    claude_code_trace,
    find_trace_files,
    load_conversations,
    load_trace,
    validate,
)
from evolving_infra.workloads.errors import WorkloadError
from evolving_infra.workloads.generators import SlotPlan
from evolving_infra.workloads.sampling import sample_agents
from evolving_infra.workloads.timeline import agent_timeline


@pytest.fixture(scope="module")
def source() -> Trace:
    files = find_trace_files([bundled_trace_dir()])
    # The six smallest conversations keep the test fast; the rules do not depend on size.
    small = sorted(files, key=lambda p: p.stat().st_size)[:6]
    return claude_code_trace(load_conversations(small))


def test_drawn_sessions_are_copies_of_source_agents_in_own_namespaces(source: Trace) -> None:
    plan = SlotPlan(agents=5, duration=7200.0, seed=3)
    out = sample_agents(source, plan)
    validate(out)
    by_branches = {a.branches: a for a in source.agents}
    assert all(a.branches in by_branches for a in out.agents)
    assert len({a.namespace for a in out.agents}) == len(out.agents)
    slots = Counter(a.id.split(".")[0] for a in out.agents)
    assert sorted(slots) == [str(k) for k in range(5)]
    # Back to back: each slot's first session starts in the ramp, the next ones follow it.
    for a in out.agents:
        first = a.id.endswith(".0")
        assert (a.follows is None) == first
        if first:
            assert 0 <= a.start < 720.0
        else:
            assert a.follows == f"{a.id.split('.')[0]}.{int(a.id.split('.')[1]) - 1}"


def test_slots_stop_starting_sessions_after_the_duration(source: Trace) -> None:
    plan = SlotPlan(agents=3, duration=3600.0, seed=1)
    out = sample_agents(source, plan)
    ends: dict[str, float] = {}
    for a in out.agents:
        slot = a.id.split(".")[0]
        start = a.start if a.follows is None else ends[slot]
        assert start < plan.duration
        ends[slot] = max(x.done for x in agent_timeline(a, start))


def test_copies_of_one_session_share_no_block(source: Trace) -> None:
    out = sample_agents(source, SlotPlan(agents=12, duration=600.0, seed=0))
    drawn = Counter(a.branches for a in out.agents)
    twice = [b for b, n in drawn.items() if n >= 2]
    assert twice, "12 draws from 6 sessions repeat one (pigeonhole)"
    copies = [a for a in out.agents if a.branches == twice[0]]
    hasher = PromptHasher(out)
    seen = [
        {h for a2, b, _, r in out.requests() if a2 is a for h in hasher.hashes(a, b, r)}
        for a in copies[:2]
    ]
    assert seen[0]
    assert not seen[0] & seen[1]


def test_seeded(source: Trace) -> None:
    plan = SlotPlan(agents=4, duration=1800.0, seed=7)
    assert sample_agents(source, plan) == sample_agents(source, plan)
    other = sample_agents(source, SlotPlan(agents=4, duration=1800.0, seed=8))
    assert other != sample_agents(source, plan)


def test_bad_plans_are_typed_errors(source: Trace) -> None:
    with pytest.raises(WorkloadError):
        sample_agents(source, SlotPlan(agents=0, duration=10.0, seed=0))
    empty = Trace(name="empty", block_size=64, agents=())
    with pytest.raises(WorkloadError, match="no agents"):
        sample_agents(empty, SlotPlan(agents=1, duration=10.0, seed=0))


def test_cli_samples_raw_claude_code_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = sorted(find_trace_files([bundled_trace_dir()]), key=lambda p: p.stat().st_size)[:3]
    out = tmp_path / "s.jsonl.gz"
    args = ["trace", "sample", *map(str, small), "--agents", "4", "--duration", "900"]
    assert main([*args, "-o", str(out)]) == 0
    trace = load_trace(out)
    assert len({a.namespace for a in trace.agents}) == len(trace.agents) >= 4
    assert main(["trace", "stats", str(out), "--json"]) == 0
    printed = capsys.readouterr().out
    total = json.loads(printed[printed.index("{") :])["total"]
    assert total["requests"] == trace.request_count
