"""Running policies on a trace: `simulate` one, `compare` several (JSON-ready results).

`compare` expands `best-static` into every split run as `static:xPyD` and reports the one with
the highest throughput (and every split's throughput under `splits`); `best-dynamo-static` and
`best-arrow-static` do the same on Dynamo's and Arrow's infrastructure (`SWEEPS`). With `jobs` >
1 it runs that many policies at once in forked processes: each inherits the trace and the policies
(nothing is pickled on the way in, only each run's `Result` on the way back), and the results
are the same as one after the other, since every run depends only on the trace, the config and
its policy.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from evolving_infra.sim.cluster import Cluster, RunStats
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.metrics import Point
from evolving_infra.sim.planning import SwitchLog
from evolving_infra.sim.policies import SWEEPS, PolicySpec, policy, static_on, static_splits
from evolving_infra.workloads.model import Trace

BEST_STATIC = "best-static"
Tick = Callable[[float], None]


@dataclass(slots=True)
class Result:
    """One policy's run."""

    policy: str
    summary: dict[str, Any]
    timeline: list[Point]
    switches: list[SwitchLog]
    stats: RunStats
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The figures, timeline and switches: everything but the simulator's own speed, so
        that one seed gives one JSON (`runtime` holds the speed)."""
        return {
            **self.summary,
            **self.extra,
            "timeline": [asdict(p) for p in self.timeline],
            "switch_log": [asdict(s) for s in self.switches],
        }

    def runtime(self) -> dict[str, Any]:
        s = self.stats
        sim = self.summary["duration_s"]
        return {
            "events": s.events,
            "wall_s": s.wall_s,
            "events_per_s": s.events / s.wall_s if s.wall_s > 0 else None,
            "simulated_s_per_wall_s": sim / s.wall_s if s.wall_s > 0 else None,
        }


def simulate(trace: Trace, config: SimConfig, spec: PolicySpec, tick: Tick | None = None) -> Result:
    """Runs one policy on `trace`; `tick(now)` is called once per simulated second."""
    cluster = Cluster(trace, config, spec)
    end = cluster.run(tick)
    switches = cluster.switcher.log if cluster.switcher is not None else []
    summary = cluster.metrics.summary(end, switches)
    kv = [n.kv for n in cluster.nodes]
    extra: dict[str, Any] = {
        "evicted_blocks": sum(k.evicted for k in kv),
        "demoted_blocks": sum(k.demoted for k in kv),
        "dropped_blocks": sum(k.dropped for k in kv),
        # Demoted blocks the pool already held elsewhere, not stored twice (`NodeKv.pooled`).
        "deduped_blocks": sum(k.deduped for k in kv),
        "final_split": str(cluster.switcher.split()) if cluster.switcher else None,
    }
    if cluster.decisions:  # Θ per candidate at each decision (the evolving planner's)
        extra["decision_log"] = cluster.decisions
    return Result(spec.name, summary, cluster.metrics.timeline, switches, cluster.stats, extra)


def header(trace: Trace, config: SimConfig) -> dict[str, Any]:
    """What `compare` records of its inputs: `{"config": {...}, "trace": {...}}` (a run's
    results are another run's exactly when these and the policies' code are equal)."""
    return {
        "config": config.to_dict(config.block_size or trace.block_size),
        "trace": {
            "name": trace.name,
            "agents": len(trace.agents),
            "requests": trace.request_count,
            "block_size": trace.block_size,
        },
    }


def compare(
    trace: Trace,
    config: SimConfig,
    policies: Sequence[str | PolicySpec],
    *,
    progress: bool = False,
    jobs: int = 1,
) -> dict[str, Any]:
    """Every policy on the same trace and cluster: `{"policies": {name: figures}, "config":
    {...}, "trace": {...}, "runtime": {run: speed}}`, JSON-ready (per-minute timelines under
    each policy). Everything but `runtime` is a function of the inputs and the seed. `jobs`:
    runs at once (forked processes; see the module docstring)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    out: dict[str, Any] = {"policies": {}, **header(trace, config), "runtime": {}}
    runs: list[tuple[str, PolicySpec]] = []
    for p in policies:
        if isinstance(p, PolicySpec):
            runs.append((p.name, p))
        elif p in SWEEPS:
            runs.extend((p, static_on(SWEEPS[p], s)) for s in static_splits(config.nodes))
        else:
            runs.append((p, policy(p, config.nodes)))
    specs = [spec for _, spec in runs]
    if jobs > 1 and len(runs) > 1:
        results = _in_processes(trace, config, specs, jobs, progress)
    else:
        with _bar(progress, len(runs), config.duration) as bar:
            results = [simulate(trace, config, spec, bar(spec.name)) for spec in specs]
    sweeps: dict[str, dict[str, Result]] = {}
    for (label, spec), result in zip(runs, results, strict=True):
        out["runtime"][spec.name] = result.runtime()
        if label in SWEEPS:
            sweeps.setdefault(label, {})[spec.name.partition(":")[2]] = result
        else:
            out["policies"][label] = result.to_dict()
    for label, statics in sweeps.items():
        split, best = max(statics.items(), key=lambda kv: kv[1].summary["throughput_tokens_per_s"])
        figures = best.to_dict()
        figures["split"] = split
        figures["splits"] = {s: r.summary["throughput_tokens_per_s"] for s, r in statics.items()}
        out["policies"][label] = figures
    return out


