"""The live system as users start it (`evolving-infra cluster up`): real engine and router
processes on loopback, real HTTP, gRPC and ZMQ.

Covers issue 6's end-to-end cases that are not the trace replay (tests/test_replay.py): KV hits
visible through the events, a phase switch during load with no lost request and the node's KV
kept, and bad input (malformed bodies, unknown branches, an engine that is down).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster_helpers import start_cluster
from evolving_infra.cluster import command as cluster_command
from evolving_infra.control import EngineClient

PROMPT = "You are a coding agent. The repository has these files: " + "src/main.rs " * 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster_command.Cluster]:
    tmp = tmp_path_factory.mktemp("cluster")
    c = start_cluster(tmp, engines=4, prefill=2)
    try:
        yield c
    finally:
        c.stop()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=body, headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:  # it holds the connection's socket
            return e.code, json.loads(e.read())


def _chat(router: str, content: str, branch: str | None = None, **extra: Any) -> tuple[int, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    headers = {"X-Agent-Branch": branch} if branch else {}
    return _post(f"{router}/v1/chat/completions", json.dumps({**body, **extra}).encode(), headers)


def test_kv_hits_are_visible_through_the_events(cluster: cluster_command.Cluster) -> None:
    """The first turn computes the prompt; the router learns from the prefill engine's KV
    events where it lives and sends the second turn there: cached tokens come back."""
    status, first = _chat(cluster.router_url, PROMPT, branch="agent-a")
    assert status == 200, first
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = 0
    deadline = time.monotonic() + 10
    while cached == 0 and time.monotonic() < deadline:
        status, again = _chat(cluster.router_url, PROMPT + " and a follow-up", branch="agent-a")
        assert status == 200, again
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    page = 16
    assert cached >= (len(PROMPT) + 20) // page * page - 2 * page, again["usage"]
    with urllib.request.urlopen(f"{cluster.router_url}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert "evolving_cached_prompt_tokens_total" in metrics
    overhead = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("evolving_router_overhead_seconds_count")
    ]
    assert overhead, "router overhead histogram missing"
    assert overhead[0] >= 2
    # The router tells the engines which chains live branches need (every 2 s): the prefill
    # engine holding agent-a's context keeps it ahead of unneeded blocks.
    deadline = time.monotonic() + 10
    hinted = 0
    while hinted == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        hinted = sum(
            _get(f"{url}/server_info")["internal_states"][0]["hinted_chains"]
            for url in cluster.engine_urls
        )
    assert hinted >= 1


def test_metrics_show_each_engines_load_the_planner_and_ingestion(
    cluster: cluster_command.Cluster,
) -> None:
    status, _ = _chat(cluster.router_url, PROMPT, branch="agent-metrics")
    assert status == 200
    with urllib.request.urlopen(f"{cluster.router_url}/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}

    def values(name: str, label: str) -> dict[str, float]:
        return {s.labels[label]: s.value for s in families[name].samples}

    nodes = {"0", "1", "2", "3"}
    capacity = values("evolving_engine_kv_capacity_blocks", "node")
    assert set(capacity) == nodes
    assert min(capacity.values()) > 0
    assert set(values("evolving_engine_decode_requests", "node")) == nodes
    assert set(values("evolving_engine_queued_prefill_tokens", "node")) == nodes
    assert set(values("evolving_engine_kv_used_blocks", "node")) == nodes
    assert values("evolving_planner_split", "phase") == {"prefill": 2.0, "decode": 2.0}
    assert families["evolving_planner_enabled"].samples[0].value == 0.0  # --no-planner
    assert values("evolving_planner_switches", "outcome") == {"ok": 0.0, "failed": 0.0}
    events = values("evolving_kv_events", "counter")
    assert events["batches"] > 0
    assert events["corrupt_batches"] == 0
    assert {"gaps", "replays", "restarts"} <= set(events)
    assert values("evolving_admission_shed", "when") == {"early": 0.0, "late": 0.0}
    pulls = values("evolving_kv_pulls", "outcome")
    assert set(pulls) == {"ok", "failed", "skipped"}
    assert pulls["failed"] == 0
    assert families["evolving_kv_pulled_blocks"].samples[0].value >= 0
    assert families["process_resident_memory_bytes"].samples[0].value > 0


async def _load(router: str, stop: asyncio.Event, results: list[int], worker: int) -> None:
    async with aiohttp.ClientSession() as s:
        turn = 0
        while not stop.is_set():
            turn += 1
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": f"worker {worker} " + PROMPT * 2}],
                "max_tokens": 24,
                "stream": turn % 2 == 0,
            }
            async with s.post(
                f"{router}/v1/chat/completions",
                json=body,
                headers={"X-Agent-Branch": f"load-{worker}"},
            ) as r:
                text = await r.text()
                ok = r.status == 200 and ("[DONE]" in text or not body["stream"])
                results.append(200 if ok else r.status)


def test_phase_switch_during_load_loses_nothing_and_keeps_kv(
    cluster: cluster_command.Cluster,
) -> None:
    async def scenario() -> tuple[Any, list[int], Any]:
        stop = asyncio.Event()
        results: list[int] = []
        workers = [
            asyncio.create_task(_load(cluster.router_url, stop, results, w)) for w in range(8)
        ]
        await asyncio.sleep(2.0)
        async with EngineClient(cluster.control[1]) as c:
            held_before = _get(f"{cluster.engine_urls[1]}/server_info")["internal_states"][0]
            result = await c.switch_phase("decode", timeout=120)
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*workers)
        return result, results, held_before

    result, results, before = asyncio.run(scenario())
    assert results
    assert all(s == 200 for s in results), results
    assert result.phase == "decode"
    assert result.previous_phase == "prefill"
    assert before["l1_held_blocks"] > 0
    assert result.l1_blocks_kept > 0  # in-place: the node's cache survived the flip
    after = _get(f"{cluster.engine_urls[1]}/server_info")["internal_states"][0]
    assert after["phase"] == "decode"
    assert after["l1_held_blocks"] > 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        node = _get(f"{cluster.router_url}/health")["dispatcher"]["1"]
        if node == {"phase": "decode", "state": "up", "reason": ""}:
            break
        time.sleep(0.2)
    assert node["phase"] == "decode", node
    assert node["state"] == "up", node


@pytest.mark.parametrize(
    ("path", "body", "headers", "status"),
    [
        ("/v1/chat/completions", b"{not json", {}, 400),
        ("/v1/chat/completions", b'{"model": "m", "messages": "hi"}', {}, 400),
        ("/v1/completions", b'{"model": "m"}', {}, 400),
        ("/v1/branches/%0A/end", b"", {}, 400),
        (
            "/v1/chat/completions",
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}',
            {"X-Agent-Branch": "child", "X-Agent-Parent-Branch": "ghost", "X-Agent-Event": "fork"},
            404,
        ),
    ],
)
def test_bad_input_gets_a_typed_error_and_the_router_keeps_serving(
    cluster: cluster_command.Cluster,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
) -> None:
    got, answer = _post(f"{cluster.router_url}{path}", body, headers)
    assert got == status
    assert answer["error"]["message"]
    ok, _ = _chat(cluster.router_url, "still serving?")
    assert ok == 200


def test_requests_that_cannot_fit_are_the_clients_400s_not_502s(
    cluster: cluster_command.Cluster,
) -> None:
    """The router knows the model's context and the engines' KV: a request no engine could
    hold is `context_length_exceeded` before dispatch; what only the engine refuses (the
    simulated engine's max_new_tokens of 65,536) is relayed as a 400, not a 502."""
    limit = _get(f"{cluster.router_url}/health")["context_tokens"]
    assert 70_000 < limit <= 131_072  # Llama-3-8B's context, or less by the engines' KV
    status, answer = _chat(cluster.router_url, "hi " * 10, max_tokens=limit - 5)
    assert status == 400, answer
    assert answer["error"]["code"] == "context_length_exceeded"
    assert answer["error"]["param"] == "messages"
    status, answer = _chat(cluster.router_url, "hi", max_tokens=70_000)
    assert status == 400, answer
    assert answer["error"]["code"] == "engine_rejected"
    assert "max_new_tokens" in answer["error"]["message"]
    models = _get(f"{cluster.router_url}/v1/models")["data"]
    assert [m["id"] for m in models] == ["llama-3-8b"]  # what cluster up runs
    ok, _ = _chat(cluster.router_url, "still serving?")
    assert ok == 200


def test_with_every_decode_engine_down_requests_get_503_with_the_reason(
    tmp_path: Path,
) -> None:
    c = start_cluster(tmp_path, engines=2, prefill=1)
    try:
        status, _ = _chat(c.router_url, "warm up")
        assert status == 200
        decode = c.procs[1]
        assert decode.name == "engine-1"
        assert decode.popen is not None
        decode.popen.kill()
        decode.popen.wait()
        status, answer = _chat(c.router_url, "is anyone there?")
        assert status == 503, answer
        assert "engine 1" in answer["error"]["message"] or "decode" in answer["error"]["message"]
        with pytest.raises(urllib.error.HTTPError) as down:
            _get(f"{c.router_url}/health")  # not ready: no decode engine
        down.value.close()
        assert down.value.code == 503
        ok = _get(f"{c.engine_urls[0]}/health")
        assert ok["state"] == "serving"
    finally:
        c.stop()


def test_an_engine_whose_port_is_taken_starts_again_on_fresh_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port picked for engine 1's HTTP API is taken before it binds (here by a socket of the
    test; in CI once by another engine's ZMQ stream): `cluster up` starts it again on fresh ports
    instead of failing, and the cluster serves."""
    import socket

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    held = int(taken.getsockname()[1])
    from evolving_infra.ports import free_ports as real

    calls: list[int] = []

    def first_has_a_taken_port(count: int) -> list[int]:
        ports: list[int] = real(count)
        calls.append(count)
        if len(calls) == 1:  # the engines' ports: http[0], http[1], grpc[0], grpc[1]
            ports[1] = held
        return ports

    monkeypatch.setattr(cluster_command, "free_ports", first_has_a_taken_port)
    try:
        c = start_cluster(tmp_path, engines=2, prefill=1)
    finally:
        taken.close()
    try:
        # The engines' ports, fresh ones for engine 1, then the router's (`--router-port 0`).
        assert calls == [4, 2, 1], calls
        assert "cannot listen" in (tmp_path / "engine-1.log").read_text()
        assert f":{held}" not in c.engine_urls[1]
        assert _get(f"{c.engine_urls[1]}/health")["state"] == "serving"
        status, _ = _chat(c.router_url, "hello after a restart")
        assert status == 200
    finally:
        c.stop()
