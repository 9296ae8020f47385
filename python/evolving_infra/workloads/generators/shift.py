"""A shifting mix: sessions drawn from a mix that changes over the trace.

`shape = "linear"`: each slot's session starting at nominal time t is drawn from the mix `start`
+ (`end` - `start`) * t / duration. `shape = "step"`: two phases of slots. The `start` mix's
slots start no session after `step_at` * duration of *served* time (`Agent.until`), and
`after_agents` times as many slots of the `end` mix start then. A step in served time is what a
shift means to a control plane: a closed loop's slots that switched in nominal time would switch
only as their sessions end, and a slow split would push the first phase's fixed amount of work
into the second instead of serving less (docs/scenarios.md, "a shift that shifts").

The default goes from all Putnam (long, decode-heavy, forked) to all OSWorld (many turns, prefill
of screenshots): a control plane tuned for one should have to adapt to the other. Each session is
the named generator's own session, and its agent carries that workload's label (there is no
"shift" workload). Mix keys are generator CLI names: "putnam", "osworld" and "cc" (Claude Code
sessions, imported only when the mix names it).

This module has no `session`: which session runs is decided per slot and time by the mix.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from evolving_infra.workloads.claude_code import BLOCK_SIZE
from evolving_infra.workloads.generators import osworld, putnam
from evolving_infra.workloads.generators.common import Session, SlotPlan, fill_slots
from evolving_infra.workloads.model import Trace, validate

NAME = "shift"
SHAPES = ("linear", "step")


@dataclass(frozen=True, slots=True)
class Params:
    # Mix weights (generator name -> weight, normalised) at the trace's start and at its end.
    # A scenario, not a measurement: the default is a full swap from Putnam to OSWorld.
    start: dict[str, float] = field(default_factory=lambda: {"putnam": 1.0})
    end: dict[str, float] = field(default_factory=lambda: {"osworld": 1.0})
    # How the mix moves from start to end over the nominal duration: "linear", or "step" (start
    # mix before step_at * duration, end mix from then on). Modelling choice.
    shape: str = "linear"
    # Where the step happens, as a fraction of the duration (step shape only). Modelling choice.
    step_at: float = 0.5
    # Slots of the end mix per slot of the start mix (step shape only): the phases' loads are
    # the scenario's to choose. Modelling choice.
    after_agents: float = 1.0
    # The component generators' parameters (see their modules for sources); "cc" runs with its
    # module's defaults.
    putnam: putnam.Params = field(default_factory=putnam.Params)
    osworld: osworld.Params = field(default_factory=osworld.Params)


def mix_at(params: Params, frac: float) -> dict[str, float]:
    """The normalised mix at `frac` of the duration (clamped to [0, 1])."""
    frac = min(1.0, max(0.0, frac))
    w = frac if params.shape == "linear" else float(frac >= params.step_at)
    names = sorted(params.start.keys() | params.end.keys())
    raw = {n: (1 - w) * params.start.get(n, 0.0) + w * params.end.get(n, 0.0) for n in names}
    total = sum(raw.values())
    return {n: v / total for n, v in raw.items() if v > 0}


@dataclass(frozen=True, slots=True)
class _Component:
    label: str  # the agents' workload label
    session: Session
    prefixes: Mapping[str, int]
    prefix: str | None  # the shared prefix its agents start with


def _component(name: str, params: Params) -> _Component:
    module: ModuleType
    sub: Any
    if name == "putnam":
        module, sub = putnam, params.putnam
    elif name == "osworld":
        module, sub = osworld, params.osworld
    elif name == "cc":
        # NOTE: imported on use, so a mix without "cc" never loads its fitted parameters.
        module = importlib.import_module("evolving_infra.workloads.generators.cc_like")
        # Its defaults may be fitted (a `Params.default()` loader) rather than field defaults.
        sub = getattr(module.Params, "default", module.Params)()
    else:
        raise ValueError(f"unknown generator {name!r} in the mix (known: putnam, osworld, cc)")
    shared: dict[str, int] = dict(module.prefixes(sub)) if hasattr(module, "prefixes") else {}
    if len(shared) > 1:
        raise ValueError(f"generator {name!r} has several shared prefixes: {sorted(shared)}")
    return _Component(str(module.NAME), module.session(sub), shared, next(iter(shared), None))


def _check(params: Params) -> None:
    if params.shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {params.shape!r}")
    if not 0.0 <= params.step_at <= 1.0:
        raise ValueError(f"step_at must be in [0, 1], got {params.step_at}")
    if not params.after_agents > 0:
        raise ValueError(f"after_agents must be > 0, got {params.after_agents}")
    for which, mix in (("start", params.start), ("end", params.end)):
        if any(v < 0 for v in mix.values()) or sum(mix.values()) <= 0:
            raise ValueError(f"{which} mix needs weights >= 0 with a positive sum, got {mix}")


def generate(plan: SlotPlan, params: Params | None = None) -> Trace:
    """`plan.agents` slots whose sessions follow the shifting mix."""
    params = params or Params()
    _check(params)
    components = {n: _component(n, params) for n in sorted(params.start.keys() | params.end.keys())}
    by_label = {c.label: c for c in components.values()}
    prefixes: dict[str, int] = {}
    for c in components.values():
        prefixes.update(c.prefixes)

    def fill(phase: SlotPlan, frac: Callable[[float], float]) -> Trace:
        def workload(rng: random.Random, t: float) -> str:
            mix = mix_at(params, frac(t))
            names = list(mix)
            return components[rng.choices(names, weights=[mix[n] for n in names])[0]].label

        return fill_slots(
            phase,
            workload=workload,
            session=lambda label: by_label[label].session,
            block_size=BLOCK_SIZE,
            name=NAME,
            prefixes=prefixes,
            prefix_of=lambda label: by_label[label].prefix,
            meta={"generator": NAME, "seed": plan.seed, "params": dataclasses.asdict(params)},
        )

    if params.shape == "linear":
        return fill(plan, lambda t: t / plan.duration)
    step = params.step_at * plan.duration
    # Each phase's slots are filled for twice their nominal time: served faster than nominal
    # (short sessions on a split that suits them), a phase filled for the run's length alone ran
    # out of sessions before the end, and every split then served the same fixed work.
    before = fill(dataclasses.replace(plan, until=step, fill=2.0), lambda _t: 0.0)
    if step >= plan.duration:
        return before
    after_slots = max(1, round(plan.agents * params.after_agents))
    after = fill(
        dataclasses.replace(plan, agents=after_slots, begin=step, until=None, phase="b", fill=2.0),
        lambda _t: 1.0,
    )
    # The end phase's ids start with "b", so the two phases never collide.
    trace = dataclasses.replace(before, agents=before.agents + after.agents)
    validate(trace)
    return trace
