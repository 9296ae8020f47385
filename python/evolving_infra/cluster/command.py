"""`evolving-infra cluster up`: a whole live system on loopback, in the foreground.

Starts, in order, the Mooncake master of the shared L2 pool (unless `--no-pool`), `--engines`
simulated engines (the first `--prefill` of them in the prefill phase, the rest decode; each an
`evolving-infra engine` process with its HTTP data API, its EngineControl gRPC service and its
ZMQ event and sample streams) and the router daemon in front of them; waits until the router's
`/health` says every engine is up; then waits. With `--routers N` (N > 1), N router replicas
share a Redis server (Debian's `redis-server`, started here: the leader lease that decides which
replica runs the planner) and a front (`evolving-infra front`) takes the clients at
`--router-port`, each agent tree on one replica; each replica's own API and `/metrics` are at its
own port (the table lists them). Ctrl-C (or SIGTERM) stops the router first, then
the engines, then the master. A process that fails to start stops everything, and the command
fails (status 1), naming it and its log, with the child's own error line when it printed one,
else the end of its log. Once up, a process that exits on its own is restarted on the same ports,
with back-off, while the rest keeps serving (`supervise.py`); with `--stop-on-failure`, any exit
stops everything and fails the command as at start. A router port already taken, or Mooncake
missing without `--no-pool`, is found before anything starts: one line, status 2.

Each process logs to `--log-dir` (JSON lines; the master's own log too).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.table import Table

from evolving_infra.argtypes import (
    check_output_folder,
    int_at_least,
    natural_int,
    port,
    positive_float,
    positive_int,
    positive_seconds,
)
from evolving_infra.cluster.procs import ClusterError, Proc
from evolving_infra.cluster.supervise import Supervisor
from evolving_infra.engines.pool.errors import MooncakeMissingError
from evolving_infra.engines.sim.command import check_deployment
from evolving_infra.engines.sim.core import EngineSettings
from evolving_infra.errors import CommandError
from evolving_infra.planner import options
from evolving_infra.ports import LOOPBACK, PortInUseError, check_listen, free_ports, port_taken
from evolving_infra.router.config import DEFAULT_SHUTDOWN_TIMEOUT
from evolving_infra.router.replicas import redis_answers, redis_server_command
from evolving_infra.timing.specs import GPUS, MODELS, Deployment

NAME = "cluster"
HELP = "start a live system on loopback: pool master, simulated engines and the router"
DESCRIPTION = (
    __doc__.split("\n", 2)[2]
    + """
example:
  evolving-infra cluster up --engines 4 --router-port 8000
  evolving-infra replay data/traces/claude-code --router http://127.0.0.1:8000 --agents 8
