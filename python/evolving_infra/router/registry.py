"""The router's engines: who they are, whether they take work, and the work sent to each.

One `EngineRegistry` per router. The daemon's discovery and health loops and the planner's
switches change it (`add`, `set_state`, `set_phase`); the dispatcher reads it to place requests
and counts its work in it (`loads`); the planner samples it. Whoever must react to a change of
who is up, in which phase, or how much decode room there is listens (`listen`): the decode-KV
gate re-checks its waiting requests on every change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from evolving_infra.router.dispatcher import DispatcherHealth
from evolving_infra.router.loads import EngineHandle, EngineState, LoadTracker
from evolving_infra.types import Phase

log = structlog.get_logger("evolving_infra.router.registry")


class EngineRegistry:
    """Engines by node id, their states and phases, and the load the router sent them."""

    def __init__(self, engines: Sequence[EngineHandle] = ()) -> None:
        self.engines: dict[int, EngineHandle] = {e.node: e for e in engines}
        self.loads = LoadTracker()
        self._listeners: list[Callable[[], None]] = []

    def listen(self, fn: Callable[[], None]) -> None:
        """`fn()` after every change of an engine's state or phase, an engine added, or work
        finished (`changed`)."""
        self._listeners.append(fn)

    def changed(self) -> None:
        """Tells the listeners (the dispatcher calls it when a request's decode room frees)."""
        for fn in self._listeners:
            fn()

    def add(self, engine: EngineHandle) -> None:
        """An engine that joined after start, or came back (perhaps on other ports)."""
        self.engines[engine.node] = engine
        self.changed()

    def set_state(self, node: int, state: EngineState, reason: str = "") -> None:
        e = self.engines[node]
        if e.state != state:
            log.info("engine_state", node=node, old=e.state, new=state, reason=reason)
        e.state, e.reason = state, reason
        self.changed()

    def set_phase(self, node: int, phase: Phase) -> None:
        self.engines[node].phase = phase
        self.changed()

    def up(self, phase: Phase | None = None) -> list[EngineHandle]:
        """The engines that take requests now (of `phase`, if given)."""
        return [
            e
            for e in self.engines.values()
            if e.state == "up" and (phase is None or e.phase == phase)
        ]

    def decode_space(self) -> dict[int, tuple[int, int]]:
        """The up decode engines' KV capacity and blocks in use by the router's count."""
        return {
            e.node: (e.kv_capacity_blocks, self.loads.used_blocks(e.node))
            for e in self.up("decode")
        }

    def health(self) -> DispatcherHealth:
        """Ready when at least one engine of each phase is up; degraded while any engine is
        down (a draining one is switching phase, which is normal); each engine's state."""
        phases = {e.phase for e in self.up()}
        detail = {
            str(e.node): {"phase": e.phase, "state": e.state, "reason": e.reason}
            for e in self.engines.values()
        }
        missing = [p for p in ("prefill", "decode") if p not in phases]
        if missing:
            return DispatcherHealth(False, f"no {' or '.join(missing)} engine up", detail)
        down = sorted(e.node for e in self.engines.values() if e.state == "down")
        degraded = f"{len(down)} of {len(self.engines)} engines down: {down}" if down else ""
        return DispatcherHealth(True, "", detail, degraded)

    def states(self) -> str:
        """`node=phase/state, ...` by node (for error messages)."""
        return (
            ", ".join(
                f"{e.node}={e.phase}/{e.state}"
                for e in sorted(self.engines.values(), key=lambda e: e.node)
            )
            or "none"
        )
