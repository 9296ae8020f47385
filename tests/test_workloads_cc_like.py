"""The Claude-Code-like generator: its committed fit, its traces, and their statistics."""

from __future__ import annotations

import dataclasses
import itertools
import random
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from evolving_infra.workloads import (
    Agent,
    BranchKind,
    Trace,
    bundled_trace_dir,
    claude_code_trace,
    find_trace_files,
    load_conversations,
    load_trace,
    save_trace,
    validate,
)
from evolving_infra.workloads.generators import SlotPlan
from evolving_infra.workloads.generators import generate as generate_by_name
from evolving_infra.workloads.generators.cc_fit import fit
from evolving_infra.workloads.generators.cc_like import (
    NAME,
    PARAMS_FILE,
    Params,
    generate,
    session,
)
from evolving_infra.workloads.generators.common import AgentBuilder
from evolving_infra.workloads.importers import CLAUDE_CODE_PREFIX
from evolving_infra.workloads.model import AgentId

# Enough sessions for medians within a few percent, generated in a few seconds.
SESSIONS = 400
# Generated medians must be within this share of the real traces' (the tables make them equal
# in distribution; what is left is sampling noise and, for growth, the sum of two draws).
TOLERANCE = 0.2


@pytest.fixture(scope="module")
def real() -> Trace:
    return claude_code_trace(load_conversations(find_trace_files([bundled_trace_dir()])))


@pytest.fixture(scope="module")
def params() -> Params:
    return Params.default()


@pytest.fixture(scope="module")
def small() -> Trace:
    return generate(SlotPlan(agents=4, duration=600, seed=1))


@pytest.fixture(scope="module")
def busy() -> Trace:
    """Slots that run several sessions, some with sub-agents."""
    return generate(SlotPlan(agents=12, duration=2400, seed=1))


def test_refit_reproduces_the_committed_params(real: Trace, params: Params) -> None:
    """A stale-data check: rerun `python -m evolving_infra.workloads.generators.cc_fit`."""
    refit = fit(real)
    assert refit.to_json() == PARAMS_FILE.read_text(encoding="utf-8")
    assert refit == params
    assert Params.from_json(refit.to_json()) == refit
    assert params.provenance["files"] == [p.name for p in find_trace_files([bundled_trace_dir()])]


def test_generated_trace_validates_and_round_trips(small: Trace, tmp_path: Path) -> None:
    validate(small)
    assert small.name == NAME
    assert small.block_size == 64
    assert {a.workload for a in small.agents} == {NAME}
    path = tmp_path / "cc.jsonl"
    save_trace(small, path)
    assert load_trace(path) == small


def test_registry_runs_it() -> None:
    plan = SlotPlan(agents=2, duration=300, seed=3)
    assert generate_by_name("cc", plan) == generate(plan)


def test_seeded(small: Trace) -> None:
    plan = SlotPlan(agents=4, duration=600, seed=1)
    assert generate(plan) == small
    other = generate(dataclasses.replace(plan, seed=2))
    assert [a.root.requests for a in other.agents] != [a.root.requests for a in small.agents]


def test_every_agent_has_its_own_namespace(busy: Trace) -> None:
    assert len(busy.agents) > len({a.id.split(".")[0] for a in busy.agents})  # slots reused
    assert [a.namespace for a in busy.agents] == [a.id for a in busy.agents]
    assert len({a.namespace for a in busy.agents}) == len(busy.agents)


def test_shared_prefix_option(params: Params) -> None:
    shared = dataclasses.replace(params, shared_prefix=True)
    trace = generate(SlotPlan(agents=2, duration=300, seed=4), shared)
    blocks = trace.prefixes[CLAUDE_CODE_PREFIX]
    assert blocks == 15_000 // 64
    for a in trace.agents:
        assert a.prefix == CLAUDE_CODE_PREFIX
        assert a.root.requests[0].shared == blocks
        assert all(r.shared == 0 for b in a.branches[1:] for r in b.requests)
    assert not generate(SlotPlan(agents=2, duration=300, seed=4)).prefixes


def _sessions(params: Params, n: int) -> Iterator[Agent]:
    """n sessions straight from the session function: validating and timing thousands of
    requests with their blocks would take most of the test's time."""
    run = session(params)
    rng = random.Random("cc-like-stats")
    for k in range(n):
        b = AgentBuilder(id=AgentId(str(k)), workload=NAME, block_size=64)
        run(rng, b, 0.0)
        yield b.build()


class _Stats:
    """The statistics the fit targets, over a trace's sessions."""

    def __init__(self, agents: Iterator[Agent] | tuple[Agent, ...]) -> None:
        self.turns: list[int] = []
        self.first: list[int] = []
        self.output: list[int] = []
        self.wait: list[float] = []
        self.growth: list[int] = []
        self.main_requests = self.compactions = self.with_subagents = 0
        for a in agents:
            rs = a.root.requests
            self.turns.append(len(rs))
            self.first.append(rs[0].prompt_tokens)
            self.output.extend(r.output_tokens for r in rs)
            self.main_requests += len(rs)
            self.compactions += sum(r.compaction for r in rs)
            self.with_subagents += any(b.kind is BranchKind.SUBAGENT for b in a.branches)
            for prev, r in itertools.pairwise(rs):
                self.wait.append(r.wait)
                if not r.compaction:
                    self.growth.append(r.prompt_tokens - prev.prompt_tokens)

    def medians(self) -> dict[str, float]:
        lists = ("turns", "first", "output", "wait", "growth")
        return {k: float(statistics.median(getattr(self, k))) for k in lists}

    @property
    def subagent_share(self) -> float:
        return self.with_subagents / len(self.turns)

    @property
    def compaction_rate(self) -> float:
        return self.compactions / self.main_requests


def test_generated_statistics_match_the_real_traces(real: Trace, params: Params) -> None:
    want = _Stats(real.agents)
    got = _Stats(_sessions(params, SESSIONS))
    for name, value in want.medians().items():
        assert got.medians()[name] == pytest.approx(value, rel=TOLERANCE), name
    # 11 of 24 real sessions spawn sub-agents; a sample of 400 is within a few points of that.
    assert abs(got.subagent_share - want.subagent_share) < 0.1
    # 82 compactions in 2,748 real main requests (3.0%), most in the few long sessions.
    assert 0.5 * want.compaction_rate < got.compaction_rate < 1.5 * want.compaction_rate


def test_subagents_are_joined_by_the_next_request(busy: Trace) -> None:
    subs = [(a, b) for a in busy.agents for b in a.branches if b.kind is BranchKind.SUBAGENT]
    assert subs, "the plan should spawn sub-agents"
    for a, b in subs:
        assert b.parent == a.root.id
        assert b.after is not None
        joins = [i for i, r in enumerate(a.root.requests) if b.id in r.join]
        assert joins in ([b.after + 1], [])  # [] for a group in the background
