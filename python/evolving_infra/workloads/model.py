"""The trace model: agents own branches, a branch is a sequence of LLM requests.

Replay is closed-loop. An agent starts at `Agent.start` (seconds from the trace's start, or after
the agent it `follows` has finished: one slot running sessions back to back); one whose start falls
after its `Agent.until` (seconds from the trace's start) does not run, and counts as finished at
that start for those that follow it (a phase of a workload that ends at a given time, whatever
the serving speed). Its root branch
starts with it; any other branch is spawned by its parent: `Branch.delay` seconds after the
response to the parent's request number `Branch.after` (or after the parent's own start when
`after` is None). A request is issued `Request.wait` seconds after the previous response of its
branch (the first one: after the branch starts) and after every branch in `Request.join` has
ended (a parent waiting for its sub-agents' results). A branch ends with the response to its last
request (`Request.end`).

Prompts are chains of blocks of `Trace.block_size` tokens. A request's prompt is `shared` leading
blocks of its agent's shared prefix (`Agent.prefix`, sized in `Trace.prefixes`: e.g. the system
and tool prompt every Claude Code session starts with) followed by `blocks`, ids in the agent's
`namespace`. Ids only name blocks *given their prefix*: the KV identity of block i is the whole
chain up to i (see `blocks.PromptHasher`), so agents with different namespaces never share a block
unless through a shared prefix, and agents given the same namespace (Mooncake's global ids) do.

Branch kinds: `root` (one per agent), `subagent` (its own context: a new system prompt) and
`fork` (starts from its parent's context at the spawning request). A `compaction` request's prompt
diverges early from its branch's previous one (the history was summarised and replaced).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import islice
from typing import Any, NewType, overload

AgentId = NewType("AgentId", str)
BranchId = NewType("BranchId", str)
BlockId = NewType("BlockId", int)

FORMAT = "evolving-infra-trace"
FORMAT_VERSION = 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1  # block ids and hashes are signed 64-bit


class BlockIds(Sequence[BlockId]):
    """The first `n` ids of `base`: a request's blocks as a view of its branch's context.

    A branch's prompts extend one another until a compaction, so a generator keeps one array per
    stretch between compactions and every request a view of it: memory grows with the blocks a
    branch mints, not with the sum of its prompts (the 8,533-agent scenario's trace took ~17 GB
    as a tuple per request; a Claude-Code-like request has ~1,800 blocks). It behaves as the
    tuple it stands for: equal to an equal tuple (and hashes as one), a slice is a tuple, and it
    pickles as its array and length, the array once per pickle however many views share it.
    """

    __slots__ = ("base", "n")

    def __init__(self, base: array[int], n: int) -> None:
        assert 0 <= n <= len(base), "a view within its base"
        self.base = base
        self.n = n

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> BlockId: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[BlockId, ...]: ...
    def __getitem__(self, i: int | slice) -> BlockId | tuple[BlockId, ...]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self.n)
            return tuple(self.base[start:stop:step])  # type: ignore[arg-type]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError("block index out of range")
        return BlockId(self.base[i])

    def __iter__(self) -> Iterator[BlockId]:
        return islice(self.base, self.n)  # type: ignore[arg-type]

    def shares_base(self, other: object) -> bool:
        """Whether `other` is a view of the same array (then the shorter is a prefix)."""
        return isinstance(other, BlockIds) and other.base is self.base

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockIds):
            if self.n != other.n:
                return False
            return other.base is self.base or self.base[: self.n] == other.base[: other.n]
        if isinstance(other, tuple):
            return len(other) == self.n and tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"BlockIds({tuple(self)!r})"

    def __reduce__(self) -> tuple[type[BlockIds], tuple[array[int], int]]:
        return BlockIds, (self.base, self.n)


Blocks = Sequence[BlockId]  # a tuple, or a `BlockIds` view


class BranchKind(StrEnum):
    ROOT = "root"
    SUBAGENT = "subagent"
    FORK = "fork"


@dataclass(frozen=True, slots=True)
class Request:
    """One LLM call of a branch."""

    wait: float  # seconds after the branch's previous response (first: after the branch starts)
    prompt_tokens: int
    output_tokens: int
    blocks: Blocks  # the prompt's blocks after the shared prefix (namespace ids)
    shared: int = 0  # leading blocks of the agent's shared prefix, before `blocks`
    join: tuple[BranchId, ...] = ()  # branches that must have ended before the wait starts
    compaction: bool = False  # the prompt diverges early from the branch's previous prompt
    end: bool = False  # the branch's last request

    @property
    def prompt_blocks(self) -> int:
        return self.shared + len(self.blocks)


@dataclass(frozen=True, slots=True)
class Branch:
    id: BranchId
    kind: BranchKind
    parent: BranchId | None = None  # None exactly for the root
    after: int | None = None  # the parent's request whose response spawns it (None: at its start)
    delay: float = 0.0  # seconds after that response (root: after the agent starts)
    requests: tuple[Request, ...] = ()


@dataclass(frozen=True, slots=True)
class Agent:
    id: AgentId
    workload: str  # "claude-code", "putnam", "osworld", "mooncake", ...
    namespace: str  # block ids are scoped to it (agents may share one on purpose)
    branches: tuple[Branch, ...]  # the root first; a parent before its children
    start: float = 0.0  # seconds from the trace's start, or after `follows` has finished
    follows: AgentId | None = None
    prefix: str | None = None  # name of the shared prefix its requests' `shared` blocks come from
    until: float | None = None  # it does not start after this time (seconds from trace start)

    @property
    def root(self) -> Branch:
        return self.branches[0]

    def requests(self) -> Iterator[tuple[Branch, int, Request]]:
        for b in self.branches:
            for i, r in enumerate(b.requests):
                yield b, i, r


@dataclass(frozen=True, slots=True)
class Trace:
    """A set of agents on one block size; `meta` says where it came from (source, seed, params)."""

    name: str
    block_size: int
    agents: tuple[Agent, ...]
    prefixes: Mapping[str, int] = field(default_factory=dict)  # shared prefix name -> blocks
    meta: Mapping[str, Any] = field(default_factory=dict)

    def requests(self) -> Iterator[tuple[Agent, Branch, int, Request]]:
        for a in self.agents:
            for b, i, r in a.requests():
                yield a, b, i, r

    @property
    def request_count(self) -> int:
        return sum(len(b.requests) for a in self.agents for b in a.branches)


class TraceError(ValueError):
    """A trace that breaks a rule of the model, with where: agent, branch and request index."""

    def __init__(
        self,
        field: str | None,
        reason: str,
        agent: AgentId | None = None,
        branch: BranchId | None = None,
        request: int | None = None,
    ) -> None:
        self.field = field
        self.reason = reason
        self.agent = agent
        self.branch = branch
        self.request = request
        parts = [f"agent {agent!r}"] if agent is not None else ["trace"]
        if branch is not None:
            parts.append(f"branch {branch!r}")
        if request is not None:
            parts.append(f"request {request}")
        where = ", ".join(parts)
        super().__init__(f"{where}: {field}: {reason}" if field else f"{where}: {reason}")


def validate(trace: Trace) -> None:
    """Checks every rule of the model; raises `TraceError` naming the agent, branch or request."""
    if trace.block_size <= 0:
        raise TraceError("block_size", f"expected an int > 0, got {trace.block_size}")
    for name, size in trace.prefixes.items():
        if size <= 0:
            raise TraceError(f"prefixes.{name}", f"expected an int > 0, got {size}")
    agents: set[AgentId] = set()
    for agent in trace.agents:
        _validate_agent(trace, agent, agents)
        agents.add(agent.id)


def _validate_agent(trace: Trace, agent: Agent, earlier: set[AgentId]) -> None:
    where: dict[str, Any] = {"agent": agent.id}
    if agent.id in earlier:
        raise TraceError("id", "duplicate agent id", **where)
    _check_time(agent.start, where, "start")
    if agent.until is not None:
        _check_time(agent.until, where, "until")
    if agent.follows is not None and agent.follows not in earlier:
        raise TraceError("follows", f"{agent.follows!r} is not an earlier agent", **where)
    if agent.prefix is not None and agent.prefix not in trace.prefixes:
        raise TraceError("prefix", f"{agent.prefix!r} is not a prefix of the trace", **where)
    if not agent.branches:
        raise TraceError("branches", "an agent has at least its root branch", **where)
    branches: dict[BranchId, Branch] = {}
    for k, b in enumerate(agent.branches):
        bw: dict[str, Any] = {"agent": agent.id, "branch": b.id}
        if b.id in branches:
            raise TraceError("id", "duplicate branch id", **bw)
        if (k == 0) != (b.kind is BranchKind.ROOT):
            raise TraceError("kind", "the first branch, and only it, is the root", **bw)
        if b.kind is BranchKind.ROOT:
            if b.parent is not None or b.after is not None:
                raise TraceError("parent", "a root branch has no parent", **bw)
        elif b.parent not in branches:
            raise TraceError("parent", f"{b.parent!r} is not an earlier branch of the agent", **bw)
        elif b.after is not None and not 0 <= b.after < len(branches[b.parent].requests):
            n = len(branches[b.parent].requests)
            raise TraceError(
                "after", f"{b.after} is not a request of its parent (it has {n})", **bw
            )
        _check_time(b.delay, bw, "delay")
        if not b.requests:
            raise TraceError("requests", "a branch has at least one request", **bw)
        if b.kind is BranchKind.FORK and b.after is None:
            raise TraceError("after", "a fork starts from one of its parent's requests", **bw)
        branches[b.id] = b
    for b in agent.branches:
        for i, r in enumerate(b.requests):
            _validate_request(trace, agent, branches, b, i, r)


def _validate_request(
    trace: Trace,
    agent: Agent,
    branches: Mapping[BranchId, Branch],
    b: Branch,
    i: int,
    r: Request,
) -> None:
    where: dict[str, Any] = {"agent": agent.id, "branch": b.id, "request": i}
    _check_time(r.wait, where, "wait")
    for name in ("prompt_tokens", "output_tokens"):
        if getattr(r, name) < 0:
            raise TraceError(name, f"expected an int >= 0, got {getattr(r, name)}", **where)
    if r.shared < 0:
        raise TraceError("shared", f"expected an int >= 0, got {r.shared}", **where)
    if r.shared:
        if agent.prefix is None:
            raise TraceError("shared", "the agent has no shared prefix", **where)
        if r.shared > trace.prefixes[agent.prefix]:
            size = trace.prefixes[agent.prefix]
            raise TraceError("shared", f"{r.shared} > the prefix's {size} blocks", **where)
    n, bs = r.prompt_blocks, trace.block_size
    # Full blocks only (Claude Code traces) or a partial last block too (Mooncake's).
    if n not in (r.prompt_tokens // bs, -(-r.prompt_tokens // bs)):
        reason = f"{r.prompt_tokens} tokens do not make {n} blocks of {bs}"
        raise TraceError("prompt_tokens", reason, **where)
    # A `BlockIds` holds signed 64-bit ints by construction (`array("q")`); a tuple is
    # checked with C-speed min/max first (tens of millions of ids at 3,072 GPUs).
    if (
        not isinstance(r.blocks, BlockIds)
        and r.blocks
        and not (min(r.blocks) >= I64_MIN and max(r.blocks) <= I64_MAX)
    ):
        for j, block in enumerate(r.blocks):
            if not I64_MIN <= block <= I64_MAX:
                raise TraceError(f"blocks[{j}]", f"{block} is outside signed 64-bit", **where)
    if r.end != (i == len(b.requests) - 1):
        raise TraceError("end", "exactly a branch's last request ends it", **where)
    for other in r.join:
        if other not in branches or other == b.id:
            raise TraceError("join", f"{other!r} is not another branch of the agent", **where)


def _check_time(value: float, where: dict[str, Any], name: str) -> None:
    if not math.isfinite(value) or value < 0:
        reason = f"expected a finite number of seconds >= 0, got {value}"
        raise TraceError(name, reason, **where)
