"""The `evolving` planner's settings as `NAME=VALUE` options (`--planner-option` of `sim`,
`scenario run`, `router` and `cluster up`, or a --config file's `planner-option = [...]`): what
a change to the planner's rule is tried with on the tuning grid before its code changes
(docs/scenarios.md, issue 25), and what an operator sets the live planner with."""

from __future__ import annotations

import argparse
import math
from typing import Any

# The EvolvingPlanner arguments an option may set, with their type (planner/evolving.py).
# Those that the driver decides (nodes, chunk tokens, KV capacity, early allocation, memory) are
# not options: they follow the simulated cluster.
TUNABLES: dict[str, type] = {
    "interval": float,
    "window_s": float,
    "slices": int,
    "alpha": float,
    "min_gain": float,
    "max_step": int,
    "min_slices": int,
    "recent": float,
    "shift_factor": float,
    "headroom": float,
    "wait_spread": float,
    "decode_exponent": float,
    "tie": float,
}

# Those whose default is None (off, or the whole gap): `none` sets them back to it.
OPTIONAL = frozenset({"max_step", "recent", "shift_factor", "headroom"})

Option = tuple[str, float | None]


def parse(text: str) -> Option:
    """'min_gain=0.04' -> ('min_gain', 0.04); ValueError naming what is wrong."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"expected NAME=VALUE, got {text!r}")
    _known(name)
    if name in OPTIONAL and value.strip().lower() == "none":
        return name, None
    try:
        number = float(value) if TUNABLES[name] is float else int(value)
    except ValueError:
        kind = "a number" if TUNABLES[name] is float else "an integer"
        raise ValueError(f"planner option {name} needs {kind}, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"planner option {name} must be finite, got {value!r}")
    return name, number


def check(options: tuple[Option, ...]) -> dict[str, Any]:
    """The options as keyword arguments; ValueError for an unknown or repeated name (values out
    of range: the planner's own checks, `SimConfig` builds one to run them)."""
    out: dict[str, Any] = {}  # Any: keyword arguments of several types (int, float, None)
    for name, value in options:
        _known(name)
        if name in out:
            raise ValueError(f"planner option {name} given twice")
        out[name] = value
    return out


def settings(options: tuple[Option, ...], nodes: int) -> dict[str, Any]:
    """`check`, then the planner's own checks of the values on `nodes` nodes (at least 2): what
    every command that takes the options runs before it starts anything; ValueError with the
    planner's reason."""
    from evolving_infra.planner.evolving import EvolvingPlanner  # evolving imports no option

    kw = check(options)
    EvolvingPlanner(max(nodes, 2), **kw)
    return kw


def _known(name: str) -> None:
    if name not in TUNABLES:
        raise ValueError(f"unknown planner option {name!r} (one of {', '.join(TUNABLES)})")


def add_argument(parser: argparse.ArgumentParser, *, without: dict[str, str] | None = None) -> None:
    """`--planner-option NAME=VALUE`, repeatable, into `args.planner_option` (a list; a --config
    file's `planner-option = ["NAME=VALUE", ...]`). `without`: names refused, each with what to
    use instead (the router's `interval` is its --planner-interval)."""
    refused = without or {}
    names = [n for n in TUNABLES if n not in refused]

    def option(text: str) -> Option:
        try:
            name, value = parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if name in refused:
            raise argparse.ArgumentTypeError(f"{name} is not an option here: {refused[name]}")
        return name, value

    parser.add_argument(
        "--planner-option",
        type=option,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set one of the evolving planner's settings, repeatable: "
        + ", ".join(names)
        + " (planner/evolving.py; `none` sets max_step, recent, shift_factor or headroom off)",
    )
