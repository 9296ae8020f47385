"""Router replicas as users start them (`evolving-infra cluster up --routers 2`): real engine,
router, front and redis-server processes on loopback. One replica leads (runs the planner), the
front spreads agent trees over both, and killing the leader hands the planner to the other within
the lease's time while every request through the front is still answered."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster_helpers import start_cluster
from evolving_infra.cluster import command as cluster_command
from evolving_infra.router.replicas import DEFAULT_TTL_S


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster_command.Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("replicas"), routers=2, planner=True)
    try:
        yield c
    finally:
        c.stop()


def metric(url: str, name: str) -> float | None:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return float(s.value)
    return None


def leaders(c: cluster_command.Cluster) -> list[int]:
    return [i for i, u in enumerate(c.replica_urls) if metric(u, "evolving_planner_leader") == 1]


def chat(url: str, branch: str) -> tuple[int, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": f"hi from {branch}"}],
            "max_tokens": 4}  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Agent-Branch": branch},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, json.loads(r.read())


def until(check: Any, timeout: float) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.1)
    return time.monotonic() - start


def test_one_leader_trees_spread_and_a_killed_leader_is_replaced(
    cluster: cluster_command.Cluster,
) -> None:
    until(lambda: len(leaders(cluster)) == 1, 3 * DEFAULT_TTL_S)
    [leader] = leaders(cluster)
    branches = [f"agent-{i}" for i in range(16)]
    for b in branches:
        assert chat(cluster.router_url, b)[0] == 200
    served = [metric(u, "evolving_prompt_tokens_total") or 0 for u in cluster.replica_urls]
    assert all(s > 0 for s in served), served  # both replicas have trees
    proc = next(p for p in cluster.procs if p.name == f"router-{leader}")
    assert proc.popen is not None
    proc.popen.kill()  # no release: the lease must expire
    # The lease expires at most a TTL after the kill; the other replica tries every TTL / 10.
    took = until(lambda: leaders(cluster) == [1 - leader], DEFAULT_TTL_S + 2.0)
    assert took <= DEFAULT_TTL_S + 2.0
    for b in branches:  # the dead replica's trees go to the other one
        assert chat(cluster.router_url, b)[0] == 200
