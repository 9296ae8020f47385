"""Phase-split planners: how many nodes prefill and how many decode (pure decisions).

`PLANNERS` maps each adaptive planner's name to a factory of the cluster's node count;
`make_planner` builds any of them, `static:xPyD` included.
"""

from collections.abc import Callable

from evolving_infra.planner.arrow import ArrowPlanner
from evolving_infra.planner.base import Planner, SliceStats, Split, SwitchMode
from evolving_infra.planner.dynamo import DynamoPlanner
from evolving_infra.planner.evolving import Evaluation, EvolvingPlanner
from evolving_infra.planner.static import StaticPlanner, parse_split

PlannerFactory = Callable[[int], Planner]

PLANNERS: dict[str, PlannerFactory] = {
    "evolving": lambda nodes: EvolvingPlanner(nodes),
    "dynamo": lambda nodes: DynamoPlanner(),
    "dynamo-load": lambda nodes: DynamoPlanner(mode="load"),
    "arrow": lambda nodes: ArrowPlanner(),
}


def make_planner(name: str, nodes_total: int) -> Planner:
    """The planner called `name` (`evolving`, `dynamo`, `dynamo-load`, `arrow` or `static:xPyD`)."""
    if name.startswith("static:"):
        split = parse_split(name.removeprefix("static:"))
        if split.prefill + split.decode != nodes_total:
            raise ValueError(f"{name} does not split {nodes_total} nodes")
        return StaticPlanner(split)
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r} (one of {sorted(PLANNERS)} or static:xPyD)")
    return PLANNERS[name](nodes_total)


__all__ = [
    "PLANNERS",
    "ArrowPlanner",
    "DynamoPlanner",
    "Evaluation",
    "EvolvingPlanner",
    "Planner",
    "PlannerFactory",
    "SliceStats",
    "Split",
    "StaticPlanner",
    "SwitchMode",
    "make_planner",
    "parse_split",
]
