"""`evolving-infra soak` (issue 8): a short run of the real command, with both faults, and the
probes it measures with."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from evolving_infra.soak import probes


def soak(tmp_path: Path, *extra: str) -> dict[str, Any]:
    """`soak` scaled down (6 agents, 30 s, engine 3 killed at 8 s, the router restarted at 15 s),
    in a process of its own; its JSON report."""
    out = subprocess.run(
        [sys.executable, "-m", "evolving_infra", "soak", "--agents", "6", "--duration", "30",
         "--kill-engine-at", "8", "--restart-router-at", "15", "--request-timeout", "60",
         "--log-dir", str(tmp_path / "logs"), "--json", *extra],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def test_soak_with_an_engine_killed_and_the_router_restarted_loses_nothing(
    tmp_path: Path,
) -> None:
    """The command as `make soak` runs it, scaled down: every process real, the faults real
    signals. Failures are allowed (the killed engine's requests, clients that reach the router
    while it restarts, each answered with an error); lost requests are not."""
    report = soak(tmp_path)
    assert report["ok"] is True
    assert report["lost"] == 0
    assert report["completed"] > 0
    assert report["issued"] == report["completed"] + report["failed"]
    early = report["shed_early"] + report["rejected"] + report["unreachable"]
    assert report["failed"] == early + report["failed_late"]
    faults = {f["fault"]: f for f in report["faults"]}
    assert faults["kill_engine"]["node"] == 3
    assert 7.0 <= faults["kill_engine"]["at_s"] < 12.0
    assert faults["restart_router"]["away_s"] > 0
    names = {m["name"] for m in report["memory"]}
    assert names >= {"engine-0", "engine-1", "engine-2", "engine-3", "router", "mooncake-master"}
    assert {"router (restarted)", "soak (the agents)"} <= names
    for m in report["memory"]:
        assert m["samples"] >= 1
        assert 1.0 < m["start_mib"] <= m["peak_mib"]
        assert m["cpu_s"] > 0.0
    # Warm-up is a quarter of the run (7.5 s) of each process's own life, the restarted
    # router's counted from its restart.
    restarted = next(m for m in report["memory"] if m["name"] == "router (restarted)")
    warm_at = restarted["warm_at_s"]
    assert warm_at is None or warm_at >= faults["restart_router"]["at_s"] + 7.5
    assert report["router_overhead_count"] >= report["completed"] - report["failed"]
    # A measured figure, not the floor of the +Inf bucket.
    assert report["router_overhead_p99_above_top_bucket"] is False
    assert 0.0 < report["router_overhead_p99_s"] <= 30.0


def test_soak_over_two_router_replicas_with_one_restarted_loses_nothing(tmp_path: Path) -> None:
    """Two replicas behind the front, an engine killed and replica 0 restarted (its lease
    handed over, its trees moved and back): nothing lost, both replicas' overhead counted."""
    report = soak(tmp_path, "--routers", "2", "--no-pool")
    assert report["ok"] is True
    assert report["lost"] == 0
    assert report["completed"] > 0
    names = {m["name"] for m in report["memory"]}
    assert names >= {"front", "router-0", "router-1", "redis", "router (restarted)"}
    assert report["router_overhead_count"] >= report["completed"] - report["failed"]
    logs = tmp_path / "logs"
    leaders = [
        line for f in logs.glob("router-*.log") for line in f.read_text().splitlines()
        if '"event": "leader"' in line
    ]  # fmt: skip
    assert leaders  # a replica led


def test_quantile_reads_buckets_as_prometheus_does() -> None:
    registry = CollectorRegistry()
    h = Histogram(probes.OVERHEAD, "x", buckets=(0.01, 0.1, 1.0), registry=registry)
    for v in [0.005] * 50 + [0.05] * 40 + [0.5] * 10:
        h.observe(v)
    buckets = probes.histogram_buckets(generate_latest(registry).decode())
    assert buckets == {0.01: 50.0, 0.1: 90.0, 1.0: 100.0, float("inf"): 100.0}
    assert probes.quantile(buckets, 0.5) == pytest.approx(0.01)
    # The 99th of 100 lies in (0.1, 1.0], 9 of that bucket's 10 in: linear within the bucket.
    assert probes.quantile(buckets, 0.99) == pytest.approx(0.1 + 0.9 * 0.9)
    twice = probes.merge([buckets, buckets])
    assert twice[1.0] == 200.0
    assert probes.quantile(twice, 0.99) == pytest.approx(probes.quantile(buckets, 0.99))
    assert probes.quantile({}, 0.99) is None
    assert probes.quantile({1.0: 0.0, float("inf"): 0.0}, 0.5) is None
    with pytest.raises(ValueError, match="quantile"):
        probes.quantile(buckets, 1.5)


