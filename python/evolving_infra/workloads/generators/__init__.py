"""Seeded workload generators: one module per workload, each `generate(plan, params) -> Trace`.

`putnam` (math proving), `osworld` (computer use), `cc_like` (Claude Code sessions fitted to the
real traces) and `shift` (a mix whose composition changes over time). Each module documents its
parameters and their sources; `common` holds the agent builder and slot filling they share.
"""

from evolving_infra.workloads.generators.common import (
    AgentBuilder,
    BranchBuilder,
    SlotPlan,
    fill_slots,
)

__all__ = ["AgentBuilder", "BranchBuilder", "SlotPlan", "fill_slots"]
