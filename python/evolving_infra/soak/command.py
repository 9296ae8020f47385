"""`evolving-infra soak`: the live system under sustained closed-loop load, with faults injected.

One run: `cluster up` (the same code as the command: pool master, simulated engines, router on
loopback), then `replay`'s closed-loop agents (the same `Replayer`) for --duration seconds, while
this command kills an engine (SIGKILL, a crash: no shutdown path runs) and restarts the router
(SIGINT, then the same command line on the same port) at the given times. Through the run it
samples every process's resident memory and, before each router restart and at the end, the
router's overhead histogram.

The report: requests completed, failed (with an error the client saw) and lost (neither a
response nor an error: the figure that must be 0), errors by reason, the router overhead
P50/P99 over all router lifetimes (flagged when beyond the histogram's top bucket), memory per
process (start, after warm-up, end, peak, growth after warm-up; warm-up counted from each
process's own start) and its CPU seconds, and the faults with the time each was injected and
how long the router was away. Exit status 0 when something completed and nothing was lost, 1
otherwise, 2 when the cluster could not start or a process died that no fault killed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from rich.console import Console

from evolving_infra.argtypes import (
    int_at_least,
    natural_int,
    positive_float,
    positive_int,
    positive_seconds,
)
from evolving_infra.cluster import command as cluster_command
from evolving_infra.cluster.command import Cluster
from evolving_infra.cluster.procs import ClusterError
from evolving_infra.errors import CommandError
from evolving_infra.replay.command import DEFAULT_MODEL, draw
from evolving_infra.replay.runner import Replayer, ReplaySettings
from evolving_infra.soak import probes
from evolving_infra.soak.report import SoakReport, render
from evolving_infra.timing.specs import GPUS
from evolving_infra.workloads.claude_code import bundled_trace_dir
from evolving_infra.workloads.model import Trace

log = structlog.get_logger(__name__)

NAME = "soak"
HELP = "sustained load on a live loopback cluster, with an engine killed and the router restarted"
DESCRIPTION = (
    __doc__.split("\n", 2)[2]
    + """
example (what `make soak` runs):
  evolving-infra soak --agents 200 --duration 1800 --kill-engine-at 200 --restart-router-at 400 \
      --engines 6 --l2-blocks 50000 --speed 1 --time-scale 50 --gpu h200-sxm --no-pool \
      --request-timeout 120
"""
)

DEFAULT_TRACES = bundled_trace_dir()
MEMORY_EVERY_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--agents", type=positive_int, default=200, help="concurrent agent slots (default: 200)")
    a("--duration", type=positive_seconds, default=600.0,
      help="seconds of load (default: 600)")  # fmt: skip
    a("--kill-engine-at", type=positive_seconds, default=None, metavar="S",
      help="SIGKILL one engine S seconds into the load (default: never)")  # fmt: skip
    a("--kill-engine", type=natural_int, default=None, metavar="N",
      help="which engine --kill-engine-at kills (default: the last, a decode engine)")  # fmt: skip
    a("--restart-router-at", type=positive_seconds, default=None, metavar="S",
      help="stop the router S seconds into the load, start it again (default: never)")  # fmt: skip
    a("--engines", type=int_at_least(2), default=4,
      help="simulated engines, at least 2 (default: 4)")  # fmt: skip
    a("--routers", type=positive_int, default=1,
      help="router replicas behind a front, as cluster up --routers (default: 1);"
      " --restart-router-at restarts replica 0")  # fmt: skip
    a("--prefill", type=natural_int, default=None,
      help="engines starting as prefill (default: half, rounded up)")  # fmt: skip
    a("--time-scale", type=positive_float, default=1.0,
      help="simulated seconds per real second in the engines (default: 1)")  # fmt: skip
    a("--gpu", choices=sorted(GPUS), default="h100-sxm",
      help="the simulated engines' GPU kind (default: %(default)s)")  # fmt: skip
    a("--no-pool", action="store_true",
      help="no Mooncake master: engines keep L2 to themselves (PD hand-offs too)")  # fmt: skip
    a("--l2-blocks", type=natural_int, default=None,
      help="each engine's host KV capacity in pages (default: the engine's, 1 TiB per 8 GPUs;"
           " a smaller one fills, and so shows memory level off, within a soak)")  # fmt: skip
    a("--traces", type=Path, nargs="+", default=[DEFAULT_TRACES], metavar="TRACE",
      help="traces the agents are drawn from (default: the bundled"
           " data/traces/claude-code)")  # fmt: skip
    a("--speed", type=positive_float, default=10.0,
      help="divide every trace wait by X, think time compressed (default: 10)")  # fmt: skip
    a("--request-timeout", type=positive_seconds, default=120.0,
      help="seconds a request may take before it fails as a timeout (default: 120)")  # fmt: skip
    a("--seed", type=int, default=0, help="seed of the sessions drawn (default: 0)")
    a("--log-dir", type=Path, default=Path("soak-logs"),
      help="folder of every process's log (default: soak-logs)")  # fmt: skip
    a("--json", action="store_true", help="print the report as one JSON object on stdout")


class SoakError(CommandError):
    """The cluster could not start, or a process died that no fault killed (status 2, as the
    docstring says); the first line names it and its log, `details` may hold the log's end."""


