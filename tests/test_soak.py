"""`evolving-infra soak` (issue 8): a short run of the real command, with both faults, and the
probes it measures with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from evolving_infra.soak import probes


def test_soak_with_an_engine_killed_and_the_router_restarted_loses_nothing(
    tmp_path: Path,
) -> None:
    """The command as `make soak` runs it, scaled down: every process real, the faults real
    signals. Failures are allowed (the killed engine's requests, clients that reach the router
    while it restarts, each answered with an error); lost requests are not."""
    out = subprocess.run(
        [sys.executable, "-m", "evolving_infra", "soak", "--agents", "6", "--duration", "30",
         "--kill-engine-at", "8", "--restart-router-at", "15", "--request-timeout", "60",
         "--log-dir", str(tmp_path / "logs"), "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["ok"] is True
    assert report["lost"] == 0
    assert report["completed"] > 0
    assert report["issued"] == report["completed"] + report["failed"]
    faults = {f["fault"]: f for f in report["faults"]}
    assert faults["kill_engine"]["node"] == 3
    assert 7.0 <= faults["kill_engine"]["at_s"] < 12.0
    assert faults["restart_router"]["away_s"] > 0
    names = {m["name"] for m in report["memory"]}
    assert names >= {"engine-0", "engine-1", "engine-2", "engine-3", "router", "mooncake-master"}
    assert "router (restarted)" in names
    for m in report["memory"]:
        assert m["samples"] >= 1
        assert 1.0 < m["start_mib"] <= m["peak_mib"]
    assert report["router_overhead_count"] >= report["completed"] - report["failed"]
    assert 0.0 < report["router_overhead_p99_s"] <= 1.0


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
