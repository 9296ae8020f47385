"""What every generator shares: building an agent turn by turn, and filling agent slots.

A generator describes one *session* (an agent from its first request to its end) by driving an
`AgentBuilder`; `fill_slots` runs N slots of back-to-back sessions for a duration, which is what
"N concurrent agents" means in a closed-loop trace. Every session has its own block namespace.
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

from evolving_infra.workloads.errors import WorkloadError
from evolving_infra.workloads.model import (
    Agent,
    AgentId,
    BlockId,
    BlockIds,
    Branch,
    BranchId,
    BranchKind,
    Request,
    Trace,
    validate,
)
from evolving_infra.workloads.timeline import agent_timeline


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A lognormal quantity with the given median, clipped to [lo, hi].

    A draw is `median * exp(sigma * z)` for a standard normal z, then clipped; `sigma` is the
    standard deviation of its logarithm. A generator's parameters hold one per drawn quantity.
    """

    median: float
    sigma: float
    lo: float
    hi: float

    def __post_init__(self) -> None:
        if not (self.sigma >= 0 and self.lo <= self.median <= self.hi):
            raise ValueError(f"need sigma >= 0 and lo <= median <= hi, got {self}")

    def draw(self, rng: random.Random) -> float:
        """One draw (one `rng.gauss`)."""
        return min(self.hi, max(self.lo, self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))))

    def ints(self, rng: random.Random) -> int:
        """One draw, rounded: a count of tokens, steps, ..."""
        return round(self.draw(rng))


@dataclass(slots=True)
class _Turn:
    wait: float
    prompt_tokens: int
    output_tokens: int
    # The prompt's own blocks: the first `blocks` of `ids` (the branch's list of ids at the
    # time, which later turns may extend but never change; see `BranchBuilder`).
    ids: list[BlockId]
    blocks: int
    shared: int
    join: tuple[BranchId, ...]
    context_blocks: int = 0  # own full blocks once the response is in (the first of `ids`)


