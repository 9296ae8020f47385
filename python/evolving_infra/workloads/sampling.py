"""N concurrent agents drawn from a trace set: slots of back-to-back sessions sampled from it.

Each slot draws sessions (agents of the source trace, uniformly, with replacement) and runs them
one after another until its nominal time (`timeline`) passes the duration, exactly as the
generators' `fill_slots` does. Every drawn session gets its own block namespace
(`<namespace>@<slot>.<k>`), so two copies of one real session never share KV except through a
declared shared prefix: the cluster sees N different agents, not one agent N times.
"""

from __future__ import annotations

import random
from dataclasses import replace

from evolving_infra.workloads.errors import WorkloadError
from evolving_infra.workloads.generators.common import SlotPlan
from evolving_infra.workloads.model import Agent, AgentId, Trace, validate
from evolving_infra.workloads.timeline import agent_timeline


def sample_agents(source: Trace, plan: SlotPlan, *, name: str | None = None) -> Trace:
    """`plan.agents` slots of sessions drawn from `source` for `plan.duration` nominal seconds."""
    if plan.agents <= 0 or plan.duration <= 0:
        raise WorkloadError("agents and duration must be > 0")
    if not source.agents:
        raise WorkloadError(f"trace {source.name!r} has no agents to draw from")
    ramp = min(60.0, plan.duration / 10) if plan.ramp is None else plan.ramp
    agents: list[Agent] = []
    for slot in range(plan.agents):
        # One generator per slot, as in fill_slots: adding slots keeps the others' draws.
        rng = random.Random(f"{plan.seed}/sample/{slot}")
        t = rng.uniform(0.0, ramp)
        follows: AgentId | None = None
        k = 0
        while t < plan.duration:
            drawn = source.agents[rng.randrange(len(source.agents))]
            agent = replace(
                drawn,
                id=AgentId(f"{slot}.{k}"),
                namespace=f"{drawn.namespace}@{slot}.{k}",
                start=t if follows is None else 0.0,
                follows=follows,
            )
            timed = agent_timeline(agent, t)
            t = max((x.done for x in timed), default=t)
            agents.append(agent)
            follows = agent.id
            k += 1
    trace = Trace(
        name=name or f"{source.name}-sampled",
        block_size=source.block_size,
        agents=tuple(agents),
        prefixes=dict(source.prefixes),
        meta={
            "sampled_from": source.name,
            "source_meta": dict(source.meta),
            "agents": plan.agents,
            "duration": plan.duration,
            "seed": plan.seed,
        },
    )
    validate(trace)
    return trace
