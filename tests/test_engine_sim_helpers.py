"""Shared pieces of the simulated-engine tests: engines on loopback, a recording event sink.

Everything is real: `SimEngine` with the simulator's `Node`/`NodeKv`, the Rust `KvDirectory`,
aiohttp servers and clients on 127.0.0.1. Small capacities and `time_scale` keep runs short.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from evolving_infra import KvDirectory
from evolving_infra.engines.sim import EngineSettings, Medium, SimEngine, build_app
from evolving_infra.timing.specs import H100, LLAMA3_8B, Deployment

PAGE = 4


def settings(**changes: Any) -> EngineSettings:
    base = EngineSettings(
        node_id=0,
        phase="prefill",
        deployment=Deployment(LLAMA3_8B, H100, tp=1),
        page_size=PAGE,
        time_scale=20.0,
        l1_blocks=4096,
        l2_blocks=0,
        switch_seconds=2.0,
        kv_hold_real_s=10.0,
    )
    return replace(base, **changes)


@dataclass(slots=True)
class RecordingSink:
    """A `KvEventSink` that keeps every event, to replay into a fresh directory."""

    events: list[tuple[Any, ...]] = field(default_factory=list)

    def block_stored(
        self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], medium: Medium
    ) -> None:
        self.events.append(("stored", list(hashes), parent, list(token_ids), medium))

    def block_removed(self, hashes: Sequence[int], medium: Medium) -> None:
        self.events.append(("removed", list(hashes), medium))

    def all_blocks_cleared(self) -> None:
        self.events.append(("cleared",))

    def replay(self, node: int) -> KvDirectory:
        """A router's view: a fresh directory fed only these events."""
        d = KvDirectory()
        tier = {"GPU": "L1", "CPU": "L2"}
        for e in self.events:
            if e[0] == "stored":
                d.store(node, tier[e[4]], e[1], e[2])  # type: ignore[arg-type]
            elif e[0] == "removed":
                d.remove(node, tier[e[2]], e[1])  # type: ignore[arg-type]
            else:
                d.clear(node)
        return d


@dataclass(slots=True)
class Running:
    engine: SimEngine
    url: str
    http: aiohttp.ClientSession
    sink: RecordingSink

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        async with self.http.post(self.url + path, json=body) as r:
            return r.status, await r.json(content_type=None)

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.http.get(self.url + path) as r:
            return r.status, await r.json(content_type=None)

    async def stream(self, path: str, body: Any) -> list[Any]:
        async with self.http.post(self.url + path, json=body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            return parse_sse(await r.text())


@asynccontextmanager
async def running(s: EngineSettings) -> AsyncIterator[Running]:
    sink = RecordingSink()
    engine = SimEngine(s, kv_sink=sink)
    await engine.start()
    server = TestServer(build_app(engine), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            yield Running(engine, f"http://127.0.0.1:{server.port}", http, sink)
    finally:
        await engine.close()
        await server.close()


def parse_sse(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def prompt(i: int, tokens: int) -> list[int]:
    """A distinct prompt per i (ids < 2^32)."""
    return [(i * 7919 + k) % 50000 for k in range(tokens)]


def holdings(d: KvDirectory, node: int, tier: str) -> set[int]:
    return set(d.eviction_order(node, tier))  # type: ignore[arg-type]