"""
)

START_TIMEOUT_S = 60.0

# An engine that cannot bind its ports is started again on fresh ones, this many times in all.
ENGINE_START_ATTEMPTS = 3
# What an engine prints, and exits with status 2, when one of its ports is taken
# (`ports.PortInUseError`, from `engines/sim/command.py`).
CANNOT_LISTEN = "error: cannot listen"


@dataclass
class Cluster:
    """The processes of one `cluster up`, stopped in reverse order of start."""

    log_dir: Path
    procs: list[Proc] = field(default_factory=list)
    master: object | None = None  # a PoolMaster, when the pool runs
    router_url: str = ""  # the router's, or with replicas the front's
    replica_urls: list[str] = field(default_factory=list)  # each router replica's own
    engine_urls: list[str] = field(default_factory=list)  # HTTP data API, by node id
    control: list[str] = field(default_factory=list)  # EngineControl HOST:PORT, by node id

    def spawn(self, name: str, args: list[str]) -> Proc:
        p = Proc(name, args, self.log_dir / f"{name}.log")
        p.start()
        self.procs.append(p)
        return p

    def check(self) -> None:
        for p in self.procs:
            code = p.exited()
            if code is not None:
                raise p.failure(code)

    def stop(self) -> None:
        """The front and the routers first (no new requests reach the engines), then every
        engine at once (each closes its pool client, ~2 s), then Redis and the master."""
        front = [p for p in self.procs if p.name == "front"]
        routers = [p for p in self.procs if p.name.startswith("router")]
        last = [p for p in self.procs if p.name == "redis"]
        engines = [p for p in self.procs if p not in (*front, *routers, *last)]
        for group in (front, routers, engines, last):
            for p in group:
                p.interrupt()
            for p in group:
                p.wait()
        stop = getattr(self.master, "stop", None)
        if stop is not None:
            stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("action", choices=["up"], help="up: start everything and wait (Ctrl-C stops it all)")
    a("--engines", type=int_at_least(2), default=4,
      help="simulated engines, at least 2 (default: 4)")  # fmt: skip
    a("--prefill", type=natural_int, default=None,
      help="engines starting in the prefill phase (default: half, rounded up)")  # fmt: skip
    a("--router-port", type=port, default=8000,
      help="the router's port, or the front's with --routers N > 1 (0: any free port;"
      " default: 8000)")  # fmt: skip
    a("--routers", type=positive_int, default=1,
      help="router replicas (default: 1). More than one: a Redis server for their leader"
      " lease and a front at --router-port that keeps each agent tree on one replica")  # fmt: skip
    a("--model", choices=sorted(MODELS), default="llama-3-8b", help="model (default: %(default)s)")
    a("--gpu", choices=sorted(GPUS), default="h100-sxm", help="GPU kind (default: %(default)s)")
    a("--tp", type=positive_int, default=1, help="GPUs per engine (default: 1)")
    a("--page-size", type=positive_int, default=16, help="tokens per KV page (default: 16)")
    a("--time-scale", type=positive_float, default=1.0,
      help="simulated seconds per real second in the engines (default: 1)")  # fmt: skip
    a("--no-pool", action="store_true", help="no Mooncake master: engines keep L2 to themselves")
    a("--l2-blocks", type=natural_int, default=None,
      help="each engine's host KV capacity in pages (default: 1 TiB per 8 GPUs)")  # fmt: skip
    a("--no-planner", action="store_true", help="the router never switches engine phases")
    a(
        "--no-admission",
        action="store_true",
        help="the router dispatches at once instead of holding requests until a decode engine"
        " has room for their KV (router --no-admission)",
    )
    a("--planner-interval", type=positive_seconds, default=60.0,
      help="seconds between the router's phase-split decisions (default: 60)")  # fmt: skip
    options.add_argument(parser, without={"interval": "use --planner-interval"})
    a("--log-dir", type=Path, default=Path("cluster-logs"),
      help="folder of every process's log (default: cluster-logs)")  # fmt: skip
    a("--stop-on-failure", action="store_true",
      help="stop everything when any process exits, instead of restarting it (with back-off)"
      " while the rest keeps serving")  # fmt: skip


def _get_json(url: str, timeout: float = 1.0) -> dict[str, object] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            data = json.loads(r.read())
            return data if isinstance(data, dict) else None
    except (OSError, urllib.error.URLError, ValueError):
        return None


def wait_healthy(
    cluster: Cluster, url: str, what: str, log: Path | None = None
) -> dict[str, object]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        cluster.check()
        health = _get_json(url)
        # The router says {"status": "ok"}; an engine {"state": "serving"} (SGLang: a bare 200).
        if health is not None and (
            health.get("status") == "ok" or health.get("state") == "serving"
        ):
            return health
        time.sleep(0.2)
    raise ClusterError(
        f"{what} not healthy after {START_TIMEOUT_S:.0f} s ({url})"
        + (f"; see its log: {log}" if log is not None else "")
    )


def _start_listening(
    cluster: Cluster, name: str, command: list[str], fixed_port: int, what: str
) -> tuple[Proc, str]:
    """A process that serves HTTP with `/health` on `--port` (a router, the front), started and
    healthy: (it, its URL). Port 0 is picked now, after the engines bound theirs, so that none of
    their ZMQ streams can take it in between; one taken before the process bound it anyway is
    picked again, a `fixed_port` taken meanwhile is the user's error (`--router-port`)."""
    for attempt in range(1, ENGINE_START_ATTEMPTS + 1):
        chosen = fixed_port or free_ports(1)[0]
        proc = cluster.spawn(name, [*command, "--port", str(chosen)])
        proc.stop_timeout_s = DEFAULT_SHUTDOWN_TIMEOUT + 15.0  # its drain, then exit
        url = f"http://127.0.0.1:{chosen}"
        try:
            wait_healthy(cluster, f"{url}/health", what, proc.log)
            return proc, url
        except ClusterError:
            if proc.exited() is None or not port_taken(LOOPBACK, chosen):
                raise
            if fixed_port:
                raise PortInUseError(LOOPBACK, chosen, "--router-port") from None
            if attempt == ENGINE_START_ATTEMPTS:
                raise
            cluster.procs.remove(proc)
    raise AssertionError("unreachable: the last attempt raises")


