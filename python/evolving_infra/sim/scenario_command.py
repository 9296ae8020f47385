"""`evolving-infra scenario`: the paper's scenarios, run by name, with a report of its claims."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from evolving_infra.argtypes import (
    check_output_folder,
    natural_int,
    natural_seconds,
    positive_int,
)
from evolving_infra.errors import CommandError
from evolving_infra.planner import options
from evolving_infra.sim import heldout
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.deployments import add_deployment_arguments, deployment_from
from evolving_infra.sim.policies import SWEEPS, policy
from evolving_infra.sim.run import main_table
from evolving_infra.sim.scenarios import (
    GRIDS,
    SCENARIOS,
    ScenarioRun,
    Size,
    check_all,
    run_scenario,
)
from evolving_infra.timing.specs import deployment_name
from evolving_infra.workloads.errors import WorkloadError

NAME = "scenario"
HELP = "run the paper's scenarios by name and check its claims"
DESCRIPTION = """\
Named simulator scenarios (issue 5): stationary Claude Code, Putnam and OSWorld at three
concurrency levels, the shifting mix, initial splits converging, the ablations (each mechanism
switched off alone) and 36 / 256 / 3,072 GPUs. Each is one or more `sim` comparisons.

  scenario list                          names, what each shows, the claim, expected wall time
  scenario run NAME [--quick] [--seed K] [--out DIR] [--jobs N]
  scenario run heldout|tuning --statics-from DIR/NAME   evolving again, the statics kept
  scenario run heldout|tuning --cells L,.. --policies P,..   some cells, other policies
  scenario run heldout --held-out-seeds K,L [--screen]   a fresh draw (or, to screen a planner
                                         change, a consumed one: tuning data)
  scenario check DIR/NAME...             the claims again, on results already written

