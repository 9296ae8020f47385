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

from evolving_infra.workloads.blocks import PromptHasher
from evolving_infra.workloads.model import Agent, AgentId, Branch, BranchId, Request, Trace


class SimRequest:
    """One request as it goes through the cluster: its prompt and every time and place it got.

    A plain slotted class rather than a dataclass: the simulator touches these fields on every
    event, and a request's node-side bookkeeping (pinned and reserved blocks per node) lives
    here so that releasing it cannot drift from what was taken.
    """

    __slots__ = (
        "agent",
        "bootstrapped",
        "branch",
        "cached_blocks",
        "context",
        "credit",
        "decode_node",
        "done",
        "fetch_ready",
        "first_token",
        "h_d",
        "hashes",
        "id",
        "index",
        "issued",
        "key",
        "left",
        "made",
        "out_hashes",
        "output_tokens",
        "pin_d",
        "pin_p",
        "pred_s",
        "prefetched",
        "prefill_done",
        "prefill_node",
        "prompt_tokens",
        "remaining",
        "res_d",
        "res_p",
        "spec",
        "uncached",
    )

    def __init__(
        self, rid: int, agent: Agent, branch: Branch, index: int, hashes: list[int]
    ) -> None:
        spec = branch.requests[index]
        self.id = rid
        self.agent = agent
        self.branch = branch
        self.index = index
        self.spec: Request = spec
        self.key = f"{agent.id}/{branch.id}"  # the directory's branch id
        self.hashes = hashes
        self.prompt_tokens = spec.prompt_tokens
        self.output_tokens = spec.output_tokens
        self.issued = -1.0  # when it became ready (-1: not yet)
        self.prefill_node = self.decode_node = -1
        # Prefill: cached prefix (blocks), uncached tokens, those still to compute, the
        # predicted seconds it added to its node's queue, when its fetched blocks are in L1.
        self.cached_blocks = 0
        self.uncached = self.remaining = 0
        self.pred_s = 0.0
        self.fetch_ready = 0.0
        self.prefetched = False
        # Early decode allocation: its decode node has reserved its KV (the prefill may run).
        self.bootstrapped = False
        # Blocks pinned and reserved on the prefill and decode nodes; the decode node's own
        # leading L1 blocks of the prompt when the transfer started.
        self.pin_p = self.res_p = self.pin_d = self.res_d = self.h_d = 0
        self.prefill_done = self.first_token = self.done = -1.0
        self.context = 0  # tokens of KV while decoding
        self.left = 0  # tokens still to decode
        self.credit = 0.0  # a fraction of a token gained (multi-token prediction)
        self.made = 0  # tokens the last decode span gave it
        self.out_hashes: list[int] = []

    def __repr__(self) -> str:
        return f"SimRequest({self.id}, {self.key}#{self.index})"


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