@dataclass
class _Run:
    """The state one soak run shares between its tasks."""

    cluster: Cluster
    args: argparse.Namespace
    t0: float = 0.0
    memory: list[probes.MemorySeries] = field(default_factory=list)
    overhead: list[probes.Buckets] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def watch(self, name: str, pid: int | None) -> None:
        if pid is not None:
            series = probes.MemorySeries(name, pid)
            series.add(self.now())
            self.memory.append(series)

    def sample(self) -> None:
        t = self.now()
        for s in self.memory:
            s.add(t)


def _cluster_args(args: argparse.Namespace) -> argparse.Namespace:
    """`cluster up`'s own options, parsed by its own parser (one implementation)."""
    p = argparse.ArgumentParser()
    cluster_command.add_arguments(p)
    argv = ["up", "--engines", str(args.engines), "--router-port", "0",
            "--routers", str(args.routers),
            "--time-scale", str(args.time_scale), "--gpu", args.gpu,
            "--log-dir", str(args.log_dir)]  # fmt: skip
    if args.prefill is not None:
        argv += ["--prefill", str(args.prefill)]
    if args.no_pool:
        argv.append("--no-pool")
    if args.l2_blocks is not None:
        argv += ["--l2-blocks", str(args.l2_blocks)]
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    if args.kill_engine is not None and args.kill_engine >= args.engines:
        raise CommandError(
            f"--kill-engine {args.kill_engine} is not one of the {args.engines} engines",
            f"give 0..{args.engines - 1}",
        )
    # The traces first: a bad one is found before a cluster starts.
    trace = draw(list(args.traces), args.agents, args.duration, args.seed, args.speed)
    try:
        cluster = cluster_command.up(_cluster_args(args), console)
    except ClusterError as e:
        raise SoakError(e.what, details=e.details) from None
    try:
        report = asyncio.run(_soak(_Run(cluster, args), trace, console))
    except ClusterError as e:
        raise SoakError(e.what, details=e.details) from None
    finally:
        cluster.stop()
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict()) + "\n")
    else:
        render(report, Console())
    return 0 if report.ok else 1


