"""Keeping `cluster up`'s processes running: a process that exits on its own is started again.

An engine (or the router) that dies is restarted with the same command line, so on the same
ports: the router's health loop finds the engine answering again at the control address it
knows, re-learns its cache from a replay of its KV events and routes to it again (the router's
`_rejoin`); a restarted router finds the engines where they were. Meanwhile the rest of the
cluster keeps serving: the router retries the dead engine's requests that had sent the client
nothing on other engines.

Restarts back off: the first after `BACKOFF_S`, each next one in a row twice as late, up to
`MAX_BACKOFF_S`; a process that then stays up `STABLE_AFTER_S` starts its count over. After
`MAX_RESTARTS_IN_ROW` restarts that did not hold, the supervisor gives that process up (said
once, in red) and the others keep serving. Every exit and restart is printed with the process's
own error line or log, and counted (`Supervisor.restarts`).

`cluster up --stop-on-failure` keeps the strict behaviour instead: any exit stops everything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console

from evolving_infra.cluster.procs import Proc

BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0
MAX_RESTARTS_IN_ROW = 5


@dataclass(slots=True)
class _State:
    restarts: int = 0  # in all
    in_row: int = 0  # restarts since the process last stayed up STABLE_AFTER_S
    due: float | None = None  # when an exited process starts again
    given_up: bool = False
    since: float | None = None  # when the supervisor started it, or first saw it running


class Supervisor:
    """Restarts the processes in `procs` that exit (see the module docstring); `poll()` often."""

    def __init__(
        self,
        procs: list[Proc],
        console: Console,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.procs = procs
        self.console = console
        self.clock = clock
        self._state: dict[str, _State] = {}

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts per process name, of those restarted at least once."""
        return {name: s.restarts for name, s in self._state.items() if s.restarts}

    def poll(self) -> None:
        now = self.clock()
        for p in self.procs:
            s = self._state.setdefault(p.name, _State())
            code = p.exited()
            if code is None:
                if s.since is None:
                    s.since = now
                if s.in_row and now - s.since >= STABLE_AFTER_S:
                    s.in_row = 0
                continue
            if s.given_up:
                continue
            if s.due is None:
                if s.in_row >= MAX_RESTARTS_IN_ROW:
                    s.given_up = True
                    self.console.print(
                        f"{p.name} keeps exiting ({s.in_row} restarts in a row did not hold):"
                        f" given up, the rest keeps serving. {p.failure(code)}",
                        style="red",
                    )
                    continue
                delay = min(BACKOFF_S * 2**s.in_row, MAX_BACKOFF_S)
                s.due = now + delay
                self.console.print(
                    f"{p.failure(code)}; restarting it in {delay:g} s", style="yellow"
                )
            elif now >= s.due:
                p.start()
                s.since, s.due = now, None
                s.restarts += 1
                s.in_row += 1
                self.console.print(
                    f"{p.name} restarted (pid {p.pid}, restart {s.restarts})", style="green"
                )
