"""N concurrent agents drawn from a trace set: slots of back-to-back sessions sampled from it.

Each slot draws sessions (agents of the source trace, uniformly, with replacement) and runs them
one after another until its nominal time (`timeline`) passes the duration, exactly as the
generators' `fill_slots` does. Every drawn session gets its own block namespace
(`<namespace>@<slot>.<k>`), so two copies of one real session never share KV except through a
declared shared prefix: the cluster sees N different agents, not one agent N times.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from evolving_infra.workloads.errors import WorkloadError
from evolving_infra.workloads.generators.common import SlotPlan, slot_agents
from evolving_infra.workloads.model import Agent, AgentId, Trace, validate


def sample_agents(source: Trace, plan: SlotPlan, *, name: str | None = None) -> Trace:
    """`plan.agents` slots of sessions drawn from `source` for `plan.duration` nominal seconds."""
    if not source.agents:
        raise WorkloadError(f"trace {source.name!r} has no agents to draw from")

    def draw(rng: random.Random, agent: AgentId, t: float, follows: AgentId | None) -> Agent:
        drawn = source.agents[rng.randrange(len(source.agents))]
        return replace(
            drawn,
            id=agent,
            namespace=f"{drawn.namespace}@{agent}",
            start=t if follows is None else 0.0,
            follows=follows,
            until=None,  # the source's phases are not the sample's
        )

    agents = slot_agents(plan, draw, salt="sample/")
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


def load_pool(paths: Sequence[Path]) -> Trace:
    """One trace of every agent in the given files and folders (trace files, raw Claude Code
    files, Mooncake traces), to draw sessions from; they must share one block size."""
    from evolving_infra.workloads import stats  # stats reads every format; it imports us not
    from evolving_infra.workloads.importers import claude_code_trace

    files = stats.find_files(paths)
    if not files:
        raise FileNotFoundError(f"no trace files in {', '.join(map(str, paths))}")
    traces = []
    for path in files:
        _, loaded = stats.load_file(path)
        traces.append(loaded if isinstance(loaded, Trace) else claude_code_trace([loaded]))
    sizes = {t.block_size for t in traces}
    if len(sizes) > 1:
        raise WorkloadError(f"cannot draw from traces of different block sizes {sorted(sizes)}")
    return Trace(
        name="+".join(sorted({t.name for t in traces})),
        block_size=sizes.pop(),
        # Ids may repeat across files; every drawn session is renamed, so that is harmless.
        agents=tuple(a for t in traces for a in t.agents),
        prefixes={k: v for t in traces for k, v in t.prefixes.items()},
    )
