"""`evolving-infra parity`: one workload through the simulator and through the live system.

The simulator and the live router drive the same policies, so on the same cluster and workload
they should give the same figures; this command measures how far apart they are. It draws the
sessions once (as `replay` and `sim --trace` draw them), runs the simulator's `evolving` policy
on them (the cluster's nodes, deployment, starting split and planner interval), then starts the
live system (`cluster up`'s own code: pool master, simulated engines, router) and replays the
same sessions against it (`replay`'s `Replayer`), and sets the two side by side
(`parity/compare.py`: the definitions, and the bounds judged: lost KV reuse within 0.03 and P50
TTFT within 25% of the simulator's).

The simulator runs first, alone: the live side shares this machine's cores with nothing else.
Exit status 0 when both bounds hold, 1 when one does not, 2 for bad input or a cluster that
cannot start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
from dataclasses import replace
from pathlib import Path

import aiohttp
from rich.console import Console

from evolving_infra.argtypes import (
    check_output_folder,
    int_at_least,
    natural_int,
    positive_float,
    positive_seconds,
)
from evolving_infra.cluster import command as cluster_command
from evolving_infra.cluster.procs import ClusterError
from evolving_infra.errors import CommandError
from evolving_infra.parity import compare
from evolving_infra.planner.base import Split
from evolving_infra.replay.command import DEFAULT_MODEL, draw
from evolving_infra.replay.runner import Replayer, ReplaySettings
from evolving_infra.replay.summary import Outcome, Summary
from evolving_infra.router.api import CONTEXT_LENGTH_EXCEEDED
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.policies import policy
from evolving_infra.sim.run import compare as simulate
from evolving_infra.timing.specs import GPUS, MODELS, Deployment
from evolving_infra.workloads.claude_code import bundled_trace_dir
from evolving_infra.workloads.model import Trace

NAME = "parity"
HELP = "the same workload through the simulator and the live system, figures side by side"
DESCRIPTION = (
    __doc__.split("\n", 2)[2]
    + """
example (what `make parity` runs):
  evolving-infra parity --engines 4 --agents 16 --duration 120 --seed 1
