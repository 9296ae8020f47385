"""Faults in the live system (issue 8): an engine killed mid-load, the router restarted, the
router started while an engine is down. Real engine and router processes on loopback, started
with `cluster up` (tests/cluster_helpers.py); the faults are real signals to real processes.

What the router shows is read from its `/metrics`: `evolving_engine_state{node,state}` and
`evolving_directory_blocks{node,tier}` (what the cluster directory says a node holds).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from cluster_helpers import start_cluster
from evolving_infra.cluster import command as cluster_command
from evolving_infra.cluster import procs

PROMPT = "An agent's context: the repository holds these files. " + "src/lib.rs " * 16


def metrics(router: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"{router}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def blocks(router: str, node: int) -> float:
    m = metrics(router)
    return sum(
        v
        for (name, labels), v in m.items()
        if name == "evolving_directory_blocks" and ("node", str(node)) in labels
    )


def state(router: str, node: int) -> str | None:
    for (name, labels), v in metrics(router).items():
        if name == "evolving_engine_state" and ("node", str(node)) in labels and v == 1.0:
            return dict(labels)["state"]
    return None


def wait_for(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.25)


def chat(router: str, content: str, max_tokens: int = 4) -> dict[str, object]:
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    req = urllib.request.Request(
        f"{router}/v1/chat/completions",
        data=json.dumps({**body, "max_tokens": max_tokens}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        answer: dict[str, object] = json.loads(r.read())
        return answer


def proc(c: cluster_command.Cluster, name: str) -> procs.Proc:
    return next(p for p in c.procs if p.name == name)


def restart_router(c: cluster_command.Cluster) -> None:
    router = proc(c, "router")
    router.interrupt()
    router.wait()
    router.start()
    cluster_command.wait_healthy(c, f"{c.router_url}/health", "the router")


async def _client(
    router: str, stop: float, outcomes: list[str], i: int, max_tokens: int = 24
) -> None:
    """Closed loop until `stop`: each request ends in an answer or an error, never in silence
    (a 90 s client timeout would show as 'timeout'); a refused connection is tried again after
    0.2 s."""
    timeout = aiohttp.ClientTimeout(total=90)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        n = 0
        while time.monotonic() < stop:
            n += 1
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": f"{PROMPT} client {i} turn {n}"}],
                "max_tokens": max_tokens,
                "stream": i % 2 == 0,
            }
            try:
                async with s.post(f"{router}/v1/chat/completions", json=body) as r:
                    raw = await r.read()
                    if r.status != 200:
                        outcomes.append(f"http {r.status}")
                    elif b'"error"' in raw:
                        outcomes.append("stream error")
                    else:
                        outcomes.append("ok")
            except TimeoutError:
                outcomes.append("timeout")
            except aiohttp.ClientError as e:
                outcomes.append(f"client error {type(e).__name__}")
                if isinstance(e, aiohttp.ClientConnectorError):
                    await asyncio.sleep(0.2)


def test_engine_killed_mid_load_loses_nothing_and_its_node_is_dropped(tmp_path: Path) -> None:
    c = start_cluster(tmp_path, engines=4, prefill=2)
    try:
        router = c.router_url
        for i in range(4):
            chat(router, f"warm-up {i}: {PROMPT}")
        wait_for("a prefill node holds blocks", lambda: blocks(router, 0) + blocks(router, 1) > 0)
        # The prefill engine the router sent the prompts to (it holds their blocks) crashes.
        n = max((0, 1), key=lambda node: blocks(router, node))
        victim = proc(c, f"engine-{n}")
        outcomes: list[str] = []

        async def load() -> None:
            stop = time.monotonic() + 8.0
            clients = [_client(router, stop, outcomes, i) for i in range(6)]

            async def kill() -> None:
                await asyncio.sleep(2.5)
                assert victim.popen is not None
                victim.popen.kill()

            await asyncio.gather(*clients, kill())

        asyncio.run(load())
        assert victim.popen is not None
        victim.popen.wait()
        c.procs.remove(victim)
        # Nothing hung or vanished; requests caught by the crash failed with an answer, and the
        # rest (most) were served, including those retried on another node.
        assert "timeout" not in outcomes, outcomes
        assert outcomes.count("ok") >= len(outcomes) - 6, sorted(set(outcomes))
        wait_for(f"node {n} down", lambda: state(router, n) == "down")
        # Its holdings are no longer counted on (after three failed health checks).
        wait_for(f"node {n}'s blocks dropped", lambda: blocks(router, n) == 0, timeout=10)
        assert chat(router, "still serving?")["choices"]
        # The engine comes back (same ports): the router takes it again and learns its cache.
        c.procs.append(victim)
        victim.start()
        wait_for(f"node {n} back up", lambda: state(router, n) == "up")
        # What it computes now reaches the directory through its new event stream (served on
        # the engine directly: the router, free to choose, may well send new prompts elsewhere).
        assert chat(c.engine_urls[n], f"straight to the engine: {PROMPT}")["choices"]
        wait_for(f"node {n}'s new blocks learned", lambda: blocks(router, n) > 0)
    finally:
        c.stop()


def test_router_restart_relearns_the_directory_from_the_engines(tmp_path: Path) -> None:
    c = start_cluster(tmp_path, engines=2, prefill=1)
    try:
        router = c.router_url
        first = chat(router, PROMPT)
        assert first["choices"]
        wait_for("the prefill node's blocks learned", lambda: blocks(router, 0) > 0)
        before = blocks(router, 0)
        restart_router(c)
        # A fresh directory, re-learned from the engine's replay of its events from seq 0.
        wait_for("node 0's blocks re-learned", lambda: blocks(router, 0) == before)
        again = chat(router, PROMPT + " and one more question")
        usage = again["usage"]
        assert isinstance(usage, dict)
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0, usage
    finally:
        c.stop()


def test_a_router_restarted_under_load_finishes_every_request_it_took(tmp_path: Path) -> None:
    """SIGINT drains the router: it stops listening at once (a client is refused until the new
    one is up, and may retry), and every request it had taken, streaming or not, runs to its
    end before it exits; then the new router serves. Requests of ~1 s (300 tokens at the
    engines' real speed) are in flight when the signal comes."""
    c = start_cluster(tmp_path, engines=2, prefill=1, time_scale=1.0)
    try:
        router = c.router_url
        outcomes: list[str] = []

        async def load() -> None:
            stop = time.monotonic() + 10.0
            clients = [_client(router, stop, outcomes, i, max_tokens=300) for i in range(4)]

            async def restart() -> None:
                await asyncio.sleep(3.0)
                await asyncio.to_thread(restart_router, c)

            await asyncio.gather(*clients, restart())

        asyncio.run(load())
        # Refused: the listening socket closed, or a 503 on a kept-alive connection.
        refused = ("client error ClientConnectorError", "http 503")
        late = [o for o in outcomes if o != "ok" and o not in refused]
        assert not late, outcomes
        assert outcomes.count("ok") >= 8, outcomes
        log = proc(c, "router").log.read_text()
        drained = [json.loads(line) for line in log.splitlines() if "router_drained" in line]
        assert drained, "no drain logged"
        assert drained[0]["in_flight"] == 0, drained
        assert "router_stop_cut_requests" not in log
    finally:
        c.stop()


def test_a_decode_engine_killed_mid_stream_hands_its_streams_on(tmp_path: Path) -> None:
    """SIGKILL of the decode engine a streaming request is on, after it has streamed part of its
    answer: the router migrates the request (its prompt and the tokens streamed so far, to the
    other decode engine), and the client's stream goes on to the last token, unbroken, with
    usage counting all of them. 400 tokens at the engines' real speed take ~5 s."""
    c = start_cluster(tmp_path, engines=3, prefill=1, time_scale=1.0)
    try:
        router = c.router_url
        before = metrics(router).get(("evolving_request_migrations_total", ()), 0.0)

        def decoding(node: int) -> float:
            key = ("evolving_engine_decode_requests", (("node", str(node)),))
            return metrics(router).get(key, 0.0)

        async def run() -> tuple[str, dict[str, object], list[int]]:
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 400, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            text = ""
            usage: dict[str, object] = {}
            killed: list[int] = []
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"{router}/v1/completions", json=body) as r,
            ):
                assert r.status == 200
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    assert "error" not in chunk, chunk
                    for choice in chunk.get("choices") or ():
                        text += choice.get("text") or ""
                    usage = chunk.get("usage") or usage
                    on = [n for n in (1, 2) if decoding(n) > 0] if len(text) >= 50 else []
                    if not killed and len(on) == 1:  # the decode engine it is on
                        node = on[0]
                        victim = proc(c, f"engine-{node}")
                        c.procs.remove(victim)  # out of the cluster's watch: killed on purpose
                        assert victim.popen is not None
                        victim.popen.kill()
                        victim.popen.wait()
                        killed.append(node)
            return text, usage, killed

        text, usage, killed = asyncio.run(run())
        assert killed, "never streamed 50 tokens"
        assert usage["completion_tokens"] == 400, usage
        assert len(text) == 400  # the byte tokenizer: one character a token
        after = metrics(router).get(("evolving_request_migrations_total", ()), 0.0)
        assert after == before + 1
    finally:
        c.stop()