@dataclass(slots=True)
class BranchBuilder:
    """One branch's context as it grows: tokens, and the ids of its full blocks.

    The context is the last prompt plus its response; a request appends `new_tokens` (a tool
    result, a screenshot, the user's next message) to it. Block ids are minted when a block
    becomes full, so a block keeps its id as long as the tokens before it do not change.

    NOTE: `blocks` is only ever appended to; a compaction starts a new list. Each turn records
    the list and its length, and `AgentBuilder.build` makes every request a `BlockIds` view of
    one array per list, instead of a tuple per request (memory: the blocks a branch mints, not
    the sum of its prompts).
    """

    id: BranchId
    kind: BranchKind
    parent: BranchId | None
    after: int | None
    delay: float
    owner: AgentBuilder
    context_tokens: int = 0
    shared: int = 0  # leading blocks of the agent's shared prefix in the context
    blocks: list[BlockId] = field(default_factory=list)  # own full blocks of the context
    turns: list[_Turn] = field(default_factory=list)

    def _fill(self, tokens: int) -> None:
        """The context is now `tokens` long: mint ids for the blocks that became full."""
        bs = self.owner.block_size
        new = tokens // bs - self.shared - len(self.blocks)
        if new > 0:
            self.blocks.extend(self.owner.fresh_run(new))
        self.context_tokens = tokens

    def request(
        self,
        wait: float,
        new_tokens: int,
        output_tokens: int,
        *,
        join: tuple[BranchId, ...] = (),
    ) -> int:
        """Sends context + `new_tokens`; the response then joins the context. Returns its index."""
        prompt = self.context_tokens + new_tokens
        self._fill(prompt)
        turn = _Turn(wait, prompt, output_tokens, self.blocks, len(self.blocks), self.shared, join)
        self._fill(prompt + output_tokens)
        turn.context_blocks = len(self.blocks)
        self.turns.append(turn)
        return len(self.turns) - 1

    def compact(self, keep_tokens: int, summary_tokens: int) -> None:
        """The next prompt keeps the first `keep_tokens` of the context, then a fresh summary."""
        keep_tokens = min(keep_tokens, self.context_tokens)
        bs = self.owner.block_size
        keep_blocks = max(0, keep_tokens // bs - self.shared)
        self.blocks = self.blocks[:keep_blocks]  # a new list: earlier turns keep theirs
        # The summary starts a new chain after the kept blocks: the partial block in between is
        # rewritten, so its tokens are dropped from the kept part.
        self.context_tokens = (self.shared + keep_blocks) * bs
        self._fill(self.context_tokens + summary_tokens)
        self.owner.compactions.add((self.id, len(self.turns)))


@dataclass(slots=True)
class AgentBuilder:
    """One session's agent: its branches and a counter minting ids in its own namespace."""

    id: AgentId
    workload: str
    block_size: int
    start: float = 0.0
    follows: AgentId | None = None
    prefix: str | None = None
    prefix_blocks: int = 0
    branches: list[BranchBuilder] = field(default_factory=list)
    compactions: set[tuple[BranchId, int]] = field(default_factory=set)
    _next_id: int = 0

    def fresh(self) -> BlockId:
        self._next_id += 1
        return BlockId(self._next_id)

    def fresh_run(self, n: int) -> Iterable[BlockId]:
        """`n` fresh ids, as `n` calls of `fresh` would mint them."""
        first = self._next_id + 1
        self._next_id += n
        return cast(Iterable[BlockId], range(first, first + n))

    def root(self, delay: float = 0.0) -> BranchBuilder:
        assert not self.branches, "the root is the first branch"
        b = BranchBuilder(BranchId("main"), BranchKind.ROOT, None, None, delay, self)
        if self.prefix is not None:
            b.shared = self.prefix_blocks
            b.context_tokens = self.prefix_blocks * self.block_size
        self.branches.append(b)
        return b

    def subagent(self, parent: BranchBuilder, after: int | None, delay: float) -> BranchBuilder:
        """A sub-agent: its own context (system prompt and task), spawned by the parent."""
        b = BranchBuilder(
            BranchId(f"{parent.id}/s{len(self.branches)}"),
            BranchKind.SUBAGENT,
            parent.id,
            after,
            delay,
            self,
        )
        self.branches.append(b)
        return b

    def fork(self, parent: BranchBuilder, after: int, delay: float = 0.0) -> BranchBuilder:
        """A fork: starts from the parent's context right after its request `after`."""
        t = parent.turns[after]
        b = BranchBuilder(
            BranchId(f"{parent.id}/f{len(self.branches)}"),
            BranchKind.FORK,
            parent.id,
            after,
            delay,
            self,
            shared=t.shared,
        )
        # The parent's context right after that response, with the same block ids.
        b.blocks = t.ids[: t.context_blocks]
        b.context_tokens = t.prompt_tokens + t.output_tokens
        self.branches.append(b)
        return b

    def build(self) -> Agent:
        branches = []
        views = _Views()
        for b in self.branches:
            if not b.turns:
                continue
            n = len(b.turns)
            requests = tuple(
                Request(
                    wait=t.wait,
                    prompt_tokens=t.prompt_tokens,
                    output_tokens=t.output_tokens,
                    blocks=views.of(t.ids, t.blocks),
                    shared=t.shared,
                    join=t.join,
                    compaction=(b.id, i) in self.compactions,
                    end=i == n - 1,
                )
                for i, t in enumerate(b.turns)
            )
            branches.append(Branch(b.id, b.kind, b.parent, b.after, b.delay, requests))
        return Agent(
            id=self.id,
            workload=self.workload,
            namespace=str(self.id),
            branches=tuple(branches),
            start=self.start,
            follows=self.follows,
            prefix=self.prefix,
        )


class _Views:
    """`BlockIds` views of the builder's id lists, one array per list."""

    def __init__(self) -> None:
        self._bases: dict[int, array[int]] = {}
        self._keep: list[list[BlockId]] = []  # the lists whose ids key `_bases`

    def of(self, ids: list[BlockId], n: int) -> BlockIds:
        base = self._bases.get(id(ids))
        if base is None:
            base = self._bases[id(ids)] = array("q", ids)
            self._keep.append(ids)
        return BlockIds(base, n)


Session = Callable[[random.Random, AgentBuilder, float], None]
"""Fills a builder with one session; the float is the session's nominal start (for mixes)."""


@dataclass(frozen=True, slots=True)
class SlotPlan:
    agents: int  # concurrent slots
    duration: float  # seconds of the run; a slot is filled with sessions for its nominal time
    seed: int
    ramp: float | None = None  # slots start uniformly over [0, ramp); None: min(60 s, duration/10)
    # A phase of a longer run: its slots start `begin` seconds later (over [begin, begin + ramp)),
    # their sessions carry `until` (none starts after it, in served time: `Agent.until`), and
    # `phase` prefixes their ids and seeds (phases of one trace neither collide nor share draws).
    begin: float = 0.0
    until: float | None = None
    phase: str = ""
    # Slots are filled for `fill` times their nominal time (from `begin` to the duration): > 1
    # where serving may be faster than nominal and the run must not run out of sessions.
    fill: float = 1.0


def slot_agents(
    plan: SlotPlan,
    draw: Callable[[random.Random, AgentId, float, AgentId | None], Agent],
    salt: str = "",
) -> list[Agent]:
    """The agents of `plan.agents` slots, each running sessions back to back.

    `draw(rng, id, t, follows)` makes the session that starts at nominal time t (its `start`
    and `follows` as given); a slot stops starting sessions once t passes `begin` + `fill` x
    (duration - `begin`). A phase's `until` bounds served time, not nominal time: its slots
    are filled just the same, so that a split faster than nominal does not run out of
    sessions before it.
    """
    if plan.agents <= 0 or plan.duration <= 0:
        raise WorkloadError("agents and duration must be > 0")
    if not 0 <= plan.begin < plan.duration:
        raise WorkloadError(f"a phase begins in [0, duration), got {plan.begin}")
    if not plan.fill >= 1:
        raise WorkloadError(f"slots are filled for at least their duration, got fill={plan.fill}")
    end = plan.begin + plan.fill * (plan.duration - plan.begin)
    ramp = min(60.0, plan.duration / 10) if plan.ramp is None else plan.ramp
    agents: list[Agent] = []
    for slot in range(plan.agents):
        # One generator per slot: adding slots does not change the sessions of the others.
        rng = random.Random(f"{plan.seed}/{salt}{plan.phase}{slot}")
        t = plan.begin + rng.uniform(0.0, ramp)
        follows: AgentId | None = None
        k = 0
        while t < end:
            agent = draw(rng, AgentId(f"{plan.phase}{slot}.{k}"), t, follows)
            t = max((x.done for x in agent_timeline(agent, t)), default=t)
            if plan.until is not None:
                agent = replace(agent, until=plan.until)
            agents.append(agent)
            follows = agent.id
            k += 1
    return agents


def system_prefix(name: str, system_tokens: int, shared: bool, block_size: int) -> dict[str, int]:
    """A generator's trace prefixes: its system prompt's full blocks as prefix `name`, when
    the prompt is shared across sessions (and has a full block)."""
    blocks = system_tokens // block_size
    return {name: blocks} if shared and blocks else {}


def one_workload(
    plan: SlotPlan,
    name: str,
    session: Session,
    prefixes: Mapping[str, int],
    meta: Mapping[str, Any],
    block_size: int,
) -> Trace:
    """`fill_slots` for a generator of one workload, with at most one shared prefix."""
    assert len(prefixes) <= 1, "one workload, one shared prefix at most"
    prefix = next(iter(prefixes), None)
    return fill_slots(
        plan,
        workload=lambda _rng, _t: name,
        session=lambda _name: session,
        block_size=block_size,
        name=name,
        prefixes=prefixes,
        prefix_of=lambda _name: prefix,
        meta={"generator": name, "seed": plan.seed, **meta},
    )


def fill_slots(
    plan: SlotPlan,
    workload: Callable[[random.Random, float], str],
    session: Callable[[str], Session],
    block_size: int,
    *,
    name: str,
    prefixes: Mapping[str, int] | None = None,
    prefix_of: Callable[[str], str | None] = lambda _: None,
    meta: Mapping[str, Any] | None = None,
) -> Trace:
    """N slots, each running sessions back to back until its nominal time passes the duration.

    `workload(rng, t)` names the workload of a session starting at nominal time t; `session(name)`
    is that workload's session function. Slot k's sessions are agents `k.0`, `k.1`, ..., each
    following the previous one with no pause.
    """
    shared = dict(prefixes or {})

    def draw(rng: random.Random, agent: AgentId, t: float, follows: AgentId | None) -> Agent:
        name_w = workload(rng, t)
        prefix = prefix_of(name_w)
        builder = AgentBuilder(
            id=agent,
            workload=name_w,
            block_size=block_size,
            start=t if follows is None else 0.0,
            follows=follows,
            prefix=prefix,
            prefix_blocks=shared.get(prefix, 0) if prefix else 0,
        )
        session(name_w)(rng, builder, t)
        return builder.build()

    agents = slot_agents(plan, draw)
    prefixes = shared
    trace = Trace(
        name=name,
        block_size=block_size,
        agents=tuple(agents),
        prefixes=prefixes,
        meta=dict(meta or {}),
    )
    validate(trace)
    return trace
