"""Seeded workload generators, one module per workload.

`putnam` (math proving), `osworld` (computer use), `cc_like` (Claude Code sessions fitted to the
real traces), `shift` (a mix whose composition changes over time) and `shift_step` (Putnam, then
more OSWorld agents, in served time: a shift whose best split moves). Each module documents its
parameters and their sources and offers `session(params) -> Session` (one agent session on an
`AgentBuilder`) and `generate(plan, params=None) -> Trace`; `common` holds the builder and the
slot filling they share. `generate(name, plan)` runs one by its CLI name.
"""

from __future__ import annotations

import importlib

from evolving_infra.workloads.errors import WorkloadError
from evolving_infra.workloads.generators.common import (
    AgentBuilder,
    BranchBuilder,
    Session,
    SlotPlan,
    fill_slots,
)
from evolving_infra.workloads.model import Trace

# CLI name -> module (imported on use: a generator's fitted parameters load only when needed).
MODULES = {
    "putnam": "putnam",
    "osworld": "osworld",
    "cc": "cc_like",
    "shift": "shift",
    "shift-step": "shift_step",
}


def generate(name: str, plan: SlotPlan) -> Trace:
    """The trace of generator `name` (a key of MODULES) with its default parameters."""
    if name not in MODULES:
        raise WorkloadError(f"unknown generator {name!r} (known: {', '.join(MODULES)})")
    module = importlib.import_module(f"{__name__}.{MODULES[name]}")
    trace: Trace = module.generate(plan)
    return trace


__all__ = [
    "MODULES",
    "AgentBuilder",
    "BranchBuilder",
    "Session",
    "SlotPlan",
    "fill_slots",
    "generate",
]
