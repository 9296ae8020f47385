"""Who hears what the dispatcher does with each request: the planner's window and the metrics.

The dispatcher tells its `DispatchObserver` (passed at construction) of each request placed
(`arrival`: its prompt, and the cached prefix the placement counted on), each piece of text
decoded (`tokens`), what the prefill really found cached (`prefilled`, reported by the decode
side when it finishes), the router's own overhead (`dispatched`) and the time the decode-KV
gate held the request (`admitted`). `DispatchObserver` itself hears nothing (a base to override
only some); `Observers` tells several; `PlannerFeed` feeds the planner's `Slices`.
"""

from __future__ import annotations

from collections.abc import Sequence

from evolving_infra.planner.slices import Slices


class DispatchObserver:
    """Every event the dispatcher reports; each a no-op here."""

    def arrival(
        self,
        prompt_tokens: int,
        uncached: int,
        cached: int,
        hashes: Sequence[int],
        now: float,
        think_s: float | None = None,
    ) -> None:
        """A request placed: `uncached` + `cached` = `prompt_tokens` as the placement saw it;
        `think_s`: since its branch's last answer (None: its first request, or a retry)."""

    def answered(self, ttft_s: float, response_s: float) -> None:
        """A request's answer ended: its first token `ttft_s` after its arrival, its last
        `response_s` after."""

    def tokens(self, n: int) -> None:
        """`n` more tokens decoded."""

    def prefilled(self, prompt_tokens: int, uncached: int) -> None:
        """A request's prefill computed `uncached` of its `prompt_tokens`."""

    def dispatched(self, overhead_s: float) -> None:
        """The router's own time for a request: arrival to leaving for the engines, the gate's
        hold left out."""

    def admitted(self, held_s: float) -> None:
        """How long the decode-KV gate held a request."""

    def migrated(self, tokens: int) -> None:
        """A request whose decode stream broke went on elsewhere after `tokens` output tokens."""


class Observers(DispatchObserver):
    """Tells each of `observers`, in order."""

    def __init__(self, *observers: DispatchObserver) -> None:
        self.observers = observers

    def arrival(
        self,
        prompt_tokens: int,
        uncached: int,
        cached: int,
        hashes: Sequence[int],
        now: float,
        think_s: float | None = None,
    ) -> None:
        for o in self.observers:
            o.arrival(prompt_tokens, uncached, cached, hashes, now, think_s)

    def answered(self, ttft_s: float, response_s: float) -> None:
        for o in self.observers:
            o.answered(ttft_s, response_s)

    def tokens(self, n: int) -> None:
        for o in self.observers:
            o.tokens(n)

    def prefilled(self, prompt_tokens: int, uncached: int) -> None:
        for o in self.observers:
            o.prefilled(prompt_tokens, uncached)

    def dispatched(self, overhead_s: float) -> None:
        for o in self.observers:
            o.dispatched(overhead_s)

    def admitted(self, held_s: float) -> None:
        for o in self.observers:
            o.admitted(held_s)

    def migrated(self, tokens: int) -> None:
        for o in self.observers:
            o.migrated(tokens)


class PlannerFeed(DispatchObserver):
    """The planner's window (`planner.slices.Slices`): arrivals, tokens and prefills."""

    def __init__(self, slices: Slices) -> None:
        self.slices = slices

    def arrival(
        self,
        prompt_tokens: int,
        uncached: int,
        cached: int,
        hashes: Sequence[int],
        now: float,
        think_s: float | None = None,
    ) -> None:
        self.slices.arrival(prompt_tokens, uncached, cached, hashes, now, think_s=think_s)

    def answered(self, ttft_s: float, response_s: float) -> None:
        self.slices.answered(ttft_s, response_s)

    def tokens(self, n: int) -> None:
        self.slices.tokens(n)

    def prefilled(self, prompt_tokens: int, uncached: int) -> None:
        self.slices.prefilled(prompt_tokens, uncached)
