"""The router's decode-KV gate: a request is dispatched only once its decode engine has room for it.

SGLang's gateway sends a request to its prefill and decode engines at once. Under SGLang's default
`early` decode allocation the decode engine reserves the KV first (`DecodePreallocQueue`) and the
prefill engine holds the request in its bootstrap queue meanwhile; when the decode side is full,
requests pile up on prefill engines that were chosen when they arrived, on loads that are stale by
the time the KV is reserved, and those waiting requests count in every prefill engine's queue.
The gate holds them in the router instead: the decode engine is chosen when the request arrives
(the routing policy's `choose_decode`, with the requests already waiting counted as taking their
KV), the request waits in that engine's queue, first come first served, until the router's own
count of the engine's KV (`LoadTracker`: the prompt and `max_tokens` of every request it sent
there and has not seen end) leaves room for it, and its prefill engine is chosen then, on current
loads.

One queue per decode engine, as SGLang's decode engine pre-allocates in order
(`pop_preallocated` stops at the first request that does not fit): a large request waiting for
room on one engine holds up the requests behind it there, and the engine takes no new ones while
it waits (its queue counts as used), so it is not starved; but a request that fits on another
engine passes. With one queue for the whole cluster, a request needing most of an engine stopped
every dispatch until some engine had drained. The simulator runs the same rule
(`sim.policies.PolicySpec.admission`: the decode node reserves first, and a node's waiting
requests count in its load); docs/scenarios.md says what it changes.

The gate never waits when waiting cannot help: with no decode engine up (the placement then says
so), or for a request larger than every decode engine (the engine answers for it). A decode
engine that goes down or changes phase hands its queue to the others, in arrival order.

Overload is shed at once, not after a long hold: from the blocks each decode engine freed over
the last minute (`freed`, told by the dispatcher as requests end) the gate predicts how long a
new request would wait for its room (the blocks queued ahead of it and its own, less the room
free, at that rate), and when that is over `max_wait_s` it refuses the request with
`OverloadedError` (429, with the predicted wait as Retry-After) before any engine saw it. A
request held longer than `max_wait_s` anyway (the prediction was short, or there was none: no
block freed lately) is refused the same way, still before dispatch. Nothing the gate admits
fails for want of room: the client learns early, and a retry later finds the room.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from evolving_infra.router.dispatcher import OverloadedError, ShuttingDownError

# The drain rate is read over this long: long enough to span a few agent generations (a 4k-token
# answer takes about a minute on a loaded decode engine), short enough to follow the load.
RATE_WINDOW_S = 60.0
# Retry-After is at most this: past it the prediction says little, and a client should look again.
MAX_RETRY_AFTER_S = 300.0

# `space()`: the up decode engines, node -> (KV capacity, blocks used by the router's count).
Space = Callable[[], Mapping[int, tuple[int, int]]]
# `choose(extra)`: the decode engine the routing policy picks for one request when `extra[node]`
# more blocks count as used on a node (the gate's commitments); a node that is not an up decode
# engine (e.g. -1) if it picks none.
Choose = Callable[[Mapping[int, int]], int]


@dataclass(eq=False, slots=True)
class _Waiter:
    seq: int  # arrival order, kept when the waiter moves to another engine's queue
    blocks: int
    choose: Choose
    engine: int
    future: asyncio.Future[int | None]


class DecodeGate:
    """Admission on decode KV, first come first served per decode engine (module docstring)."""

    def __init__(
        self, space: Space, *, max_wait_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`max_wait_s`: the longest a request may wait for decode room, predicted or held,
        before it is refused (429)."""
        self._space = space
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._start = clock()
        # Blocks freed per decode engine, (time, blocks), over the last RATE_WINDOW_S.
        self._freed: dict[int, deque[tuple[float, int]]] = {}
        self.shed_early = 0  # refused on the prediction, at arrival
        self.shed_late = 0  # refused after a hold of max_wait_s
        self._queues: dict[int, deque[_Waiter]] = {}
        self._queued: dict[int, int] = {}  # blocks waiting per engine
        # Blocks of admitted requests that have not resumed yet to take their room: counted as
        # used, or an arrival in between would find the room free.
        self._claimed: dict[int, int] = {}
        self._seq = itertools.count()
        self._closed = False

    def close(self) -> int:
        """The router stops: every request still held here is refused (`ShuttingDownError`:
        no engine has seen it, its client sends it again), and so is every later one, so that
        the drain waits only for requests under way. Returns how many were held."""
        self._closed = True
        held = [w for q in self._queues.values() for w in q]
        for w in held:
            if not w.future.done():
                w.future.set_exception(self._shutting_down())
        return len(held)

    @staticmethod
    def _shutting_down() -> ShuttingDownError:
        return ShuttingDownError("the router is shutting down: send the request again")

    @property
    def waiting(self) -> int:
        """Requests held now (a Prometheus gauge reads it)."""
        return sum(len(q) for q in self._queues.values())

    def extra(self) -> dict[int, int]:
        """Blocks the gate has committed per engine beyond the router's count: the requests
        waiting there and those admitted that have not taken their room yet. Placement counts
        them as used."""
        out = {e: b for e, b in self._claimed.items() if b}
        for e, b in self._queued.items():
            if b:
                out[e] = out.get(e, 0) + b
        return out

    def claimed(self) -> dict[int, int]:
        """Blocks of requests admitted per engine that have not taken their room yet: what other
        router replicas must count as used (`replicas.LoadExchange`). Not the requests waiting
        here: they use no room, and counted by each other's gates, two replicas' queues would
        wait on each other until both shed."""
        return {e: b for e, b in self._claimed.items() if b}

    def freed(self, engine: int, blocks: int) -> None:
        """A request that held `blocks` on decode engine `engine` ended (the drain rate)."""
        now = self._clock()
        q = self._freed.setdefault(engine, deque())
        q.append((now, blocks))
        self._prune(q, now)

    def _prune(self, q: deque[tuple[float, int]], now: float) -> None:
        while q and q[0][0] < now - RATE_WINDOW_S:
            q.popleft()

    def expected_wait(
        self, engine: int, blocks: int, space: Mapping[int, tuple[int, int]] | None = None
    ) -> float | None:
        """Seconds until a request of `blocks` arriving now would have its room on `engine`:
        the blocks queued there before it and its own, less the room free, at the rate the
        engine freed blocks over the last minute. 0: room now; None: nothing freed lately, no
        rate to go by."""
        space = self._space() if space is None else space
        need = self._queued.get(engine, 0) + blocks - self._free(engine, space)
        if need <= 0:
            return 0.0
        now = self._clock()
        q = self._freed.get(engine)
        if q is not None:
            self._prune(q, now)
        if not q:
            return None
        span = min(RATE_WINDOW_S, max(now - self._start, 1.0))
        return need / (sum(b for _, b in q) / span)

    def _overloaded(
        self, blocks: int, engine: int, wait: float | None, held: bool
    ) -> OverloadedError:
        after = min(max(wait if wait is not None else self.max_wait_s, 1.0), MAX_RETRY_AFTER_S)
        if held:
            self.shed_late += 1
            why = f"held {self.max_wait_s:g} s"
        else:
            self.shed_early += 1
            why = f"predicted wait {wait:.0f} s, over the bound of {self.max_wait_s:g} s"
        return OverloadedError(
            f"no decode room for {blocks} KV blocks on engine {engine} ({why})",
            retry_after_s=after,
        )

    async def wait(self, blocks: int, choose: Choose) -> int | None:
        """Waits until the request's decode engine has room for `blocks` and the requests that
        came before it there have gone; returns that engine, whose room the caller must take
        before its next `await`. None: the gate does not apply (no decode engine up, or none
        could ever hold `blocks`), the placement decides. Raises `OverloadedError` (429) at
        once when the predicted wait is over `max_wait_s`, or after holding it that long."""
        if self._closed:
            raise self._shutting_down()
        space = self._space()
        if not space or blocks > max(cap for cap, _ in space.values()):
            return None
        engine = choose(self.extra())
        if engine not in space:
            return None
        if not self._queues.get(engine) and self._free(engine, space) >= blocks:
            return engine
        predicted = self.expected_wait(engine, blocks, space)
        if predicted is not None and predicted > self.max_wait_s:
            raise self._overloaded(blocks, engine, predicted, held=False)
        loop = asyncio.get_running_loop()
        w = _Waiter(next(self._seq), blocks, choose, engine, loop.create_future())
        self._enqueue(w)
        try:
            async with asyncio.timeout(self.max_wait_s):
                return await w.future
        except TimeoutError:
            wait = self.expected_wait(w.engine, 0)
            raise self._overloaded(blocks, w.engine, wait, held=True) from None
        finally:
            if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                admitted = w.future.result()
                if admitted is not None:
                    # The caller takes the room now (or, gone, leaves it to the next).
                    self._claimed[admitted] -= blocks
            else:
                self._dequeue(w)  # timed out or the client went away while queued
            # The next request may fit now (room left over, or this one's given back).
            loop.call_soon(self.notify)

    def notify(self) -> None:
        """Room may have freed (a request ended, an engine came up, went down or changed phase):
        admits each engine's first requests that fit, after moving the queues of engines that
        are no longer up decode engines to the others."""
        space = self._space()
        if not space:
            # No decode engine up: waiting cannot help, the placement answers (503).
            for q in self._queues.values():
                for w in q:
                    self._admit(w, None)
            self._queues.clear()
            self._queued.clear()
            return
        biggest = max(cap for cap, _ in space.values())
        gone = [e for e in self._queues if e not in space]
        if gone:
            moved = sorted((w for e in gone for w in self._queues.pop(e)), key=lambda w: w.seq)
            for e in gone:
                self._queued.pop(e, None)
            for w in moved:
                if w.future.done():
                    continue
                w.engine = w.choose(self.extra())
                if w.engine in space:
                    self._enqueue(w)
                else:
                    self._admit(w, None)
        for e in list(self._queues):
            q = self._queues[e]
            while q:
                w = q[0]
                if not w.future.done():
                    if w.blocks > biggest:
                        self._admit(w, None)  # no engine could ever hold it: let it go on
                    elif self._free(e, space) >= w.blocks:
                        self._admit(w, e)
                    else:
                        break
                q.popleft()
                self._queued[e] -= w.blocks
            if not q:
                del self._queues[e]
                self._queued.pop(e, None)

    def _free(self, engine: int, space: Mapping[int, tuple[int, int]]) -> int:
        cap, used = space[engine]
        return cap - used - self._claimed.get(engine, 0)

    def _admit(self, w: _Waiter, engine: int | None) -> None:
        if w.future.done():
            return
        if engine is not None:
            self._claimed[engine] = self._claimed.get(engine, 0) + w.blocks
        w.future.set_result(engine)

    def _enqueue(self, w: _Waiter) -> None:
        q = self._queues.setdefault(w.engine, deque())
        # In arrival order: at the back, unless it moved here from an engine that went away.
        i = len(q)
        while i > 0 and q[i - 1].seq > w.seq:
            i -= 1
        q.insert(i, w)
        self._queued[w.engine] = self._queued.get(w.engine, 0) + w.blocks

    def _dequeue(self, w: _Waiter) -> None:
        q = self._queues.get(w.engine)
        if q is None or w not in q:
            return  # already taken out (admitted, or its engine's queue was handed on)
        q.remove(w)
        self._queued[w.engine] -= w.blocks
        if not q:
            del self._queues[w.engine]
            self._queued.pop(w.engine, None)
