"""The live planner loop carrying a decision out over real gRPC on real simulated engines.

The decision itself is the planner policy's (tested in tests/test_planner.py); here a policy that
asks for one fixed split stands in for it, so that the test is about the loop: the moving engine
stops getting requests, switches in place over `SwitchPhase`, comes back in the new phase with
its KV, and the policy hears `switch_done()`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import structlog.testing

from evolving_infra.control import EngineClient, serve
from evolving_infra.engines.sim import SimEngine
from evolving_infra.engines.sim.requests import GenerateSpec
from evolving_infra.planner.base import SliceStats, Split, SwitchMode
from evolving_infra.planner.evolving import EvolvingPlanner
from evolving_infra.router.loads import EngineHandle
from evolving_infra.router.planning import LivePlanner
from evolving_infra.router.registry import EngineRegistry
from evolving_infra.timing.model import IterationModel
from evolving_infra.types import Phase
from test_engine_sim_helpers import settings


class FixedTarget:
    """A planner policy that asks for one split, once."""

    name = "fixed"
    interval = 1.0
    switch_mode: SwitchMode = "in-place-keep"
    reads_reuse = False

    def __init__(self, target: Split) -> None:
        self.target = target
        self.asked = 0
        self.done = 0

    def decide(
        self, now: float, split: Split, window: Sequence[SliceStats], model: IterationModel
    ) -> Split | None:
        self.asked += 1
        return self.target if split != self.target else None

    def switch_done(self) -> None:
        self.done += 1

    def decision(self, now: float, asked: Split | None) -> dict[str, Any] | None:
        return None


def test_a_decision_becomes_an_in_place_switch_that_keeps_the_kv() -> None:
    async def scenario() -> None:
        engines = [SimEngine(settings(node_id=n, phase="prefill")) for n in (0, 1)]
        servers = []
        for e in engines:
            await e.start()
            servers.append(await serve(e, "127.0.0.1", 0))
        clients = {n: EngineClient(f"127.0.0.1:{port}") for n, (_, port) in enumerate(servers)}
        # Some KV on the engine that will move (node 0: least work, then lowest id): a mixed
        # request, prefilled and decoded there.
        live = engines[0].accept(GenerateSpec("warm", list(range(1, 200)), max_new_tokens=4))
        await live.wait()
        held_before = engines[0].kv.l1_held
        assert held_before > 0
        model = IterationModel()
        registry = EngineRegistry(
            [EngineHandle(n, "http://127.0.0.1:1", "prefill", "127.0.0.1", 1, 1000) for n in (0, 1)]
        )
        planner = LivePlanner(registry, clients, model, page_size=4, interval=1.0)
        policy = FixedTarget(Split(1, 1))
        planner.planner = policy  # type: ignore[assignment]
        planner.tick(time.monotonic())
        assert planner.switching(0)  # least work in flight, then lowest id
        assert registry.engines[0].state == "draining"
        handle = registry.engines[0]  # (a fresh name: mypy narrowed the attribute above)
        deadline = time.monotonic() + 20
        while not planner.switches and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        (record,) = planner.switches
        assert record.ok, record
        assert record.node == 0
        assert record.to == "decode"
        assert handle.phase == "decode"
        assert handle.state == "up"
        assert policy.done == 1
        assert planner.split() == Split(1, 1)
        planner.tick(time.monotonic())  # already at the target: nothing moves
        assert not planner.switching(0)
        assert not planner.switching(1)
        assert engines[0].kv.l1_held == held_before  # switched in place: its cache is intact
        assert engines[0].phase == "decode"
        for c in clients.values():
            await c.close()
        for (server, _), e in zip(servers, engines, strict=True):
            await server.stop(0)
            await e.close()

    asyncio.run(scenario())


def _still_planner() -> tuple[EngineRegistry, LivePlanner]:
    """Three engines (2P1D) and a live planner over them whose planner never moves."""
    phases: tuple[Phase, ...] = ("prefill", "prefill", "decode")
    registry = EngineRegistry(
        [
            EngineHandle(n, "http://127.0.0.1:1", p, "127.0.0.1", 1, 1000)
            for n, p in enumerate(phases)
        ]
    )
    lp = LivePlanner(registry, {}, IterationModel(), page_size=16, nodes=3)
    lp.planner = EvolvingPlanner(3, min_gain=10.0, kv_capacity_tokens=400_000)
    return registry, lp


def test_every_decision_is_logged_with_each_candidates_throughput() -> None:
    """The planner is not silent when it keeps the split: one `planner_decision` line per
    decision, with the split, the best candidate and Θ of every candidate."""
    _, lp = _still_planner()
    with structlog.testing.capture_logs() as logs:
        for minute in range(1, 7):
            for _ in range(20):
                lp.slices.arrival(4000, 3000, 1000, now=minute * 60.0 - 30)
                lp.slices.tokens(200)
            lp.tick(minute * 60.0)
    decided = [e for e in logs if e["event"] == "planner_decision"]
    assert len(decided) == 2  # at 300 s and 360 s: five slices with arrivals are needed
    for e in decided:
        assert e["split"] == "2P1D"
        assert e["asked"] is None
        assert set(e["theta"]) == {"1P2D", "2P1D"}
        assert e["best"] in e["theta"]


def test_the_planner_holds_while_an_engine_is_down_and_resumes_when_it_is_back() -> None:
    """One of three engines down (killed, or not joined yet): the split running (1P1D) is not
    a split of the three the planner weighs, so it decides nothing and says so once; with the
    engine back it decides again. Asked with such a split, the planner raised and its task
    died for the rest of the router's life (the soak's killed engine)."""
    registry, lp = _still_planner()
    registry.set_state(1, "down", "killed")
    with structlog.testing.capture_logs() as logs:
        for minute in range(1, 9):
            if minute == 5:
                registry.set_state(1, "up")
            for _ in range(20):
                lp.slices.arrival(4000, 3000, 1000, now=minute * 60.0 - 30)
                lp.slices.tokens(200)
            lp.tick(minute * 60.0)
    events = [e["event"] for e in logs if e["event"].startswith("planner_")]
    assert events.count("planner_held") == 1
    assert events.count("planner_resumed") == 1
    assert events.index("planner_resumed") < events.index("planner_decision")
    assert events.count("planner_decision") >= 2


def test_the_live_planner_takes_the_planner_options() -> None:
    """`router --planner-option`: the settings reach the evolving planner, and a longer window
    keeps that much of the past in the slices it is handed."""
    registry, _ = _still_planner()
    settings = {"window_s": 1200.0, "slices": 20, "min_gain": 0.05, "max_step": 1}
    lp = LivePlanner(registry, {}, IterationModel(), page_size=16, nodes=3, settings=settings)
    p = lp.planner
    assert (p.window_s, p.slices, p.min_gain, p.max_step) == (1200.0, 20, 0.05, 1)
    assert lp.slices.window_s == 1200.0
    assert LivePlanner(registry, {}, IterationModel(), page_size=16, nodes=3).slices.window_s == 600