def _start_redis(cluster: Cluster) -> tuple[Proc, str]:
    """Debian's redis-server on a free loopback port, no persistence: the router replicas'
    coordination service. (It, its URL) once it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:  # checked before anything started (`up`); gone since: say so
        raise ClusterError("redis-server not found", "apt-get install redis-server")
    [chosen] = free_ports(1)
    proc = cluster.spawn("redis", redis_server_command(binary, chosen))
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        cluster.check()
        if redis_answers(chosen):
            return proc, f"redis://{LOOPBACK}:{chosen}/0"
        time.sleep(0.1)
    raise ClusterError(f"redis-server not answering after {START_TIMEOUT_S:.0f} s; see {proc.log}")


def up(args: argparse.Namespace, console: Console) -> Cluster:
    """Starts everything (see the module docstring); the caller stops it."""
    n = args.engines
    prefill = (n + 1) // 2 if args.prefill is None else min(args.prefill, n)
    # The user's errors first, before anything starts: a router port taken, a bad log folder.
    deployment = Deployment(MODELS[args.model], GPUS[args.gpu], args.tp)
    check_deployment(EngineSettings(deployment=deployment, page_size=args.page_size))
    try:  # what the routers would refuse at start: refused here, before anything starts
        options.settings(tuple(args.planner_option), n)
    except ValueError as e:
        raise CommandError(f"--planner-option: {e}") from None
    if args.router_port:
        check_listen(LOOPBACK, args.router_port, "--router-port")
    if args.routers > 1 and shutil.which("redis-server") is None:
        raise CommandError(
            "--routers: router replicas share a Redis server, and redis-server is not installed",
            "apt-get install redis-server (Debian), or run one router",
        )
    check_output_folder(args.log_dir, "--log-dir")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(args.log_dir)
    me = [sys.executable, "-m", "evolving_infra"]
    try:
        pool: list[str] = []
        if not args.no_pool:
            from evolving_infra.engines.pool import PoolMaster

            master = PoolMaster(log_dir=args.log_dir)
            cluster.master = master
            try:
                pool = ["--pool-master", master.start().rpc]
            except MooncakeMissingError as e:
                raise e.otherwise("run with --no-pool") from None
        ports = free_ports(2 * n)
        http, grpc = ports[:n], ports[n:]
        l2 = [] if args.l2_blocks is None else ["--l2-blocks", str(args.l2_blocks)]

        def spawn_engine(i: int) -> Proc:
            phase = "prefill" if i < prefill else "decode"
            return cluster.spawn(
                f"engine-{i}",
                [*me, "engine", "--backend", "sim", "--node-id", str(i), "--phase", phase,
                 "--port", str(http[i]), "--grpc-port", str(grpc[i]), "--model", args.model,
                 "--gpu", args.gpu, "--tp", str(args.tp), "--page-size", str(args.page_size),
                 "--time-scale", str(args.time_scale), "--seed", str(i), *l2, *pool],
            )  # fmt: skip

        engines = [spawn_engine(i) for i in range(n)]
        starts = [1] * n
        for i in range(n):
            while True:
                try:
                    url = f"http://127.0.0.1:{http[i]}/health"
                    wait_healthy(cluster, url, f"engine {i}", engines[i].log)
                    break
                except ClusterError:
                    # NOTE: a port `free_ports` picked can be taken before its engine binds it,
                    # by another process or by the engines started just before (each binds its
                    # ZMQ streams to ports the kernel picks). Such an engine exits saying it
                    # cannot listen: it starts again on fresh ports, as the pool master does.
                    unbound = [
                        j for j, e in enumerate(engines)
                        if e.exited() is not None and CANNOT_LISTEN in e.tail()
                    ]  # fmt: skip
                    if not unbound or any(starts[j] == ENGINE_START_ATTEMPTS for j in unbound):
                        raise
                    fresh = free_ports(2 * len(unbound))
                    for k, j in enumerate(unbound):
                        cluster.procs.remove(engines[j])
                        http[j], grpc[j] = fresh[2 * k], fresh[2 * k + 1]
                        engines[j] = spawn_engine(j)
                        starts[j] += 1
        cluster.engine_urls = [f"http://127.0.0.1:{p}" for p in http]
        cluster.control = [f"127.0.0.1:{p}" for p in grpc]
        router_args = [*me, "router", "--engines", *(f"127.0.0.1:{g}" for g in grpc),
                       "--page-size", str(args.page_size),
                       "--planner-interval", str(args.planner_interval)]  # fmt: skip
        for name, value in args.planner_option:  # on to every router replica
            router_args += ["--planner-option", f"{name}={'none' if value is None else value}"]
        if args.no_planner:
            router_args.append("--no-planner")
        if args.no_admission:
            router_args.append("--no-admission")
        if args.routers == 1:
            router_proc, cluster.router_url = _start_listening(
                cluster, "router", router_args, args.router_port, "the router"
            )
            routers = [(router_proc, cluster.router_url)]
        else:
            redis, coordination = _start_redis(cluster)
            routers = [
                _start_listening(
                    cluster,
                    f"router-{i}",
                    [*router_args, "--coordination", coordination, "--replica", f"router-{i}"],
                    0,
                    f"router replica {i}",
                )
                for i in range(args.routers)
            ]
            cluster.replica_urls = [url for _, url in routers]
            front_args = [
                *me, "front", "--routers", *cluster.replica_urls, "--coordination", coordination
            ]  # fmt: skip
            front, cluster.router_url = _start_listening(
                cluster, "front", front_args, args.router_port, "the front"
            )
    except BaseException:
        cluster.stop()
        raise
    table = Table(title="evolving-infra cluster on 127.0.0.1")
    for col in ("process", "pid", "phase", "address", "log"):
        table.add_column(col)
    if args.routers == 1:
        table.add_row("router", str(routers[0][0].pid), "", cluster.router_url, "router.log")
    else:
        table.add_row("front", str(front.pid), "", cluster.router_url, "front.log")
        for i, (proc, url) in enumerate(routers):
            table.add_row(f"router replica {i}", str(proc.pid), "", url, f"router-{i}.log")
        table.add_row("redis", str(redis.pid), "", coordination, "redis.log")
    for i in range(n):
        phase = "prefill" if i < prefill else "decode"
        table.add_row(
            f"engine {i}",
            str(engines[i].pid),
            phase,
            f"http://127.0.0.1:{http[i]} (control 127.0.0.1:{grpc[i]})",
            f"engine-{i}.log",
        )
    if pool:
        table.add_row("mooncake master", "", "", pool[1], "(log dir)")
    console.print(table)
    console.print(f"logs in {args.log_dir}/; Ctrl-C stops everything")
    return cluster


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:  # a second Ctrl-C: the router cuts its drain short
            for p in cluster.procs:
                if p.name == "router":
                    p.interrupt()
        stopping = True

    cluster = up(args, console)  # its errors are reported by cli.main
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    supervisor = None if args.stop_on_failure else Supervisor(cluster.procs, console)
    try:
        while not stopping:
            if supervisor is None:
                cluster.check()
            else:
                supervisor.poll()
            time.sleep(0.5)
        console.print(
            "stopping: the router lets its requests finish (Ctrl-C again cuts them), then"
            " engines, pool master"
        )
    finally:
        cluster.stop()
        if supervisor is not None and supervisor.restarts:
            said = ", ".join(f"{name} x{k}" for name, k in supervisor.restarts.items())
            console.print(f"restarts: {said}")
    return 0
