"""The Putnam, OSWorld and shifting-mix generators: valid, seeded, and true to their parameters."""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import random
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from evolving_infra.workloads import (
    BLOCK_SIZE,
    Agent,
    AgentId,
    BlockHash,
    BlockIds,
    Branch,
    BranchKind,
    PromptHasher,
    Request,
    Trace,
    generators,
    load_trace,
    save_trace,
    validate,
)
from evolving_infra.workloads.blocks import common_prefix
from evolving_infra.workloads.generators import SlotPlan, osworld, putnam, shift
from evolving_infra.workloads.generators.common import AgentBuilder, LogNormal
from evolving_infra.workloads.timeline import trace_timeline

Generate = Callable[[SlotPlan], Trace]
GENERATORS: dict[str, Generate] = {
    "putnam": putnam.generate,
    "osworld": osworld.generate,
    "shift": shift.generate,
}
SMALL = SlotPlan(agents=4, duration=900, seed=3)


@pytest.fixture(scope="module")
def putnam_trace() -> Trace:
    return putnam.generate(SlotPlan(agents=80, duration=3600, seed=1))


@pytest.fixture(scope="module")
def osworld_trace() -> Trace:
    return osworld.generate(SlotPlan(agents=30, duration=1800, seed=1))


def within(value: float, target: float, rel: float) -> bool:
    return abs(value - target) <= rel * target


def branch_requests(trace: Trace, kind: BranchKind) -> Iterator[tuple[Agent, Branch, Request]]:
    for a, b, _, r in trace.requests():
        if b.kind is kind:
            yield a, b, r


def new_tokens(agent: Agent) -> list[int]:
    """Per request: prompt tokens beyond the context it continues (its branch's last prompt and
    response, a fork's parent at the spawning request); the context itself is in the cache."""
    by_id = {b.id: b for b in agent.branches}
    out = []
    for b in agent.branches:
        if b.parent is not None and b.after is not None:
            base = by_id[b.parent].requests[b.after]
            context = base.prompt_tokens + base.output_tokens
        else:
            context = b.requests[0].shared * BLOCK_SIZE
        for r in b.requests:
            assert not r.compaction, "a compaction's context is not a prefix of its prompt"
            out.append(r.prompt_tokens - context)
            context = r.prompt_tokens + r.output_tokens
    return out


def session_starts(trace: Trace) -> dict[str, tuple[float, str]]:
    """Agent id -> (nominal start, workload): when its first request is issued."""
    first: dict[str, tuple[float, str]] = {}
    for x in trace_timeline(trace):
        first.setdefault(x.agent.id, (x.issued, x.agent.workload))
    return first


# ---- every generator ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GENERATORS))
@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.xz"])
def test_valid_and_round_trips(name: str, suffix: str, tmp_path: Path) -> None:
    trace = GENERATORS[name](SMALL)
    validate(trace)
    assert trace.agents
    assert trace.meta["generator"] == name
    assert trace.meta["seed"] == SMALL.seed
    path = tmp_path / f"trace{suffix}"
    save_trace(trace, path)
    assert load_trace(path) == trace


