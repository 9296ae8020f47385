"""Nominal replay: when each request of a trace would be issued if serving took a fixed time.

Closed-loop traces have no request times of their own: they depend on how fast the requests are
served. Generators (to size a session against `--duration`) and statistics (to order requests for
h*) use this nominal replay, where a request takes `prompt_tokens / NOMINAL_PREFILL_TPS +
output_tokens / NOMINAL_DECODE_TPS` seconds and nothing queues. The simulator replaces it with
real timing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from evolving_infra.workloads.model import Agent, AgentId, BranchId, Request, Trace

# NOTE: round figures of one request on a busy H100-class node: ~10k prompt tokens/s of prefill
# for one request in a batch, ~40 output tokens/s of decode (a batch of dozens shares the GPU).
# They size sessions and order requests; nothing measures performance with them.
NOMINAL_PREFILL_TPS = 10_000.0
NOMINAL_DECODE_TPS = 40.0

ServiceTime = Callable[[Request], float]


def nominal_service(r: Request) -> float:
    return r.prompt_tokens / NOMINAL_PREFILL_TPS + r.output_tokens / NOMINAL_DECODE_TPS


@dataclass(frozen=True, slots=True)
class Timed:
    """One request with its nominal issue and response times (seconds from the trace's start)."""

    agent: Agent
    branch: BranchId
    index: int
    request: Request
    issued: float
    done: float


def agent_timeline(
    agent: Agent, start: float, service: ServiceTime = nominal_service
) -> list[Timed]:
    """The agent's requests, timed from `start` (its own start, already resolved)."""
    out: list[Timed] = []
    begin: dict[BranchId, float] = {}  # when each branch started
    done: dict[tuple[BranchId, int], float] = {}  # response time of each request
    end: dict[BranchId, float] = {}
    ready: dict[BranchId, float] = {}  # when the branch's next request may start its wait
    nxt = {b.id: 0 for b in agent.branches}
    # Requests wait on their parent's responses and on joined branches: sweep until nothing
    # moves (each sweep resolves at least one request of a valid trace).
    progress = True
    while progress:
        progress = False
        for b in agent.branches:
            if b.id not in begin:
                if b.parent is None:
                    t0 = start + b.delay
                elif b.after is None and b.parent in begin:
                    t0 = begin[b.parent] + b.delay
                elif b.after is not None and (b.parent, b.after) in done:
                    t0 = done[(b.parent, b.after)] + b.delay
                else:
                    continue
                begin[b.id] = ready[b.id] = t0
            while nxt[b.id] < len(b.requests):
                i = nxt[b.id]
                r = b.requests[i]
                if any(j not in end for j in r.join):
                    break
                issued = max([ready[b.id], *(end[j] for j in r.join)]) + r.wait
                ready[b.id] = done[(b.id, i)] = issued + service(r)
                out.append(Timed(agent, b.id, i, r, issued, ready[b.id]))
                nxt[b.id] += 1
                progress = True
            if nxt[b.id] == len(b.requests):
                end[b.id] = ready[b.id]
    if len(out) < sum(len(b.requests) for b in agent.branches):
        raise ValueError(f"agent {agent.id!r}: requests wait on each other (circular joins)")
    return out


def trace_timeline(trace: Trace, service: ServiceTime = nominal_service) -> list[Timed]:
    """Every request of the trace, in nominal issue order (ties: agent, branch, request order)."""
    out: list[Timed] = []
    finished: dict[AgentId, float] = {}
    for a in trace.agents:
        start = a.start + (finished[a.follows] if a.follows is not None else 0.0)
        if a.until is not None and start > a.until:
            finished[a.id] = start  # skipped: its followers start from here (workloads/model.py)
            continue
        timed = agent_timeline(a, start, service)
        finished[a.id] = max((x.done for x in timed), default=start)
        out.extend(timed)
    order = {a.id: k for k, a in enumerate(trace.agents)}
    out.sort(key=lambda x: (x.issued, order[x.agent.id]))
    return out
