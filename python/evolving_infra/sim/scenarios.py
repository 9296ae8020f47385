"""The paper's scenarios (issue 5, item 5): named lists of simulator runs and the claims they check.

A scenario is a list of `ScenarioRun`s, each one `run.compare` call: a workload (a generator, or
sessions drawn from the bundled Claude Code traces as `sim --trace` does), a `SimConfig` and the
policies to compare. `run_scenario` runs them and checks the paper's claims on the results
(`sim/claims.py`); `evolving-infra scenario` (`scenario_command.py`) writes them to disk.

Concurrency levels. "low" must leave the 36-GPU cluster (9 nodes of 4 x H100, Llama-3-70B) mostly
idle, "mid" near its capacity, "high" beyond it, so that the cluster rather than the agents'
think time limits throughput. Chosen from quick sweeps (600 s, static 4P5D, seed 0; output tokens/s
per agent and P50 TTFT, which stays at the unloaded ~0.3 s until queues form):

- Claude Code (gen cc): 10 agents 14.7 tok/s/agent, P50 0.30 s; 40: 13.0, 0.29 s; 100: 11.1, 2.1 s
  (P95 55 s: queues form); 200: 7.3, 31 s; 400: throughput falls (cold 15k-token first prompts
  and a working set beyond L1 make prefill the bottleneck). Low 20, mid 100, high 250.
- Putnam: every session runs 8 forks of ~8k output tokens, so decode batches fill fast. 10
  agents: e2e 158 s (the unloaded decode time of 8k tokens), P95 TTFT 0.23 s; 40: tokens/s only
  1.9x for 4x the agents, P95 TTFT 250 s (requests wait for decode KV). Low 4, mid 15, high 50.
- OSWorld: 10 agents 0.85 req/s, P50 0.41 s; 40: 2.9 req/s (linear), 0.51 s; 100: 5.1 req/s,
  1.4 s; 200: 7.0 req/s, 13 s. Low 15, mid 80, high 200.

The paper's deployment (`--deployment paper`: Kimi K2 on 4 x GB300 per node, NVFP4 experts,
FP8 KV, 3 draft tokens with 2.5 accepted) serves far more: a node holds ~3M tokens of KV (400k
for Llama-3-70B on 4 x H100) and decodes 2.5 tokens a step. The same quick sweeps there (600 s,
static 4P5D, seed 0), `PAPER_LEVELS`:

- Claude Code: 50 agents 25.6 tok/s/agent, P50 TTFT 0.09 s, P95 0.7 s; 100: 25.1, P95 11 s;
  150: 23.2, P95 36 s (queues form); 200: 19.5, P95 65 s; 300: 11.6 (3,492 tok/s, no more than
  150's), P50 15 s; 400: throughput falls to 1,566 tok/s (a working set beyond the prefill
  nodes' cache: prefill recomputes). Low 50, mid 150, high 300.
- Putnam: 4-50 agents ~340-354 tok/s/agent, P95 TTFT 0.1 s; 100: 308, P95 18 s; 200: 205,
  P95 170 s (requests wait for decode KV). Low 15, mid 100, high 200.
- OSWorld: 15-200 agents 34-36 tok/s/agent, P95 TTFT <= 1.1 s; 400: 25.6, P95 23 s; 800: 14.5,
  P50 7 s. Low 40, mid 400, high 600.

`--quick` keeps the load per node and shortens the run: 16 GPUs (4 nodes, so `best-static` sweeps
3 splits instead of 8) with 4/9 of the agents, 600 simulated seconds. Scenarios whose point needs
9 nodes (initial splits 3P6D..6P3D) keep 36 GPUs and shorten the run instead.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from evolving_infra.planner.base import Split
from evolving_infra.planner.options import Option
from evolving_infra.sim import heldout
from evolving_infra.sim.claims import (
    Check,
    Verdict,
    baselines_below_best_static,
    beats_baselines,
    evolving_vs_best_static,
    holds_on_grid,
    holds_on_held_out,
    infrastructure_alone,
    initial_splits_converge,
    lost_reuse,
    mechanism_worth,
    planner_ablation,
    switch_cost,
    ttft_balancing,
)
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.policies import ABLATIONS, EVOLVING, PolicySpec
from evolving_infra.sim.run import BEST_STATIC, compare, header
from evolving_infra.timing.specs import DEFAULT_DEPLOYMENT, Deployment, deployment_name
from evolving_infra.workloads import generators
from evolving_infra.workloads.errors import WorkloadError
from evolving_infra.workloads.model import Trace

CLAUDE_CODE = "claude-code"  # a workload kind: sessions drawn from the bundled real traces
BASELINES = ("evolving", "dynamo", "dynamo-load", "dynamo-hicache", "arrow")
# Best static splits on Evolving Infra's infrastructure, on Dynamo's (without and with its
# shared tier) and on Arrow's (docs/baselines.md): the planner's worth and the
# infrastructure's, told apart.
STATIC_SWEEPS = (
    BEST_STATIC,
    "best-dynamo-static",
    "best-dynamo-hicache-static",
    "best-arrow-static",
)
DYNAMO_PLANNED = ("dynamo", "dynamo-load", "dynamo-hicache")  # the policies that restart
# Dynamo's restart at the high end (the paper's 700 s) and at a cold start of 2-5 min (docs/
# baselines.md §5): the shift scenario runs Dynamo's planners at both.
RESTART_ALT_S = 180.0
FULL_DURATION = 3600.0  # the paper reports simulated hours
QUICK_DURATION = 600.0
QUICK_GPUS = 16
LEVELS: dict[str, dict[str, int]] = {  # agents on 36 GPUs (see the module docstring)
    "cc": {"low": 20, "mid": 100, "high": 250},
    "putnam": {"low": 4, "mid": 15, "high": 50},
    "osworld": {"low": 15, "mid": 80, "high": 200},
}
# The same levels on the paper's deployment (module docstring, "paper deployment").
PAPER_LEVELS: dict[str, dict[str, int]] = {
    "cc": {"low": 50, "mid": 150, "high": 300},
    "putnam": {"low": 15, "mid": 100, "high": 200},
    "osworld": {"low": 40, "mid": 400, "high": 600},
}
LEVELS_BY_DEPLOYMENT = {"h100-llama": LEVELS, "paper": PAPER_LEVELS}
SHIFT_AGENTS = 60  # between Putnam's and OSWorld's capacities: both ends load the cluster
# On the paper's deployment the shift is `shift-step`: 200 Putnam agents (its high level), then
# 300 OSWorld ones, a step in served time at a quarter (generators/shift_step.py says why).
SHIFT_STEP_AGENTS = 200
# Claude Code agents per GPU at the "mid" level, kept at every scale (100 on 36 H100s; the paper
# deployment's, 150 on 36, on it).
MID_AGENTS_PER_GPU = LEVELS["cc"]["mid"] / 36


@dataclass(frozen=True, slots=True)
class Size:
    """How big to run: the full scenario or `--quick`; tests shrink further with the overrides
    (`duration` replaces the simulated seconds, `max_agents` caps every run's agents)."""

    quick: bool = False
    seed: int = 0
    duration: float | None = None
    max_agents: int | None = None
    pool_one_copy: bool = False  # `SimConfig.pool_one_copy`: a sensitivity run
    # The model, GPUs and serving setting. NOTE: the levels (`LEVELS`) were chosen on the
    # default one (Llama-3-70B on H100); on another they are loads, not the levels they name.
    deployment: Deployment = DEFAULT_DEPLOYMENT
    # The evolving planner's settings (`planner.options`), for every run.
    planner_options: tuple[Option, ...] = ()
    # The `heldout` scenario's generator seeds (`heldout.check_fresh`); None: the protocol's.
    held_out_seeds: tuple[int, ...] | None = None
    # The grids (`heldout`, `tuning`): the cells to run, by label (None: every one), and their
    # policies (None: evolving and the best static split), e.g. every fair baseline on a few
    # held-out cells. A label the grid does not have is a ValueError (`_grid`).
    cells: tuple[str, ...] | None = None
    policies: tuple[str, ...] | None = None
    # The grids' agents enter over this many seconds (`SlotPlan.ramp`); None: the grids'
    # `heldout.STEADY_RAMP` of the run (the other scenarios keep the plan's minute).
    start_ramp_s: float | None = None

    def grid_ramp(self, duration: float) -> float:
        """Seconds over which a grid's agents enter, in a run of `duration` seconds; a
        ValueError if they would not all have entered by its end."""
        if self.start_ramp_s is None:
            return heldout.STEADY_RAMP * duration
        if self.start_ramp_s >= duration:
            raise ValueError(
                f"the agents must enter within the run ({duration:.0f} s), got a ramp of"
                f" {self.start_ramp_s:.0f} s"
            )
        return self.start_ramp_s

    def agents(self, n: float) -> int:
        a = max(1, round(n))
        return min(a, self.max_agents) if self.max_agents is not None else a

    def seconds(self, full: float, quick: float) -> float:
        if self.duration is not None:
            return self.duration
        return quick if self.quick else full


@dataclass(frozen=True, slots=True)
class Workload:
    """A closed-loop workload: `agents` slots of sessions for `duration` nominal seconds."""

    kind: str  # a generator's CLI name, or CLAUDE_CODE
    agents: int
    duration: float
    ramp: float | None = None  # the slots enter over [0, ramp) s; None: `SlotPlan`'s default

    def __post_init__(self) -> None:
        if self.kind not in TRACE_KINDS and self.kind not in generators.MODULES:
            raise ValueError(f"unknown workload {self.kind!r}")

    def trace(self, seed: int) -> Trace:
        plan = generators.SlotPlan(
            agents=self.agents, duration=self.duration, seed=seed, ramp=self.ramp
        )
        if self.kind in TRACE_KINDS:
            from evolving_infra.workloads.sampling import sample_agents

            return sample_agents(TRACE_KINDS[self.kind](), plan)
        return generators.generate(self.kind, plan)

    def describe(self) -> str:
        start = "" if self.ramp is None else f", entering over {self.ramp:,.0f} s"
        return f"{self.kind}, {self.agents} agents, {self.duration:,.0f} s{start}"


@functools.cache
def _claude_code_pool() -> Trace:
    # Loading and importing the 24 raw files takes ~4 s: once per process.
    from evolving_infra.workloads.claude_code import bundled_trace_dir
    from evolving_infra.workloads.sampling import load_pool

    return load_pool([bundled_trace_dir()])


# Workloads drawn from bundled traces (the rest are generators): every Claude Code file, the
# held-out half of them, the Mooncake conversation trace (`heldout.py`).
TRACE_KINDS: dict[str, Callable[[], Trace]] = {
    CLAUDE_CODE: _claude_code_pool,
    "claude-code-tune": heldout.tune_pool,
    "claude-code-held": heldout.held_out_pool,
    "mooncake": heldout.mooncake_pool,
}


@dataclass(frozen=True, slots=True)
class ScenarioRun:
    """One `compare` call of a scenario."""

    label: str
    workload: Workload
    config: SimConfig
    policies: tuple[str | PolicySpec, ...]

    def trace(self) -> Trace:
        return self.workload.trace(self.config.seed)

    def execute(
        self, progress: bool = False, jobs: int = 1, trace: Trace | None = None
    ) -> dict[str, Any]:
        """`compare`'s results, on `trace` where the caller built it already (`self.trace()`)."""
        trace = self.trace() if trace is None else trace
        results = compare(trace, self.config, self.policies, progress=progress, jobs=jobs)
        results["workload"] = dataclasses.asdict(self.workload)
        return results


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    shows: str  # what it shows, one line
    claim: str  # the paper's claim it checks
    wall: str  # expected wall time on the 2-core machine: full / --quick
    build: Callable[[Size], list[ScenarioRun]]
    checks: tuple[Check, ...]

    def runs(self, size: Size) -> list[ScenarioRun]:
        return self.build(size)


def _config(gpus: int, size: Size, duration: float, seed: int | None = None) -> SimConfig:
    return SimConfig(
        gpus=gpus,
        deployment=size.deployment,
        seed=size.seed if seed is None else seed,
        duration=duration,
        pool_one_copy=size.pool_one_copy,
        planner_options=size.planner_options,
    )


def levels(size: Size) -> dict[str, dict[str, int]]:
    """The concurrency levels of `size`'s deployment (a deployment without levels of its own
    gets the default one's: loads, not the levels they name)."""
    return LEVELS_BY_DEPLOYMENT.get(deployment_name(size.deployment), LEVELS)


def _level(kind: str, level: str) -> Callable[[Size], list[ScenarioRun]]:
    workload_kind = CLAUDE_CODE if kind == "cc" else kind

    def build(size: Size) -> list[ScenarioRun]:
        agents_36 = levels(size)[kind][level]
        gpus = QUICK_GPUS if size.quick else 36
        d = size.seconds(FULL_DURATION, QUICK_DURATION)
        w = Workload(workload_kind, size.agents(agents_36 * gpus / 36), d)
        policies = (*BASELINES, *STATIC_SWEEPS)
        return [ScenarioRun(f"{kind}-{level}", w, _config(gpus, size, d), policies)]

    return build


def _shift_workload(size: Size, gpus: int, duration: float) -> Workload:
    if deployment_name(size.deployment) == "paper":
        return Workload("shift-step", size.agents(SHIFT_STEP_AGENTS * gpus / 36), duration)
    return Workload("shift", size.agents(SHIFT_AGENTS * gpus / 36), duration)


def _shift(size: Size) -> list[ScenarioRun]:
    gpus = QUICK_GPUS if size.quick else 36
    # The mix needs time to move and the planner 3+ one-minute slices to see each phase.
    d = size.seconds(FULL_DURATION, 900.0)
    w = _shift_workload(size, gpus, d)
    cfg = _config(gpus, size, d)
    fast = dataclasses.replace(cfg, switch_restart_s=RESTART_ALT_S)
    return [
        ScenarioRun("shift", w, cfg, (*BASELINES, *STATIC_SWEEPS)),
        ScenarioRun(
            f"shift, restart {RESTART_ALT_S:.0f} s", w, fast, ("evolving", *DYNAMO_PLANNED)
        ),
    ]


def _heldout(size: Size) -> list[ScenarioRun]:
    # Every held-out cell (`heldout.cells`) with evolving and the best static split; quick: 16
    # GPUs, 600 s, the first seed only.
    seeds = size.held_out_seeds or heldout.HELD_OUT_SEEDS
    return _grid(size, heldout.cells(deployment_name(size.deployment), seeds))


def _tuning(size: Size) -> list[ScenarioRun]:
    # The tuning grid (`heldout.tuning_cells`), run as the held-out one.
    return _grid(size, heldout.tuning_cells(deployment_name(size.deployment)))


# The scenarios whose runs are the cells of a grid (issue 25's bar, `claims.meets_bar`).
GRIDS = ("heldout", "tuning")


def _grid(size: Size, every: Sequence[heldout.Cell]) -> list[ScenarioRun]:
    gpus = QUICK_GPUS if size.quick else 36
    d = size.seconds(FULL_DURATION, QUICK_DURATION)
    cells = [c for c in every if not size.quick or c.seed == every[0].seed]
    if size.cells is not None:
        labels = [c.label for c in cells]
        unknown = [x for x in size.cells if x not in labels]
        if unknown:
            raise ValueError(f"no cell {unknown[0]!r} in this grid (cells: {', '.join(labels)})")
        cells = [c for c in cells if c.label in size.cells]
    policies = size.policies or ("evolving", BEST_STATIC)
    return [
        ScenarioRun(
            c.label,
            Workload(c.kind, size.agents(c.agents * gpus / 36), d, size.grid_ramp(d)),
            _config(gpus, size, d, seed=c.seed + size.seed),
            policies,
        )
        for c in cells
    ]


INITIAL_SPLITS = (Split(3, 6), Split(4, 5), Split(5, 4), Split(6, 3))


def _initial_splits(size: Size) -> list[ScenarioRun]:
    # 36 GPUs even when quick: the starts 3P6D..6P3D are splits of 9 nodes. Quick runs fewer
    # agents (a lighter load still has one best split) for 900 s: the planner needs >= 3
    # one-minute slices before its first decision, then a few more to confirm a move.
    d = size.seconds(FULL_DURATION, 900.0)
    mid = levels(size)["cc"]["mid"]
    w = Workload(CLAUDE_CODE, size.agents(mid * (0.6 if size.quick else 1)), d)
    return [
        ScenarioRun(
            str(split),
            w,
            _config(36, size, d),
            (dataclasses.replace(EVOLVING, split=split),),
        )
        for split in INITIAL_SPLITS
    ]


def _ablations(size: Size) -> list[ScenarioRun]:
    # Each of the paper's mechanisms switched off alone (`policies.ABLATIONS`: branch-aware
    # eviction, TTFT-balancing routing, the shared pool and prefetch, in-place switches that keep
    # KV, the planner), with Dynamo (its planner, and its best static split with HiCache) as the
    # reference the paper's "infrastructure alone" claim is against. Claude Code and OSWorld
    # near capacity (stationary) and the shifting mix (only a planner can follow it).
    gpus = QUICK_GPUS if size.quick else 36
    d = size.seconds(FULL_DURATION, QUICK_DURATION)
    cfg = _config(gpus, size, d)
    policies = (
        "evolving",
        *(a.name for a in ABLATIONS),
        "dynamo",
        BEST_STATIC,
        "best-dynamo-hicache-static",
    )
    mid = {kind: v["mid"] for kind, v in levels(size).items()}
    workloads = {
        "cc-mid": Workload(CLAUDE_CODE, size.agents(mid["cc"] * gpus / 36), d),
        "osworld-mid": Workload("osworld", size.agents(mid["osworld"] * gpus / 36), d),
        "shift": _shift_workload(size, gpus, d),
    }
    return [ScenarioRun(label, w, cfg, policies) for label, w in workloads.items()]


# Simulated seconds and agents of the scale scenarios' quick variants: the point of a quick run
# there is that the cluster runs end to end, and how fast; a full one is hours (docs/simulator.md,
# "Speed": at 3,072 GPUs, more than an hour per policy and more memory than the trace fits in).
SCALE_QUICK = {36: (600.0, 1.0), 256: (120.0, 0.5), 3072: (30.0, 0.1)}


def _scale(gpus: int) -> Callable[[Size], list[ScenarioRun]]:
    def build(size: Size) -> list[ScenarioRun]:
        quick_s, quick_load = SCALE_QUICK[gpus]
        d = size.seconds(FULL_DURATION, quick_s)
        load = quick_load if size.quick else 1.0
        # The generator, not the bundled traces: thousands of agents drawn from 24 real
        # sessions would be mostly copies; the generator's sessions are all different.
        per_gpu = levels(size)["cc"]["mid"] / 36
        w = Workload("cc", size.agents(per_gpu * gpus * load), d)
        # No best-static: 63 and 767 splits. Evolving vs the two baselines.
        return [ScenarioRun(f"{gpus} GPUs", w, _config(gpus, size, d), BASELINES)]

    return build


_LEVEL_CLAIMS: dict[str, str] = {
    "low": "idle cluster: every policy matches; evolving loses no reuse",
    "mid": "near capacity: evolving >= best static split; lost reuse ~0 vs large for LRU",
    "high": "beyond capacity: evolving >= best static; TTFT balancing avoids 27-34 s P95",
}
_LEVEL_CHECKS = (
    evolving_vs_best_static,
    beats_baselines,
    baselines_below_best_static,
    infrastructure_alone,
    lost_reuse,
    ttft_balancing,
    switch_cost,
)
# Full: the 2026-12-01 runs (docs/scenario-results/2026-12-01; Putnam's are the shortest, 20-30
# s). Quick: measured for cc-mid (26 s); the rest scale with agents (seed 0, 2 busy cores).
_WALL_LEVEL = {"low": "~1-2 min / ~10 s", "mid": "~1-5 min / ~30 s", "high": "~1-4 min / ~70 s"}


def _scenarios() -> dict[str, Scenario]:
    out: dict[str, Scenario] = {}
    names = {"cc": "Claude Code (bundled real traces)", "putnam": "Putnam", "osworld": "OSWorld"}
    for kind, label in names.items():
        for level in ("low", "mid", "high"):
            name = f"{kind}-{level}"
            out[name] = Scenario(
                name,
                f"stationary {label}, {level} load ({LEVELS[kind][level]} agents on 36 H100s,"
                f" {PAPER_LEVELS[kind][level]} on the paper's deployment):"
                " evolving vs the fair baselines and each infrastructure's best static split",
                _LEVEL_CLAIMS[level],
                _WALL_LEVEL[level],
                _level(kind, level),
                _LEVEL_CHECKS,
            )
    out["shift"] = Scenario(
        "shift",
        "a mix moving from Putnam to OSWorld: does each policy follow the best split? (on the"
        " paper's deployment a step in served time: 200 Putnam agents, then 300 OSWorld)",
        "evolving's throughput >= best static and above Dynamo and Arrow when the mix shifts",
        "~1 min / ~10 s",
        _shift,
        (
            beats_baselines,
            evolving_vs_best_static,
            baselines_below_best_static,
            lost_reuse,
            switch_cost,
        ),
    )
    out["heldout"] = Scenario(
        "heldout",
        "the held-out grid (sim/heldout.py): held-out Claude Code conversations, generator"
        " seeds and agent counts the planner was not tuned on, and the Mooncake trace;"
        " evolving vs the best static split in every cell",
        "evolving >= 0.98x the best static split in every cell, <= 4 switches per hour",
        "~25 min / ~3 min",
        _heldout,
        (holds_on_held_out, evolving_vs_best_static),
    )
    out["tuning"] = Scenario(
        "tuning",
        "the tuning grid (sim/heldout.py): the tuning Claude Code conversations, generator seeds"
        " and agent counts a planner change is judged on before the held-out grid is run;"
        " evolving vs the best static split in every cell",
        "evolving >= 0.98x the best static split in every cell, <= 4 switches per hour",
        "~5 min / ~1 min",
        _tuning,
        (holds_on_grid, evolving_vs_best_static),
    )
    out["initial-splits"] = Scenario(
        "initial-splits",
        "evolving from 3P6D, 4P5D, 5P4D and 6P3D on 36 GPUs: the split over time, where it ends",
        "initial splits converge to the same split",
        "~2 min / ~40 s",
        _initial_splits,
        (initial_splits_converge,),
    )
    out["ablations"] = Scenario(
        "ablations",
        "each mechanism switched off alone (LRU, Dynamo's router cost, no pool, dropping"
        " switches, no planner) vs evolving, Dynamo and its best static split with HiCache, on"
        " Claude Code, OSWorld and the shifting mix",
        "every mechanism is worth something; the infrastructure alone is 1.37x the best static"
        " split; the planner adds throughput when the mix shifts",
        "~4 min / ~40 s",
        _ablations,
        (mechanism_worth, infrastructure_alone, planner_ablation, ttft_balancing, lost_reuse),
    )
    for gpus, wall in (
        (36, "~1 min / ~30 s"),
        (256, "~7-10 min / ~30 s"),
        (3072, "~2 h / ~70 s"),
    ):
        out[f"scale-{gpus}"] = Scenario(
            f"scale-{gpus}",
            f"Claude Code (generator) at {MID_AGENTS_PER_GPU:.2f} agents per GPU on {gpus:,}"
            " GPUs: evolving vs dynamo vs arrow",
            "evolving's advantages (reuse, throughput) hold at scale",
            wall,
            _scale(gpus),
            (beats_baselines, lost_reuse),
        )
    return out


SCENARIOS: dict[str, Scenario] = _scenarios()


def run_scenario(
    scenario: Scenario,
    size: Size,
    *,
    progress: bool = False,
    on_run: Callable[[int, int, ScenarioRun], None] | None = None,
    jobs: int = 1,
    statics: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Runs every run of `scenario`: `{"scenario", "quick", "seed", "runs": {label: compare's
    results}, "claims": [verdicts]}`, JSON-ready. `on_run(i, n, run)` is called before each;
    `jobs`: policies of a run simulated at once (`run.compare`). `statics`: the "runs" of
    earlier results of the same runs, whose best static split is taken instead of run again
    (`reuse_statics`)."""
    runs = scenario.runs(size)
    out: dict[str, Any] = {
        "scenario": scenario.name,
        "shows": scenario.shows,
        "claim": scenario.claim,
        "quick": size.quick,
        "seed": size.seed,
        "deployment": deployment_name(size.deployment),
        "planner_options": {name: value for name, value in size.planner_options},
        "runs": {},
    }
    if size.held_out_seeds is not None:  # a fresh draw (`heldout.check_fresh`), or a screen's
        out["held_out_seeds"] = list(size.held_out_seeds)
        out["draw"] = heldout.draw_of(size.held_out_seeds)
    if scenario.name in GRIDS and runs:  # how the agents entered (`heldout.STEADY_RAMP`)
        out["start_ramp_s"] = runs[0].workload.ramp
    if size.cells is not None:
        out["cells"] = list(size.cells)
    if size.policies is not None:
        out["policies"] = list(size.policies)
    for i, run in enumerate(runs):
        if on_run is not None:
            on_run(i, len(runs), run)
        if statics is None:
            out["runs"][run.label] = run.execute(progress, jobs)
        else:
            out["runs"][run.label] = reuse_statics(run, statics, progress, jobs)
    out["claims"] = [dataclasses.asdict(v) for v in check_all(scenario.checks, out["runs"])]
    return out


def reuse_statics(
    run: ScenarioRun, statics: Mapping[str, Any], progress: bool = False, jobs: int = 1
) -> dict[str, Any]:
    """`run` with its best static split taken from `statics` (the "runs" of earlier results)
    and the other policies run: what a planner change is screened with (`scenario run tuning
    --statics-from DIR`), ~5x faster than the grid run whole, since the eight static splits
    of a cell are most of its time and run no planner. A WorkloadError where the earlier run
    is not this one: another trace or another configuration but the planner's options.
    It cannot tell a change to the static splits' own code (the router, the simulator): that
    is the caller's to know (the report names the folder)."""
    old = statics.get(run.label)
    if not isinstance(old, Mapping) or BEST_STATIC not in old.get("policies", {}):
        raise WorkloadError(f"{run.label}: no best static split in the results given")
    policies = tuple(p for p in run.policies if p != BEST_STATIC)
    if len(policies) == len(run.policies):
        raise WorkloadError(f"{run.label}: this run has no best static split to reuse")
    trace = run.trace()
    mine = header(trace, run.config)

    def unplanned(c: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in c.items() if k != "planner_options"}

    same_config = unplanned(mine["config"]) == unplanned(old.get("config", {}))
    if not same_config or mine["trace"] != old.get("trace"):
        raise WorkloadError(f"{run.label}: the results given ran another trace or configuration")
    results = dataclasses.replace(run, policies=policies).execute(progress, jobs, trace)
    results["policies"][BEST_STATIC] = old["policies"][BEST_STATIC]
    return results


def check_all(checks: Sequence[Check], runs: dict[str, Any]) -> list[Verdict]:
    return [check(runs) for check in checks]


__all__ = ["SCENARIOS", "Scenario", "ScenarioRun", "Size", "Workload", "check_all", "run_scenario"]