def test_phases_round_trip(tmp_path: Path) -> None:
    """A step's phases (`until`, later slot starts) survive the file format."""
    trace = shift.generate(SMALL, shift.Params(shape="step", step_at=0.4))
    assert any(a.until for a in trace.agents)
    save_trace(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == trace


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_seeded(name: str) -> None:
    generate = GENERATORS[name]
    assert generate(SMALL) == generate(SMALL)
    other = SlotPlan(agents=SMALL.agents, duration=SMALL.duration, seed=SMALL.seed + 1)
    assert generate(other).agents != generate(SMALL).agents


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_agents_share_blocks_only_through_prefixes(name: str) -> None:
    trace = GENERATORS[name](SMALL)
    assert len({a.namespace for a in trace.agents}) == len(trace.agents)
    hasher = PromptHasher(trace)
    own: dict[str, set[BlockHash]] = {}
    heads: dict[tuple[str | None, int], list[BlockHash]] = {}
    for a, b, _, r in trace.requests():
        hashes = hasher.hashes(a, b, r)
        own.setdefault(a.id, set()).update(hashes[r.shared :])
        head = heads.setdefault((a.prefix, r.shared), hashes[: r.shared])
        assert hashes[: r.shared] == head  # the same prefix blocks for every agent
    assert sum(len(s) for s in own.values()) == len(set().union(*own.values()))
    assert {a.prefix for a in trace.agents} <= set(trace.prefixes)


# ---- LogNormal ------------------------------------------------------------------------------


def test_lognormal_draws_around_its_median_within_its_clip() -> None:
    d = LogNormal(median=100.0, sigma=1.0, lo=20, hi=300)
    rng = random.Random(0)
    xs = [d.draw(rng) for _ in range(4000)]
    assert within(statistics.median(xs), d.median, 0.1)
    assert min(xs) == d.lo
    assert max(xs) == d.hi
    ns = [d.ints(random.Random(1)) for _ in range(3)]
    assert ns == [round(d.draw(random.Random(1)))] * 3
    assert all(isinstance(n, int) for n in ns)
    assert LogNormal(5.0, 0.0, 1.0, 9.0).draw(rng) == 5.0


@pytest.mark.parametrize(
    "args",
    [(10.0, -0.1, 1, 100), (0.5, 0.5, 1, 100), (200.0, 0.5, 1, 100), (10.0, float("nan"), 1, 100)],
)
def test_lognormal_rejects_bad_parameters(args: tuple[float, float, float, float]) -> None:
    with pytest.raises(ValueError, match="lo <= median <= hi"):
        LogNormal(*args)


def test_params_go_into_the_meta_as_nested_dicts() -> None:
    params = putnam.Params(sketch=LogNormal(median=1000.0, sigma=0.3, lo=100, hi=4000))
    meta = putnam.generate(SMALL, params).meta["params"]
    assert meta == dataclasses.asdict(params)
    assert meta["sketch"] == {"median": 1000.0, "sigma": 0.3, "lo": 100, "hi": 4000}


# ---- Putnam ---------------------------------------------------------------------------------


def test_putnam_forks_attempts(putnam_trace: Trace) -> None:
    p = putnam.Params()
    assert len(putnam_trace.agents) >= 200
    for a in putnam_trace.agents:
        assert a.workload == putnam.NAME
        assert a.prefix == putnam.PREFIX
        forks = a.branches[1:]
        assert len(forks) == p.attempts
        for f in forks:
            assert (f.kind, f.parent, f.after) == (BranchKind.FORK, a.root.id, 0)
            assert 1 <= len(f.requests) <= 1 + p.max_retries
        first, final = a.root.requests
        assert first.shared == putnam_trace.prefixes[putnam.PREFIX]
        assert set(final.join) == {f.id for f in forks}
    # A fork starts from its parent's context: the sketch's blocks are its prompt's first ones.
    a = putnam_trace.agents[0]
    sketch = a.root.requests[0]
    for f in a.branches[1:]:
        r = f.requests[0]
        assert r.prompt_tokens == sketch.prompt_tokens + sketch.output_tokens + 40
        assert common_prefix(sketch.blocks, r.blocks) == len(sketch.blocks)


def test_putnam_outputs_long_and_decode_heavy(putnam_trace: Trace) -> None:
    p = putnam.Params()
    outputs = [r.output_tokens for _, _, r in branch_requests(putnam_trace, BranchKind.FORK)]
    assert within(statistics.median(outputs), p.attempt_output.median, 0.15)
    assert min(outputs) >= p.attempt_output.lo >= 1000
    assert max(outputs) <= p.attempt_output.hi
    retried = [len(b.requests) for a in putnam_trace.agents for b in a.branches[1:]]
    # Each check passes with p_verified: a few attempts stop early, most use every retry.
    full = sum(n == 1 + p.max_retries for n in retried) / len(retried)
    assert within(full, (1 - p.p_verified) ** p.max_retries, 0.1)
    decode = sum(r.output_tokens for _, _, _, r in putnam_trace.requests())
    prefill = sum(sum(new_tokens(a)) for a in putnam_trace.agents)
    assert decode / prefill > 5


def test_putnam_without_shared_prefix() -> None:
    params = putnam.Params(shared_prefix=False, final_answer=False)
    trace = putnam.generate(SMALL, params)
    assert not trace.prefixes
    for a in trace.agents:
        assert a.prefix is None
        assert len(a.root.requests) == 1
        assert a.root.requests[0].prompt_tokens >= params.system_tokens + params.problem.lo


# ---- OSWorld --------------------------------------------------------------------------------


def test_osworld_turns_screenshots_and_waits(osworld_trace: Trace) -> None:
    p = osworld.Params()
    shot = osworld.screenshot_tokens(p)
    assert shot == 69 * 39  # 1920x1080 in 28-px tokens
    steps = []
    observations, waits, outputs = [], [], []
    for a in osworld_trace.agents:
        assert a.workload == osworld.NAME
        assert [b.kind for b in a.branches] == [BranchKind.ROOT]
        rs = a.root.requests
        steps.append(len(rs))
        outputs += [r.output_tokens for r in rs]
        assert rs[0].wait == 0.0
        for prev, r in itertools.pairwise(rs):
            waits.append(r.wait)
            # The prompt grows by the previous action and a screenshot with its text.
            observations.append(r.prompt_tokens - prev.prompt_tokens - prev.output_tokens - shot)
    assert len(steps) >= 100
    assert all(p.steps.lo <= n <= p.max_steps for n in steps)
    at_limit = sum(n == p.max_steps for n in steps) / len(steps)
    assert abs(at_limit - p.p_step_limit) < 0.1
    early = [n for n in steps if n < p.max_steps]
    assert within(statistics.median(early), p.steps.median, 0.2)
    assert p.observation.lo <= min(observations) <= max(observations) <= p.observation.hi
    assert within(statistics.median(observations), p.observation.median, 0.15)
    assert within(statistics.median(waits), p.action_wait.median, 0.15)
    assert p.action_wait.lo <= min(waits) <= max(waits) <= p.action_wait.hi
    assert within(statistics.median(outputs), p.output.median, 0.15)


def test_osworld_step_limit_caps_early_episodes() -> None:
    params = osworld.Params(max_steps=15, p_step_limit=0.0)
    trace = osworld.generate(SlotPlan(agents=10, duration=1800, seed=4), params)
    steps = [len(a.root.requests) for a in trace.agents]
    assert all(params.steps.lo <= n <= params.max_steps for n in steps)
    assert params.max_steps in steps  # lognormal draws past the limit are clipped to it


def test_osworld_screenshot_window_rewrites_the_window() -> None:
    k = 3
    params = osworld.Params(keep_screenshots=k)
    shot = osworld.screenshot_tokens(params)
    trace = osworld.generate(SlotPlan(agents=3, duration=600, seed=5), params)
    for a in trace.agents:
        rs = a.root.requests
        assert [r.compaction for r in rs] == [i >= k for i in range(len(rs))]
        for i in range(1, len(rs)):
            prev, r = rs[i - 1], rs[i]
            grown = r.prompt_tokens - prev.prompt_tokens - prev.output_tokens
            # Past the window a screenshot leaves for each one that comes in.
            lo, hi = params.observation.lo, params.observation.hi
            if i < k:
                lo, hi = lo + shot, hi + shot
            assert lo <= grown <= hi
            if i >= k:
                # The window's other screenshots are prefilled again.
                rewritten = len(r.blocks) - common_prefix(prev.blocks, r.blocks)
                assert rewritten * BLOCK_SIZE >= (k - 1) * shot


# ---- the shifting mix -----------------------------------------------------------------------


def test_mix_at() -> None:
    p = shift.Params()
    assert shift.mix_at(p, 0.0) == {"putnam": 1.0}
    assert shift.mix_at(p, 0.5) == {"osworld": 0.5, "putnam": 0.5}
    assert shift.mix_at(p, 2.0) == {"osworld": 1.0}
    step = shift.Params(shape="step", step_at=0.25)
    assert shift.mix_at(step, 0.2) == {"putnam": 1.0}
    assert shift.mix_at(step, 0.25) == {"osworld": 1.0}


def test_shift_linear_moves_from_putnam_to_osworld() -> None:
    plan = SlotPlan(agents=60, duration=3600, seed=0)
    trace = shift.generate(plan)
    assert set(trace.prefixes) == {putnam.PREFIX, osworld.PREFIX}
    prefix = {putnam.NAME: putnam.PREFIX, osworld.NAME: osworld.PREFIX}
    assert all(a.prefix == prefix[a.workload] for a in trace.agents)
    starts = session_starts(trace).values()

    def share(name: str, lo: float, hi: float) -> float:
        ws = [w for t, w in starts if lo * plan.duration <= t < hi * plan.duration]
        assert len(ws) >= 30
        return sum(w == name for w in ws) / len(ws)

    assert share(putnam.NAME, 0.0, 0.2) > 0.8
    assert share(putnam.NAME, 0.8, 1.0) < 0.25
    assert share(osworld.NAME, 0.0, 0.2) < 0.2
    assert share(osworld.NAME, 0.8, 1.0) > 0.75


def test_shift_step_is_two_phases_in_served_time() -> None:
    """The start mix's slots start no session after the step (`until`, served time), and
    `after_agents` times as many slots of the end mix start at it, filled to the duration."""
    plan = SlotPlan(agents=20, duration=1800, seed=2)
    trace = shift.generate(plan, shift.Params(shape="step", step_at=0.3, after_agents=1.5))
    switch = 0.3 * plan.duration
    before = [a for a in trace.agents if not a.id.startswith("b")]
    after = [a for a in trace.agents if a.id.startswith("b")]
    assert {a.workload for a in before} == {putnam.NAME}
    assert {a.until for a in before} == {switch}
    assert {a.workload for a in after} == {osworld.NAME}
    assert {a.until for a in after} == {None}
    firsts = [a for a in after if a.follows is None]
    assert len(firsts) == 30
    assert all(switch <= a.start < switch + 60 for a in firsts)
    starts = session_starts(trace)
    # Nominally, the Putnam phase stops at the step and OSWorld runs to the end.
    assert max(t for a, (t, _) in starts.items() if not a.startswith("b")) < switch + 60
    assert max(t for a, (t, _) in starts.items() if a.startswith("b")) > 0.9 * plan.duration
    # The first phase's slots are filled past the step (for a split faster than nominal): the
    # nominal replay skips those sessions.
    assert len(before) > sum(not a.startswith("b") for a in starts)


def test_shift_step_is_putnam_for_a_quarter_then_more_osworld() -> None:
    plan = SlotPlan(agents=20, duration=1800, seed=2)
    trace = generators.generate("shift-step", plan)
    putnam_slots = {a.id for a in trace.agents if a.follows is None and a.until == 450}
    osworld_slots = {a.id for a in trace.agents if a.follows is None and a.until is None}
    assert len(putnam_slots) == 20
    assert len(osworld_slots) == 30
    assert {a.workload for a in trace.agents if a.until == 450} == {putnam.NAME}
    assert {a.workload for a in trace.agents if a.until is None} == {osworld.NAME}


@pytest.mark.parametrize(
    "params",
    [
        shift.Params(start={"nope": 1.0}),
        shift.Params(end={"osworld": 0.0}),
        shift.Params(shape="cubic"),
        shift.Params(step_at=1.5),
        shift.Params(shape="step", after_agents=0.0),
    ],
)
def test_shift_rejects_bad_mixes(params: shift.Params) -> None:
    with pytest.raises(ValueError, match=r"."):
        shift.generate(SMALL, params)


def test_requests_are_views_of_one_array_per_context() -> None:
    """The builder's requests share their branch's ids (`BlockIds`) and behave as tuples."""
    b = AgentBuilder(AgentId("a"), "test", block_size=4)
    main = b.root()
    main.request(0.0, 9, 4)  # 2 blocks, then 3 once the response is in
    main.request(0.0, 8, 4)  # 5 blocks, then 6
    fork = b.fork(main, after=0)
    main.compact(keep_tokens=4, summary_tokens=8)  # keeps 1 block, then 2 fresh ones
    main.request(0.0, 0, 1)
    fork.request(0.0, 4, 1)
    agent = b.build()
    got = {br.id: [r.blocks for r in br.requests] for br in agent.branches}
    assert got == {"main": [(1, 2), (1, 2, 3, 4, 5), (1, 7, 8)], "main/f1": [(1, 2, 3, 9)]}
    r0, r1, r2 = agent.root.requests
    assert isinstance(r0.blocks, BlockIds)
    assert isinstance(r1.blocks, BlockIds)
    assert r0.blocks.shares_base(r1.blocks)  # one array for the prompts before the compaction
    assert not r1.blocks.shares_base(r2.blocks)
    assert common_prefix(r0.blocks, r1.blocks) == 2
    assert common_prefix(r1.blocks, r2.blocks) == 1
    assert r1.blocks[1:3] == (2, 3)
    assert r1.blocks[-1] == 5
    assert list(r1.blocks) == [1, 2, 3, 4, 5]
    assert hash(r1.blocks) == hash((1, 2, 3, 4, 5))
    assert r1.blocks != [1, 2, 3, 4, 5]  # as a tuple: never equal to a list
    with pytest.raises(IndexError):
        r1.blocks[5]
    # Pickled, the views keep sharing one array.
    a2 = pickle.loads(pickle.dumps(agent))
    s0, s1, _ = a2.root.requests
    assert s0.blocks == r0.blocks
    assert s1.blocks == r1.blocks
    assert isinstance(s0.blocks, BlockIds)
    assert s0.blocks.shares_base(s1.blocks)
