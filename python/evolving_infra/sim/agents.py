"""Closed-loop replay of a trace: when each request becomes ready, given when others completed.

The rules are the trace model's (`workloads/model.py`), resolved with real completion times
instead of `timeline.agent_timeline`'s nominal service: an agent starts at `Agent.start` (after
the agent it `follows` has finished, if any), unless that is after its `until` (then it is
skipped, and those following it start from then); its root branch begins `delay` after the agent
starts; any other branch begins `delay` after the response to its parent's request `after` (or
after the parent begins when `after` is None); request i of a branch is ready `wait` seconds
after the later of the branch's previous response (the first: the branch's beginning) and the
end of every branch it joins. With a fixed service time the replay reproduces
`timeline.trace_timeline` exactly (tests/test_sim_agents.py).

The replay hands each ready request to `post(time, request)` (the cluster's event queue) and
learns of its response through `complete(request, now)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from evolving_infra.nodemodel.request import SimRequest
from evolving_infra.workloads.blocks import PromptHasher
from evolving_infra.workloads.model import Agent, AgentId, Branch, BranchId, Trace


@dataclass(slots=True)
class _BranchState:
    branch: Branch
    begun: float | None = None
    ready: float = 0.0  # when the wait of its next request starts (before joins)
    next: int = 0  # index of its next request
    in_flight: bool = False
    ended: float | None = None
    peek: tuple[int, list[int]] | None = None  # hashes of a request computed ahead


@dataclass(slots=True)
class _AgentState:
    agent: Agent
    branches: dict[BranchId, _BranchState]
    children_after: dict[tuple[BranchId, int], list[Branch]] = field(default_factory=dict)
    children_at_start: dict[BranchId, list[Branch]] = field(default_factory=dict)
    join_waiters: dict[BranchId, list[BranchId]] = field(default_factory=dict)
    total: int = 0
    done: int = 0


Post = Callable[[float, SimRequest], None]


class AgentReplay:
    """The trace's agents, replayed against real completions."""

    def __init__(self, trace: Trace, post: Post) -> None:
        self.trace = trace
        self.hasher = PromptHasher(trace)
        self._post = post
        self._next_id = 0
        self._agents: dict[AgentId, _AgentState] = {}
        self._followers: dict[AgentId, list[Agent]] = {}
        for a in trace.agents:
            st = _AgentState(a, {b.id: _BranchState(b) for b in a.branches})
            for b in a.branches[1:]:
                assert b.parent is not None, "validated: only the root has no parent"
                if b.after is None:
                    st.children_at_start.setdefault(b.parent, []).append(b)
                else:
                    st.children_after.setdefault((b.parent, b.after), []).append(b)
            st.total = sum(len(b.requests) for b in a.branches)
            self._agents[a.id] = st
            if a.follows is not None:
                self._followers.setdefault(a.follows, []).append(a)
        self.finished_agents = 0
        self.skipped_agents = 0  # agents whose start fell after their `until`

    @property
    def issued_ids(self) -> int:
        """Requests handed out so far (ids are 0 .. issued_ids - 1)."""
        return self._next_id

    def start(self) -> None:
        """Posts the first requests of every agent that follows no other."""
        for a in self.trace.agents:
            if a.follows is None:
                self._start_agent(self._agents[a.id], a.start)

    def complete(self, req: SimRequest, now: float) -> bool:
        """The response to `req` arrived at `now`; posts what it unblocks. True when it ended
        its branch."""
        st = self._agents[req.agent.id]
        bs = st.branches[req.branch.id]
        assert bs.in_flight, f"{req} completed but none was in flight"
        assert bs.next == req.index, f"{req} completed out of turn"
        bs.in_flight = False
        bs.next += 1
        bs.ready = now
        for child in st.children_after.get((req.branch.id, req.index), ()):
            self._begin(st, st.branches[child.id], now + child.delay)
        ended = bs.next == len(bs.branch.requests)
        if ended:
            bs.ended = now
            for waiter in st.join_waiters.pop(req.branch.id, ()):
                self._advance(st, st.branches[waiter])
        else:
            self._advance(st, bs)
        st.done += 1
        if st.done == st.total:
            self.finished_agents += 1
            for f in self._followers.get(st.agent.id, ()):
                self._start_agent(self._agents[f.id], now + f.start)
        return ended

    def next_hashes(self, req: SimRequest) -> list[int] | None:
        """The prompt hashes of the branch's next request (None after its last): its leading
        blocks past `req`'s prompt are `req`'s response, which its decode node caches."""
        st = self._agents[req.agent.id]
        bs = st.branches[req.branch.id]
        i = req.index + 1
        if i >= len(bs.branch.requests):
            return None
        return self._hashes(st, bs, i)

    # -- internals ----------------------------------------------------------------------------

    def _start_agent(self, st: _AgentState, t: float) -> None:
        # A slot past its phase skips the rest of its chain: a loop, not recursion (a chain can
        # hold hundreds of sessions).
        pending = [(st, t)]
        while pending:
            st, t = pending.pop()
            if st.agent.until is not None and t > st.agent.until:
                self.skipped_agents += 1
                pending.extend(
                    (self._agents[f.id], t + f.start) for f in self._followers.get(st.agent.id, ())
                )
                continue
            root = st.agent.root
            self._begin(st, st.branches[root.id], t + root.delay)

    def _begin(self, st: _AgentState, bs: _BranchState, t: float) -> None:
        bs.begun = bs.ready = t
        for child in st.children_at_start.get(bs.branch.id, ()):
            self._begin(st, st.branches[child.id], t + child.delay)
        self._advance(st, bs)

    def _advance(self, st: _AgentState, bs: _BranchState) -> None:
        """Posts the branch's next request if its joins have all ended."""
        if bs.begun is None or bs.in_flight or bs.next >= len(bs.branch.requests):
            return
        r = bs.branch.requests[bs.next]
        t = bs.ready
        for j in r.join:
            end = st.branches[j].ended
            if end is None:
                # Re-examined when that branch ends (then the next unended join, if any).
                st.join_waiters.setdefault(j, []).append(bs.branch.id)
                return
            t = max(t, end)
        req = SimRequest(self._next_id, st.agent, bs.branch, bs.next, self._hashes(st, bs, bs.next))
        self._next_id += 1
        bs.in_flight = True
        self._post(t + r.wait, req)

    def _hashes(self, st: _AgentState, bs: _BranchState, index: int) -> list[int]:
        if bs.peek is not None and bs.peek[0] == index:
            return bs.peek[1]
        hashes: list[int] = list(self.hasher.hashes(st.agent, bs.branch, bs.branch.requests[index]))
        bs.peek = (index, hashes)
        return hashes