async def _soak(r: _Run, trace: Trace, console: Console) -> SoakReport:
    args, cluster = r.args, r.cluster
    settings = ReplaySettings(
        router=cluster.router_url,
        model=DEFAULT_MODEL,
        duration=args.duration,
        drain_timeout=args.request_timeout,
        request_timeout=args.request_timeout,
        run_id=secrets.token_hex(3),
    )
    r.t0 = time.monotonic()
    for p in cluster.procs:
        r.watch(p.name, p.popen.pid if p.popen is not None else None)
    r.watch("mooncake-master", getattr(cluster.master, "pid", None))
    r.watch("soak (the agents)", os.getpid())  # the load generator shares the machine
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        replay = asyncio.create_task(Replayer(trace, settings, session).run())
        side = [asyncio.create_task(_monitor(r))]
        if args.kill_engine_at is not None:
            side.append(asyncio.create_task(_at(r, args.kill_engine_at, _kill_engine(r))))
        if args.restart_router_at is not None:
            restart = _restart_router(r, session)
            side.append(asyncio.create_task(_at(r, args.restart_router_at, restart)))
        console.print(f"soak: {args.agents} agents for {args.duration:g} s")
        try:
            while not replay.done():
                done, _ = await asyncio.wait([replay, *side], return_when="FIRST_COMPLETED")
                for task in side:
                    if task in done:
                        task.result()  # a fault or the monitor failed: raise it here
                side = [t for t in side if t not in done]
            summary = replay.result()
        finally:
            replay.cancel()
            for task in side:
                task.cancel()
            await asyncio.gather(replay, *side, return_exceptions=True)
        for url in _routers(cluster):
            r.overhead.append(await _scrape(session, url))
    r.sample()
    buckets = probes.merge(r.overhead)
    return SoakReport(
        summary=summary,
        faults=r.faults,
        overhead_p50_s=probes.quantile(buckets, 0.5),
        overhead_p99_s=probes.quantile(buckets, 0.99),
        overhead_count=int(max(buckets.values(), default=0.0)),
        overhead_p50_above_top=probes.above_top(buckets, 0.5),
        overhead_p99_above_top=probes.above_top(buckets, 0.99),
        memory=[s.summary(warm_after=args.duration / 4) for s in r.memory],
    )


async def _at(r: _Run, seconds: float, action: Any) -> None:
    await asyncio.sleep(max(0.0, seconds - r.now()))
    await action


async def _monitor(r: _Run) -> None:
    """Fails the run when a process dies that no fault killed; samples memory meanwhile."""
    next_sample = MEMORY_EVERY_S
    while True:
        await asyncio.sleep(1.0)
        try:
            r.cluster.check()
        except ClusterError as e:
            raise SoakError(e.what, details=e.details) from None
        if r.now() >= next_sample:
            r.sample()
            next_sample += MEMORY_EVERY_S


async def _kill_engine(r: _Run) -> None:
    n = r.args.kill_engine if r.args.kill_engine is not None else r.args.engines - 1
    proc = next(p for p in r.cluster.procs if p.name == f"engine-{n}")
    assert proc.popen is not None
    # Its exit is expected from the kill on: out of the cluster's list first, or `_monitor`
    # may see it dead while this task waits for it and fail the run (seen once in `make test`).
    r.cluster.procs.remove(proc)
    t = r.now()
    proc.popen.kill()
    await asyncio.to_thread(proc.popen.wait)
    log.warning("soak: engine killed", node=n, t=round(t, 1))
    r.faults.append({"fault": "kill_engine", "node": n, "at_s": round(t, 1)})


def _routers(cluster: Cluster) -> list[str]:
    """Each router's own address: the replicas' (not the front's), or the one router's."""
    return cluster.replica_urls or [cluster.router_url]


async def _restart_router(r: _Run, session: aiohttp.ClientSession) -> None:
    cluster = r.cluster
    name = "router-0" if cluster.replica_urls else "router"
    url = _routers(cluster)[0]
    proc = next(p for p in cluster.procs if p.name == name)
    r.overhead.append(await _scrape(session, url))
    t = r.now()
    log.warning("soak: restarting the router", t=round(t, 1))

    def restart() -> None:
        # Out of the monitored list while it is down on purpose.
        cluster.procs.remove(proc)
        proc.interrupt()
        proc.wait()
        proc.start()
        cluster.procs.append(proc)
        cluster_command.wait_healthy(cluster, f"{url}/health", f"the router ({name})")

    await asyncio.to_thread(restart)
    away = r.now() - t
    assert proc.popen is not None
    r.watch("router (restarted)", proc.popen.pid)
    r.faults.append({"fault": "restart_router", "at_s": round(t, 1), "away_s": round(away, 2)})


async def _scrape(session: aiohttp.ClientSession, router: str) -> probes.Buckets:
    """The router's overhead histogram now; empty when /metrics cannot be read."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with session.get(f"{router}/metrics", timeout=aiohttp.ClientTimeout(5)) as resp:
            if resp.status == 200:
                return probes.histogram_buckets(await resp.text())
    log.warning("soak: router metrics unreadable", router=router)
    return {}