"""
)

POLICY = "evolving"  # what the live router runs by default
# The replay's failure reason of a request refused as longer than the model's context or any
# engine's KV: the simulator's `rejected`.
REJECTED = f"http_400:{CONTEXT_LENGTH_EXCEEDED}"  # `replay.client`'s reason for it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--traces", type=Path, nargs="+", default=[bundled_trace_dir()], metavar="TRACE",
      help="traces the agents are drawn from (default: the bundled"
           " data/traces/claude-code)")  # fmt: skip
    a("--engines", type=int_at_least(2), default=4,
      help="engines (simulated nodes), at least 2 (default: 4)")  # fmt: skip
    a("--prefill", type=natural_int, default=None,
      help="engines starting as prefill (default: half, rounded up)")  # fmt: skip
    a("--model", choices=sorted(MODELS), default="llama-3-8b", help="model (default: %(default)s)")
    a("--gpu", choices=sorted(GPUS), default="h100-sxm", help="GPU kind (default: %(default)s)")
    a("--tp", type=int_at_least(1), default=1, help="GPUs per engine (default: 1)")
    a("--agents", type=int_at_least(1), default=16, help="concurrent agent slots (default: 16)")
    a("--duration", type=positive_seconds, default=120.0,
      help="seconds of load (simulated, and of wall time live) (default: 120)")  # fmt: skip
    a("--seed", type=int, default=1, help="seed of the sessions drawn and the simulator"
      " (default: 1)")  # fmt: skip
    a("--speed", type=positive_float, default=1.0,
      help="divide every trace wait by X, think time compressed (default: 1)")  # fmt: skip
    a("--planner-interval", type=positive_seconds, default=60.0,
      help="seconds between phase-split decisions, on both sides (default: 60)")  # fmt: skip
    a("--no-pool", action="store_true",
      help="no Mooncake master live (the simulator's policy keeps its shared pool)")  # fmt: skip
    a("--log-dir", type=Path, default=Path("parity-logs"),
      help="folder of every live process's log (default: parity-logs)")  # fmt: skip
    a("--report", type=Path, default=None, metavar="FILE",
      help="also write the report as JSON to FILE (default: none)")  # fmt: skip
    a("--json", action="store_true", help="print the report as one JSON object on stdout")


class ParityError(CommandError):
    """The live cluster could not start or died under the run."""


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    n = args.engines
    prefill = (n + 1) // 2 if args.prefill is None else args.prefill
    if not 1 <= prefill < n:
        raise CommandError(f"--prefill {prefill} leaves no engine of one phase", f"give 1..{n - 1}")
    check_output_folder(args.log_dir, "--log-dir")
    if args.report is not None:
        check_output_folder(args.report.parent, "--report")
    trace = draw(list(args.traces), args.agents, args.duration, args.seed, args.speed)
    config = SimConfig(
        gpus=n * args.tp,
        deployment=Deployment(MODELS[args.model], GPUS[args.gpu], args.tp),
        seed=args.seed,
        duration=args.duration,
        initial_split=Split(prefill, n - prefill),
        planner_interval=args.planner_interval,
        # The live router refuses what is longer than the model's context: so does this run.
        context_length=MODELS[args.model].context_length,
    )
    console.print(f"parity: the simulator, {POLICY}, {n} nodes ...")
    spec = replace(policy(POLICY, config.nodes), split=Split(prefill, n - prefill))
    sim = compare.sim_side(simulate(trace, config, [spec])["policies"][spec.name])
    console.print(f"parity: the live system, {n} engines, {args.duration:g} s ...")
    summary, outcomes = _live(args, trace, prefill, console)
    live = compare.live_side(summary, outcomes, REJECTED)
    setting = {
        "traces": [str(p) for p in args.traces],
        "engines": n,
        "prefill": prefill,
        "model": args.model,
        "gpu": args.gpu,
        "tp": args.tp,
        "agents": args.agents,
        "duration_s": args.duration,
        "seed": args.seed,
        "speed": args.speed,
        "pool": not args.no_pool,
        "policy": POLICY,
        "live_errors": summary.errors,
    }
    rep = compare.report(sim, live, setting)
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(rep, indent=1) + "\n", encoding="utf-8")
    if args.json:
        sys.stdout.write(json.dumps(rep) + "\n")
    else:
        compare.render(rep, Console())
    return 0 if rep["ok"] else 1


def _cluster_args(args: argparse.Namespace, prefill: int) -> argparse.Namespace:
    """`cluster up`'s own options, parsed by its own parser (one implementation)."""
    p = argparse.ArgumentParser()
    cluster_command.add_arguments(p)
    argv = ["up", "--engines", str(args.engines), "--prefill", str(prefill),
            "--router-port", "0", "--model", args.model, "--gpu", args.gpu,
            "--tp", str(args.tp), "--planner-interval", str(args.planner_interval),
            "--log-dir", str(args.log_dir)]  # fmt: skip
    if args.no_pool:
        argv.append("--no-pool")
    return p.parse_args(argv)


def _live(
    args: argparse.Namespace, trace: Trace, prefill: int, console: Console
) -> tuple[Summary, list[Outcome]]:
    try:
        cluster = cluster_command.up(_cluster_args(args, prefill), console)
    except ClusterError as e:
        raise ParityError(e.what, details=e.details) from None
    try:
        settings = ReplaySettings(
            router=cluster.router_url,
            model=DEFAULT_MODEL,
            duration=args.duration,
            run_id=secrets.token_hex(3),
        )

        async def replay() -> tuple[Summary, list[Outcome]]:
            async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=settings.request_timeout),
                connector=aiohttp.TCPConnector(limit=0),
            ) as session:
                replayer = Replayer(trace, settings, session)
                return await replayer.run(), replayer.outcomes

        summary, outcomes = asyncio.run(replay())
        cluster.check()  # a process that died under the run: the figures are not the system's
    except ClusterError as e:
        raise ParityError(e.what, details=e.details) from None
    finally:
        cluster.stop()
    return summary, outcomes
