"""`shift-step`: Putnam for the first third of the run, then Claude Code sessions (the `cc`
generator): a mix whose best split moves by several nodes (issue 25, item 3).

`shift` (Putnam to OSWorld, linear) does not shift on either deployment the simulator models:
both ends want few prefill nodes. Here the ends want opposite things. On the paper's deployment
(Kimi K2 on 4 x GB300 per node, 200-250 agents), Putnam's eight long forks want 1P8D (6P3D
serves 45% less) and Claude Code's long, mostly cached prompts want 6P3D (1P8D serves 93% less).
Putnam's phase is the shorter because its sessions make ten times Claude Code's output tokens:
with equal phases, a split good for Putnam alone would be the best static split too. The
choice of a third is the scenario's, not a measurement (docs/scenarios.md, "a shift that
shifts", has the per-phase sweeps).
"""

from __future__ import annotations

from evolving_infra.workloads.generators import shift
from evolving_infra.workloads.generators.common import SlotPlan
from evolving_infra.workloads.model import Trace

NAME = "shift-step"
PARAMS = shift.Params(start={"putnam": 1.0}, end={"cc": 1.0}, shape="step", step_at=1 / 3)


def generate(plan: SlotPlan, params: shift.Params | None = None) -> Trace:
    return shift.generate(plan, params or PARAMS)