`run` writes DIR/NAME/results.json (every run's results as `sim` writes them, under "runs", and
the verdicts under "claims") and DIR/NAME/report.md (a table per run, the split over time for
policies with a planner, and "paper claim -> measured -> reproduced?"). --quick runs a shorter,
smaller variant (under ~2 minutes on 2 cores, except scale-3072). `check` recomputes the claims
of a scenario's results.json with this version's checks and rewrites both files (the runs
themselves are not repeated). See docs/scenarios.md."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub.add_parser("list", help="the scenarios, what each shows and the claim it checks")
    run = sub.add_parser("run", help="run one scenario and write its report")
    run.add_argument("name", choices=sorted(SCENARIOS), metavar="NAME", help="a scenario name")
    run.add_argument("--quick", action="store_true", help="the short, smaller variant")
    run.add_argument("--seed", type=natural_int, default=0, help="seed (default: 0)")
    run.add_argument(
        "--out", type=Path, default=Path("scenario-results"), help="(default: scenario-results)"
    )
    run.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="policies simulated at once, each in a forked process (memory grows with each); "
        "results are the same as one at a time (default: 1)",
    )
    run.add_argument(
        "--pool-one-copy",
        action="store_true",
        help="the shared pool keeps one copy of a block (a sensitivity; `sim --pool-one-copy`)",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument(
        "--statics-from",
        type=Path,
        metavar="DIR/NAME",
        help="heldout and tuning only: take each cell's best static split from the results"
        " of an earlier run of the same scenario (the folder `run` wrote) and run the rest;"
        " ~5x faster, for screening a planner change (not a change to the router or the"
        " simulator: the static splits would differ)",
    )
    run.add_argument(
        "--held-out-seeds",
        metavar="K,L",
        help="heldout only: a fresh draw, these generator seeds instead of the protocol's 4,5"
        f" (not the tuning seeds {_seeds(heldout.TUNE_SEEDS)} nor the consumed draws"
        f" {_seeds(heldout.CONSUMED_SEEDS)}; docs/scenarios.md)",
    )
    run.add_argument(
        "--screen",
        action="store_true",
        help="with --held-out-seeds: a consumed draw may be named too, to screen a planner change"
        " on the draw that led to it (tuning data: the report says it is no held-out result)",
    )
    run.add_argument(  # argparse %-formats help: `:.0%}%` writes "25%%", printed "25%"
        "--start-ramp",
        type=natural_seconds,
        metavar="SECONDS",
        help="heldout and tuning only: the cells' agents enter over this many seconds (default:"
        f" {heldout.STEADY_RAMP:.0%}% of the run, 900 of an hour: a stationary workload; 60: a"
        " batch launched at once, whose sessions' contexts grow in step)",
    )
    run.add_argument(
        "--cells",
        metavar="LABEL,...",
        help="heldout and tuning only: these cells of the grid, by label (default: every one)",
    )
    run.add_argument(
        "--policies",
        metavar="NAME,...",
        help="heldout and tuning only: the cells' policies instead of evolving and best-static"
        " (`sim --policies` names, e.g. every fair baseline beside evolving)",
    )
    add_deployment_arguments(run, default="paper")
    options.add_argument(run)
    check = sub.add_parser("check", help="recompute the claims of scenario results on disk")
    check.add_argument(
        "folders", type=Path, nargs="+", metavar="DIR/NAME", help="folders `run` wrote"
    )


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        _list()
        return 0
    if args.action == "check":
        for folder in args.folders:
            path = recheck(folder)
            print(f"rewrote {path.parent}/results.json and report.md", file=sys.stderr)
        return 0
    size = Size(
        quick=args.quick,
        seed=args.seed,
        pool_one_copy=args.pool_one_copy,
        deployment=deployment_from(args),
        planner_options=tuple(args.planner_option),
        held_out_seeds=_held_out_seeds(args),
        cells=_names(args, "cells"),
        policies=_names(args, "policies"),
        start_ramp_s=_start_ramp(args),
    )
    try:  # settings the planner refuses: before the runs, not in the first one
        SimConfig(deployment=size.deployment, planner_options=size.planner_options)
    except ValueError as e:
        raise CommandError(str(e)) from None
    if size.cells is not None or size.policies is not None or size.start_ramp_s is not None:
        _check_grid(args.name, size)
    check_output_folder(args.out, "--out")  # before the runs, not after them
    statics = None if args.statics_from is None else _statics(args, size)
    path = run_to(
        args.name, size, args.out, progress=not args.no_progress, jobs=args.jobs, statics=statics
    )
    print(path.read_text(encoding="utf-8"), end="")
    print(f"wrote {path.parent}/results.json and report.md", file=sys.stderr)
    return 0


def _statics(args: argparse.Namespace, size: Size) -> tuple[Path, dict[str, Any]]:
    """`--statics-from`'s folder and its results' runs, for a run of the same scenario, the
    same deployment and the same draw."""
    if args.name not in GRIDS:
        raise CommandError(
            f"--statics-from is for the heldout and tuning scenarios, not {args.name}"
        )
    source = args.statics_from / "results.json"
    try:
        results = _results(args.statics_from)
    except WorkloadError as e:
        raise CommandError(f"--statics-from: {e}") from None
    given = (
        results["scenario"],
        results.get("deployment", "h100-llama"),  # as `report` reads results from before it
        results.get("quick"),
        results.get("seed"),
    )
    want = (args.name, deployment_name(size.deployment), size.quick, size.seed)
    drawn = results.get("held_out_seeds")
    stored = tuple(drawn) if drawn else None
    # Results from before `start_ramp_s` was recorded ran the slots' default minute.
    ramp = float(results.get("start_ramp_s", heldout.LEGACY_RAMP_S))
    ramp_now = _ramp(args.name, size)
    if given != want or stored != size.held_out_seeds or ramp != ramp_now:

        def describe(what: tuple[Any, ...], seeds: tuple[int, ...] | None, ramp: float) -> str:
            draw = "" if seeds is None else f", held-out seeds {','.join(map(str, seeds))}"
            start = f", agents entering over {ramp:.0f} s"
            return f"{what[0]} ({what[1]}, quick {what[2]}, seed {what[3]}{draw}{start})"

        raise CommandError(
            f"--statics-from: {source} ran {describe(given, stored, ramp)}; this run is"
            f" {describe(want, size.held_out_seeds, ramp_now)}"
        )
    return args.statics_from, results["runs"]


def _ramp(name: str, size: Size) -> float:
    """The seconds over which the grid's agents enter in this run."""
    ramp = SCENARIOS[name].runs(size)[0].workload.ramp
    assert ramp is not None, "a grid's runs say how their agents enter"
    return ramp


def _start_ramp(args: argparse.Namespace) -> float | None:
    """`--start-ramp`, for a grid only; None when not given."""
    if args.start_ramp is not None and args.name not in GRIDS:
        raise CommandError(f"--start-ramp is for the heldout and tuning scenarios, not {args.name}")
    return None if args.start_ramp is None else float(args.start_ramp)


def _names(args: argparse.Namespace, option: str) -> tuple[str, ...] | None:
    """`--cells` or `--policies` as names; None when not given."""
    text = getattr(args, option)
    if text is None:
        return None
    if args.name not in GRIDS:
        raise CommandError(f"--{option} is for the heldout and tuning scenarios, not {args.name}")
    if option == "policies" and args.statics_from is not None:
        raise CommandError("--policies and --statics-from: --statics-from runs evolving alone")
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise CommandError(f"--{option} names nothing")
    return names


def _check_grid(name: str, size: Size) -> None:
    """The cells the grid has and policies that fit its nodes, before the runs."""
    try:
        runs = SCENARIOS[name].runs(size)
        for policy_name in size.policies or ():
            if policy_name not in SWEEPS:
                policy(policy_name, runs[0].config.nodes)
    except ValueError as e:
        raise CommandError(str(e)) from None


def _held_out_seeds(args: argparse.Namespace) -> tuple[int, ...] | None:
    """`--held-out-seeds` as seeds, checked (`heldout.check_fresh`); None when not given."""
    if args.held_out_seeds is None:
        if args.screen:
            raise CommandError("--screen names a consumed draw: it needs --held-out-seeds")
        return None
    if args.name != "heldout":
        raise CommandError(f"--held-out-seeds is for the heldout scenario, not {args.name}")
    try:
        seeds = tuple(int(k) for k in args.held_out_seeds.split(","))
    except ValueError:
        raise CommandError(
            f"--held-out-seeds takes seeds separated by commas, got {args.held_out_seeds!r}"
        ) from None
    if any(k < 0 for k in seeds):
        raise CommandError(f"--held-out-seeds takes seeds >= 0, got {args.held_out_seeds!r}")
    try:
        (heldout.check_screen if args.screen else heldout.check_fresh)(seeds)
    except ValueError as e:
        raise CommandError(str(e)) from None
    return seeds


def _seeds(seeds: tuple[int, ...]) -> str:
    return ",".join(str(k) for k in seeds)


def _list() -> None:
    table = Table(title="evolving-infra scenario run NAME [--quick]", show_lines=True)
    for col in ("name", "what it shows", "paper claim checked", "wall: full / --quick"):
        table.add_column(col, overflow="fold")
    for s in SCENARIOS.values():
        table.add_row(s.name, s.shows, s.claim, s.wall)
    Console().print(table)


def run_to(
    name: str,
    size: Size,
    out: Path,
    *,
    progress: bool = False,
    jobs: int = 1,
    statics: tuple[Path, dict[str, Any]] | None = None,
) -> Path:
    """Runs scenario `name` and writes OUT/NAME/results.json and report.md; returns the
    report's path. `statics`: a folder `run` wrote and its results' runs, whose best static
    splits are taken instead of run again (`scenarios.reuse_statics`)."""
    if name not in SCENARIOS:
        raise WorkloadError(f"unknown scenario {name!r} (known: {', '.join(SCENARIOS)})")
    scenario = SCENARIOS[name]
    console = Console(stderr=True)

    def on_run(i: int, n: int, r: ScenarioRun) -> None:
        if progress:
            console.rule(f"[bold]{name}[/] run {i + 1}/{n}: {r.label} ({r.workload.describe()})")

    start = time.perf_counter()
    try:
        results = run_scenario(
            scenario,
            size,
            progress=progress,
            on_run=on_run,
            jobs=jobs,
            statics=None if statics is None else statics[1],
        )
    except ValueError as e:  # a configuration that does not fit (e.g. a test override)
        raise WorkloadError(str(e)) from None
    results["wall_s"] = time.perf_counter() - start
    if statics is not None:
        results["statics_from"] = str(statics[0])
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    path = folder / "report.md"
    path.write_text(report(results), encoding="utf-8")
    return path


def _results(folder: Path) -> dict[str, Any]:
    """FOLDER/results.json as `run` wrote it (a scenario's name and its runs at least), or a
    WorkloadError naming what is wrong."""
    source = folder / "results.json"
    try:
        results: dict[str, Any] = json.loads(source.read_text(encoding="utf-8"))
        if not isinstance(results["scenario"], str) or not isinstance(results["runs"], dict):
            raise TypeError("scenario or runs of the wrong type")
    except FileNotFoundError:
        raise WorkloadError(
            f"{source} does not exist: give a folder `scenario run` wrote"
        ) from None
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{source} is not a scenario's results ({e})") from None
    return results


def recheck(folder: Path) -> Path:
    """Recomputes the claims of FOLDER/results.json with the scenario's current checks and
    rewrites it and report.md; returns the report's path."""
    source = folder / "results.json"
    results = _results(folder)
    name, runs = results["scenario"], results["runs"]
    if name not in SCENARIOS:
        raise WorkloadError(f"{source}: unknown scenario {name!r}")
    verdicts = check_all(SCENARIOS[name].checks, runs)
    results["claims"] = [dataclasses.asdict(v) for v in verdicts]
    source.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    path = folder / "report.md"
    path.write_text(report(results), encoding="utf-8")
    return path


def report(results: dict[str, Any]) -> str:
    """The Markdown report of `run_scenario`'s results."""
    variant = "quick" if results["quick"] else "full"
    wall = results.get("wall_s")
    lines = [
        f"# Scenario `{results['scenario']}` ({variant}, seed {results['seed']},"
        f" deployment {results.get('deployment', 'h100-llama')})",
        "",
        f"What it shows: {results['shows']}.",
        f"Paper claim: {results['claim']}.",
    ]
    if results.get("planner_options"):
        given = ", ".join(f"{k}={v}" for k, v in results["planner_options"].items())
        lines.append(f"Planner options (evolving): {given}.")
    if results.get("statics_from"):
        lines.append(f"Best static splits: taken from {results['statics_from']} (not run again).")
    if results.get("held_out_seeds"):
        seeds = ", ".join(str(k) for k in results["held_out_seeds"])
        if results.get("draw") == "consumed":
            lines.append(
                f"Seeds: {seeds}: a consumed draw (tuning data), a screen, no held-out result."
            )
        else:
            lines.append(f"Held-out seeds: {seeds} (a fresh draw; the protocol's: 4, 5).")
    if wall is not None:
        lines.append(f"Wall time: {wall:,.0f} s.")
    for label, r in results["runs"].items():
        c, w = r["config"], r["workload"]
        lines += [
            "",
            f"## {label}",
            "",
            f"{w['kind']}: {w['agents']} agents, {w['duration']:,.0f} s; {c['gpus']} GPUs ="
            f" {c['nodes']} nodes of {c['deployment']['tp']} x {c['deployment']['gpu']}"
            f" ({c['deployment']['model']}); {r['trace']['requests']:,} requests in the trace;"
            f" wall {sum(x['wall_s'] for x in r['runtime'].values()):,.1f} s.",
            "",
            main_table(r).rstrip("\n"),
        ]
        for sweep_name in SWEEPS:
            best = r["policies"].get(sweep_name)
            if best is not None and "splits" in best:
                sweep = ", ".join(f"{k} {v:,.0f}" for k, v in best["splits"].items())
                lines += ["", f"Static splits ({sweep_name}), tokens/s: {sweep}."]
        splits = _split_lines(r)
        if splits:
            lines += ["", "Split over time (minute: split; +k: nodes switching):", "", *splits]
    lines += [
        "",
        "## Paper claims",
        "",
        "| paper claim | what we measured | reproduced? | why |",
        "|---|---|---|---|",
    ]
    for v in results["claims"]:
        cells = (v["claim"], v["measured"], f"**{v['outcome']}**", v["why"])
        lines.append("| " + " | ".join(x.replace("|", "/") for x in cells) + " |")
    return "\n".join(lines) + "\n"


def _split_lines(results: dict[str, Any]) -> list[str]:
    """One line per policy with a planner (static splits never move): the minutes where its
    split changed."""
    out = []
    for name, f in results["policies"].items():
        points = f.get("timeline", [])
        if not points or name in SWEEPS or ":" in name:  # a static split never moves
            continue
        steps: list[str] = []
        last: tuple[int, int, int] | None = None
        for p in points:
            now = (p["prefill"], p["decode"], p["down"])
            if now != last:
                down = f"+{p['down']}" if p["down"] else ""
                steps.append(f"{p['t'] / 60:.0f}: {p['prefill']}P{p['decode']}D{down}")
                last = now
        final = f.get("final_split") or "-"
        out.append(f"- {name}: " + " -> ".join(steps) + f" (final {final})")
    return out
