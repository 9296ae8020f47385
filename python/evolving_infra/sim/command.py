"""`evolving-infra sim`: compare serving policies on a simulated PD-disaggregated cluster."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from evolving_infra.argtypes import (
    check_output_folder,
    natural_int,
    positive_int,
    positive_seconds,
)
from evolving_infra.planner import options
from evolving_infra.sim.config import DECODE_ALLOCATIONS, SWITCH_RESTART_S, SimConfig
from evolving_infra.sim.deployments import add_deployment_arguments, deployment_from
from evolving_infra.sim.plots import timelines
from evolving_infra.sim.policies import SWEEPS, policy
from evolving_infra.sim.run import BEST_STATIC, compare, main_table
from evolving_infra.timing.specs import deployment_name
from evolving_infra.workloads import generators
from evolving_infra.workloads.errors import WorkloadError
from evolving_infra.workloads.model import Trace
from evolving_infra.workloads.sampling import load_pool, sample_agents

NAME = "sim"
HELP = "compare routing/planner policies on a simulated PD-disaggregated cluster"
DESCRIPTION = """\
Replays a closed-loop agent workload (a generator, or trace files) on a simulated cluster of
GPUs / TP nodes, once per policy, and compares them: output tokens/s, requests/s, latencies
(TTFT percentiles, inter-token), the KV hit rate h against h* (one infinite shared cache) and
the phase switches each policy made. The ground-truth iteration times come from a roofline of
the model on the GPU (hidden from the policies, which see only a model fitted online).

Policies: evolving; dynamo (Dynamo 1.6.1's defaults: KV router, LRU, its default `throughput`
planner target, restart to switch), dynamo-load (its SLA load planner) and dynamo-hicache
(dynamo with SGLang's HiCache and a Mooncake store: a shared tier its router credits); arrow;
static:xPyD (a fixed split on Evolving Infra's infrastructure), dynamo-static:xPyD,
dynamo-hicache-static:xPyD and arrow-static:xPyD (on theirs, no planner); best-static,
best-dynamo-static, best-dynamo-hicache-static, best-arrow-static (every split run so, the best
by throughput reported). See docs/simulator.md and, for how the baselines follow their upstream
defaults, docs/baselines.md.

Writes DIR/results.json (every figure, per-minute timelines), DIR/results.md (a table) and
DIR/timeline_*.png. With --trace, the files' agents are drawn into --agents slots of sessions
for --duration nominal seconds (as `trace sample` does); without, the --workload generator
makes them."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        choices=sorted(generators.MODULES),
        default="cc",
        help="generator of the agents (default: cc)",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="trace files or folders to draw the agents from instead of a generator",
    )
    parser.add_argument("--gpus", type=positive_int, default=36, help="GPUs (default: 36)")
    add_deployment_arguments(parser)
    parser.add_argument(
        "--agents", type=positive_int, default=50, help="concurrent agent slots (default: 50)"
    )
    parser.add_argument(
        "--duration",
        type=positive_seconds,
        default=3600.0,
        help="simulated seconds, also the workload's nominal length (default: 3600)",
    )
    parser.add_argument(
        "--policies",
        default=f"evolving,dynamo,arrow,{BEST_STATIC}",
        help="comma-separated policies (default: evolving,dynamo,arrow,best-static)",
    )
    parser.add_argument("--seed", type=natural_int, default=0, help="seed (default: 0)")
    parser.add_argument(
        "--decode-allocation",
        choices=DECODE_ALLOCATIONS,
        default="early",
        help="when a decode node reserves a request's KV, as SGLang's "
        "--disaggregation-decode-allocation-policy: early (SGLang's default, which the live "
        "system's engines run: first, and the prefill waits for it) or prefill_complete (after "
        "the prefill, which keeps the KV pinned on the prefill node meanwhile) (default: early)",
    )
    parser.add_argument(
        "--restart-s",
        type=positive_seconds,
        default=SWITCH_RESTART_S,
        help="seconds a node is down when a policy that restarts to switch (dynamo) moves it to "
        "the other phase: the paper's figure, and the high end; Dynamo's own docs give ~60 s "
        "for a cold start and ~10 s for a restore from a snapshot (docs/baselines.md, §5) "
        "(default: %(default).0f)",
    )
    parser.add_argument(
        "--pool-one-copy",
        action="store_true",
        help="the shared pool (policies with one) keeps one copy of a block, as a key-value "
        "store does, instead of every node's host memory keeping its own (a sensitivity: "
        "docs/scenarios.md, 'one copy in the pool')",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("sim-results"), help="output folder (default: sim-results)"
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="policies run at once, each in its own forked process with its own cluster state "
        "(memory grows with each); results are the same as one at a time (default: 1)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    options.add_argument(parser)


def load_trace(args: argparse.Namespace) -> Trace:
    plan = generators.SlotPlan(agents=args.agents, duration=args.duration, seed=args.seed)
    if not args.trace:
        return generators.generate(args.workload, plan)
    return sample_agents(load_pool(args.trace), plan)


def run(args: argparse.Namespace) -> int:
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not names:
        raise WorkloadError("--policies names no policy")
    deployment = deployment_from(args)
    try:
        config = SimConfig(
            gpus=args.gpus,
            deployment=deployment,
            seed=args.seed,
            duration=args.duration,
            decode_allocation=args.decode_allocation,
            switch_restart_s=args.restart_s,
            pool_one_copy=args.pool_one_copy,
            planner_options=tuple(args.planner_option),
        )
    except ValueError as e:
        raise WorkloadError(str(e)) from None
    for name in names:  # an unknown policy name, a split that does not fit: before the runs
        if name not in SWEEPS:
            try:
                policy(name, config.nodes)
            except ValueError as e:
                raise WorkloadError(str(e)) from None
    check_output_folder(args.out, "--out")
    trace = load_trace(args)
    # NOTE: nothing the runs raise is the user's doing any more: a ValueError from them (a
    # directory error, say) is a bug and reaches the CLI as an internal error, not as a bad input.
    results = compare(trace, config, names, progress=not args.no_progress, jobs=args.jobs)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    c = results["config"]
    header = (
        f"# {trace.name}: {len(trace.agents)} agents, {c['nodes']} nodes of "
        f"{deployment.tp} x {deployment.gpu.name} ({deployment_name(deployment)}), "
        f"{config.duration:,.0f} s, seed {config.seed}\n\n"
    )
    table = main_table(results)
    (out / "results.md").write_text(header + table, encoding="utf-8")
    timelines(results, out)
    print(table, end="")
    print(
        f"wrote {out}/results.json, results.md, timeline_*.png and decisions_*.png", file=sys.stderr
    )
    return 0
