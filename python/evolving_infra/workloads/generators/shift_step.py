"""`shift-step`: Putnam for the first quarter of the run, then OSWorld with 1.5 times the agents:
a mix whose best split moves by three nodes (issue 25, item 3).

`shift` (Putnam to OSWorld, linear, 60 agents) does not shift on either deployment the simulator
models: both ends load the cluster lightly and want few prefill nodes. Here both phases saturate
the paper's deployment (Kimi K2 on 4 x GB300 per node, 200 Putnam agents then 300 OSWorld ones):
Putnam's eight long forks want 1P8D (4P5D serves 26% less in its phase), OSWorld's screenshots
want 4P5D (1P8D serves 80% less). The step is in served time (`shift.Params.shape`): Putnam's
slots start no session after 15 minutes, whatever a split made of them. Putnam's phase is the
shorter because its sessions make six times OSWorld's output tokens per second: with equal
phases, a split good for Putnam alone would be the best static split too. A quarter is the
scenario's choice, not a measurement (docs/scenarios.md, "a shift that shifts", has the sweeps).
"""

from __future__ import annotations

from evolving_infra.workloads.generators import shift
from evolving_infra.workloads.generators.common import SlotPlan
from evolving_infra.workloads.model import Trace

NAME = "shift-step"
PARAMS = shift.Params(
    start={"putnam": 1.0}, end={"osworld": 1.0}, shape="step", step_at=0.25, after_agents=1.5
)


def generate(plan: SlotPlan, params: shift.Params | None = None) -> Trace:
    return shift.generate(plan, params or PARAMS)