# What forked workers run: set just before the pool forks, so that the children inherit the
# trace and the policies' factories (closures, which do not pickle) instead of receiving them.
_SHARED: tuple[Trace, SimConfig, list[PolicySpec]] | None = None


def _simulate_shared(i: int) -> tuple[int, Result]:
    assert _SHARED is not None, "only called in a worker forked by _in_processes"
    trace, config, specs = _SHARED
    return i, simulate(trace, config, specs[i])


def _in_processes(
    trace: Trace, config: SimConfig, specs: list[PolicySpec], jobs: int, progress: bool
) -> list[Result]:
    """`simulate` of every spec, up to `jobs` at once in forked processes, in `specs`' order."""
    global _SHARED
    _SHARED = (trace, config, specs)
    out: list[Result | None] = [None] * len(specs)
    try:
        # Fork (not spawn): the trace may be gigabytes, shared copy-on-write. The pool forks
        # before the progress bar starts its refresh thread.
        with multiprocessing.get_context("fork").Pool(min(jobs, len(specs))) as pool:
            done = pool.imap_unordered(_simulate_shared, range(len(specs)))
            with _count_bar(progress, len(specs), jobs) as advance:
                for i, result in done:
                    out[i] = result
                    advance(specs[i].name)
    finally:
        _SHARED = None
    return [r for r in out if r is not None]


@contextmanager
def _count_bar(enabled: bool, runs: int, jobs: int) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on stderr (TTY only) counting finished runs."""
    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield lambda name: None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} runs"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(f"{runs} runs, {min(jobs, runs)} at a time", total=runs)
        yield lambda name: bar.update(task, advance=1, description=f"last done: {name}")


@contextmanager
def _bar(enabled: bool, runs: int, horizon: float | None) -> Iterator[Callable[[str], Tick]]:
    """A rich progress bar on stderr (TTY only): one task per run, in simulated seconds."""
    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield lambda name: _noop
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} s simulated"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:

        def make(name: str) -> Tick:
            task = bar.add_task(name, total=horizon or None)
            last = [0.0]

            def tick(now: float) -> None:
                if now - last[0] >= 10.0:
                    last[0] = now
                    bar.update(task, completed=now)

            return tick

        yield make


def _noop(now: float) -> None:
    pass


def main_table(results: dict[str, Any]) -> str:
    """A Markdown table of the headline figures of `compare`'s results."""
    cols = [
        ("policy", None),
        ("tokens/s", "throughput_tokens_per_s"),
        ("req/s", "requests_per_s"),
        ("mean e2e s", "mean_e2e_s"),
        ("P50 TTFT s", "p50_ttft_s"),
        ("P95 TTFT s", "p95_ttft_s"),
        ("P99 TTFT s", "p99_ttft_s"),
        ("ITL ms", "mean_itl_s"),
        ("h", "hit_rate"),
        ("h*", "ideal_hit_rate"),
        ("lost reuse", "lost_kv_reuse"),
        ("switches", "switches"),
        ("done/issued", None),
    ]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for name, f in results["policies"].items():
        label = f"{name} ({f['split']})" if "split" in f else name
        cells = [label]
        for _, key in cols[1:]:
            if key is None:
                cells.append(f"{f['completed']}/{f['issued']}")
                continue
            v = f.get(key)
            if v is None:
                cells.append("-")
            elif key == "mean_itl_s":
                cells.append(f"{v * 1e3:.1f}")
            elif isinstance(v, int):
                cells.append(str(v))
            elif key in ("hit_rate", "ideal_hit_rate", "lost_kv_reuse"):
                cells.append(f"{v:.3f}")
            else:
                cells.append(f"{v:,.3g}" if v < 1000 else f"{v:,.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
