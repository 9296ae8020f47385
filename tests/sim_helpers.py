"""Helpers of the simulator's tests: a planner that switches once, and where requests sit."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from evolving_infra.nodemodel.request import SimRequest
from evolving_infra.planner.base import SliceStats, Split, SwitchMode
from evolving_infra.sim.cluster import Cluster
from evolving_infra.timing.model import IterationModel


class OneSwitch:
    """Asks once, at `when`, for `target`; counts `switch_done` calls."""

    name = "one-switch"
    interval = 10.0
    reads_reuse = False

    def __init__(self, mode: SwitchMode, target: Split, when: float = 30.0) -> None:
        self.switch_mode: SwitchMode = mode
        self.target = target
        self.when = when
        self.asked = False
        self.done = 0
        self.windows: list[int] = []

    def decide(
        self, now: float, split: Split, window: Sequence[SliceStats], model: IterationModel
    ) -> Split | None:
        self.windows.append(len(window))
        if not self.asked and now >= self.when:
            self.asked = True
            return self.target
        return None

    def switch_done(self) -> None:
        self.done += 1

    def decision(self, now: float, asked: Split | None) -> dict[str, Any] | None:
        return None


def in_system(cluster: Cluster) -> list[SimRequest]:
    """Every issued, unanswered request, found where it sits (queues, batches, transfers)."""
    out: list[SimRequest] = [*cluster.pending_prefill, *cluster.pending_decode]
    for n in cluster.nodes:
        out += [*n.queue, *n.held.values(), *n.running, *n.batch, *n.joining, *n.waiting]
    for _, _, fn, arg in cluster._heap:
        if getattr(fn, "__name__", "") == "_arrived":
            out.append(arg)
    # A request whose prefill finished is in no prefill list: it waits for a decode node
    # (above) or its KV is in flight (the heap). The one request in two places: under early
    # decode allocation, one that waits for its decode node's reservation is also held by its
    # prefill node (or waits for one, `pending_prefill`).
    places = Counter(r.id for r in out)
    unique = list({r.id: r for r in out}.values())
    for r in unique:
        early_wait = r.prefill_done < 0 and not r.bootstrapped
        assert places[r.id] <= (2 if early_wait else 1), f"{r} is in {places[r.id]} places"
    return unique
