"""A live system for tests, started as users start it: `evolving-infra cluster up` (`up()`),
real engine and router processes on loopback, logs in the test's temporary folder."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

from rich.console import Console

from evolving_infra.cluster import command as cluster_command


def start_cluster(
    log_dir: Path,
    *,
    engines: int = 2,
    prefill: int = 1,
    time_scale: float = 20.0,
    routers: int = 1,
    planner: bool = False,
) -> cluster_command.Cluster:
    """`cluster up` without the pool, and without the planner unless `planner` (the tests that
    need the pool start their own); the caller stops it (`Cluster.stop`)."""
    parser = argparse.ArgumentParser()
    cluster_command.add_arguments(parser)
    args = parser.parse_args(
        ["up", "--engines", str(engines), "--prefill", str(prefill), "--no-pool",
         *([] if planner else ["--no-planner"]), "--router-port", "0",
         "--routers", str(routers),
         "--time-scale", str(time_scale), "--log-dir", str(log_dir)]
    )  # fmt: skip
    return cluster_command.up(args, Console(file=io.StringIO()))