def test_memory_series_reads_this_process_and_stops_at_a_dead_one() -> None:
    mine = probes.MemorySeries("me", os.getpid())
    mine.add(0.0)
    mine.add(10.0)
    summary = mine.summary(warm_after=5.0)
    assert summary["samples"] == 2
    assert isinstance(summary["end_mib"], float)
    assert summary["end_mib"] > 1.0
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = probes.MemorySeries("gone", gone.pid)
    dead.add(0.0)
    assert dead.summary(warm_after=0.0) == {"name": "gone", "pid": gone.pid, "samples": 0}


def test_a_quantile_beyond_the_top_bucket_is_flagged() -> None:
    buckets = {0.1: 50.0, 1.0: 90.0, float("inf"): 100.0}
    assert not probes.above_top(buckets, 0.5)
    assert probes.above_top(buckets, 0.99)  # 99 > 90 observations at or under 1 s
    assert probes.quantile(buckets, 0.99) == 1.0  # all Prometheus can say: a floor
    assert not probes.above_top({}, 0.99)
    assert not probes.above_top({1.0: 0.0, float("inf"): 0.0}, 0.99)


def test_router_overhead_buckets_reach_past_one_second() -> None:
    from evolving_infra.router.metrics import OVERHEAD_BUCKETS

    assert tuple(sorted(OVERHEAD_BUCKETS)) == OVERHEAD_BUCKETS
    assert OVERHEAD_BUCKETS[-1] >= 30.0
    assert {0.001, 0.01, 0.1, 1.0} <= set(OVERHEAD_BUCKETS)


def test_memory_growth_counts_from_each_process_own_warm_up() -> None:
    """A process restarted late in the run (the router) warms up from its own start: its growth
    is measured from then, and a series that ended before its warm-up has none."""
    late = probes.MemorySeries("router (restarted)", 1)
    mib = 2**20
    late.samples = [(400.0, 100 * mib), (450.0, 300 * mib), (560.0, 320 * mib), (600.0, 330 * mib)]
    s = late.summary(warm_after=150.0)
    assert s["warm_at_s"] == 560.0
    assert s["warm_mib"] == 320.0
    assert s["growth_after_warmup_mib"] == 10.0
    assert s["growth_after_warmup_pct"] == pytest.approx(3.1)
    short = probes.MemorySeries("engine-3", 2)
    short.samples = [(0.0, 100 * mib), (100.0, 200 * mib)]  # killed at 100 s
    s = short.summary(warm_after=150.0)
    assert s["warm_mib"] is None
    assert s["growth_after_warmup_mib"] is None
    assert s["growth_after_warmup_pct"] is None


def test_cpu_seconds_reads_this_process() -> None:
    spent = probes.cpu_seconds(os.getpid())
    assert spent is not None
    assert spent > 0.0
    assert probes.cpu_seconds(2**22 + 1) is None  # beyond pid_max: no such process


def test_the_report_says_when_p99_is_only_a_floor_and_shows_growth() -> None:
    from rich.console import Console

    from evolving_infra.replay.summary import summarize
    from evolving_infra.soak.report import SoakReport, render

    summary = summarize([], agents=1, duration_s=1.0, elapsed_s=1.0, issued=0, unissued=0)
    memory = [{"name": "router", "pid": 1, "samples": 3, "start_mib": 100.0, "warm_mib": 200.0,
               "warm_at_s": 150.0, "end_mib": 210.0, "peak_mib": 220.0, "cpu_s": 12.5,
               "growth_after_warmup_mib": 10.0, "growth_after_warmup_pct": 5.0}]  # fmt: skip
    report = SoakReport(summary, overhead_p50_s=0.002, overhead_p99_s=30.0,
                        overhead_p99_above_top=True, memory=memory)  # fmt: skip
    console = Console(record=True, width=200)
    render(report, console)
    text = console.export_text()
    assert ">= 30000.0 ms" in text
    assert "2.0 ms" in text
    assert "+10.0 MiB (+5.0%) since 150.0 s" in text
    assert report.to_dict()["router_overhead_p99_above_top_bucket"] is True


def test_the_soak_hands_its_cluster_options_to_cluster_up() -> None:
    """`soak` starts the cluster through `cluster up`'s own parser: the engines' GPU kind, pool
    and host KV capacity reach it (a soak-sized L2 fills within the run, so memory can level)."""
    from evolving_infra.soak import command as soak_command

    p = argparse.ArgumentParser()
    soak_command.add_arguments(p)
    args = p.parse_args(
        ["--engines", "6", "--gpu", "h200-sxm", "--no-pool", "--l2-blocks", "5000",
         "--routers", "3"]
    )  # fmt: skip
    up = soak_command._cluster_args(args)
    assert (up.engines, up.gpu, up.no_pool, up.l2_blocks) == (6, "h200-sxm", True, 5000)
    assert up.routers == 3
    assert soak_command._cluster_args(p.parse_args([])).l2_blocks is None