def test_router_started_with_an_engine_down_takes_it_when_it_answers(tmp_path: Path) -> None:
    c = start_cluster(tmp_path, engines=3, prefill=1)
    try:
        router = c.router_url
        late = proc(c, "engine-2")
        assert late.popen is not None
        late.popen.kill()
        late.popen.wait()
        c.procs.remove(late)
        restart_router(c)  # healthy with engines 0 and 1; engine 2 is retried
        assert state(router, 2) is None  # not known yet: it never answered this router
        assert chat(router, "served without engine 2")["choices"]
        c.procs.append(late)
        late.start()
        wait_for("engine 2 joined", lambda: state(router, 2) == "up")
    finally:
        c.stop()


def test_a_hung_engine_has_its_requests_pulled_back_not_left_to_time_out(tmp_path: Path) -> None:
    """SIGSTOP: the engine's sockets stay open but nothing answers (a hung process, a stuck
    GPU). Its control service misses three health checks; the router then pulls its requests
    back (retried elsewhere when nothing was streamed yet, else an error), so no request waits
    for its 600 s engine timeout, and other engines keep serving meanwhile (no head-of-line
    blocking)."""
    import signal

    c = start_cluster(tmp_path, engines=3, prefill=1)
    try:
        router = c.router_url
        assert chat(router, "warm up")["choices"]
        hung = proc(c, "engine-2")  # one of the two decode engines
        assert hung.popen is not None
        durations: list[float] = []
        outcomes: list[str] = []

        async def one(s: aiohttp.ClientSession, i: int) -> None:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": f"{PROMPT} request {i}"}],
                "max_tokens": 64,
                "stream": i % 2 == 0,
            }
            t0 = time.monotonic()
            try:
                async with s.post(f"{router}/v1/chat/completions", json=body) as r:
                    raw = await r.read()
                    ok = r.status == 200 and b'"error"' not in raw
                    outcomes.append("ok" if ok else f"error {r.status}")
            except (TimeoutError, aiohttp.ClientError) as e:
                outcomes.append(type(e).__name__)
            durations.append(time.monotonic() - t0)

        async def load() -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                first = [asyncio.create_task(one(s, i)) for i in range(8)]
                await asyncio.sleep(0.5)
                hung.popen.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
                await asyncio.sleep(1.0)
                later = [asyncio.create_task(one(s, 100 + i)) for i in range(4)]
                await asyncio.gather(*first, *later)

        try:
            asyncio.run(load())
            assert state(router, 2) == "down"
        finally:
            hung.popen.send_signal(signal.SIGCONT)
        assert len(outcomes) == 12
        assert "TimeoutError" not in outcomes, outcomes
        assert max(durations) < 30.0, durations
        assert outcomes.count("ok") >= 8, outcomes
        wait_for("engine 2 back", lambda: state(router, 2) == "up")
    finally:
        c.stop()
