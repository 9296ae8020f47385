"""The router's decode-KV gate: a request is dispatched only once a decode engine has room for it.

SGLang's gateway sends a request to its prefill and decode engines at once. Under SGLang's default
`early` decode allocation the decode engine reserves the KV first (`DecodePreallocQueue`) and the
prefill engine holds the request in its bootstrap queue meanwhile; when the decode side is full,
requests pile up on prefill engines that were chosen when they arrived, on loads that are stale by
the time the KV is reserved, and those waiting requests count in every prefill engine's queue.
The gate holds them in the router instead, first come first served, until the router's own count
of a decode engine's KV (`LoadTracker`: the prompt and `max_tokens` of every request it sent
there and has not seen end) leaves room for the next one; then both engines are chosen, on
current loads. The simulator runs the same rule (`sim.policies.PolicySpec.admission`; scenario
cc-high in docs/scenarios.md for what it changes).

The gate never waits when waiting cannot help: with no decode engine up (the placement then says
so), or for a request larger than every decode engine (the engine answers for it).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from evolving_infra.router.dispatcher import NoEngineError

# `room(blocks)`: whether a decode engine has room for `blocks` now (or waiting cannot help).
Room = Callable[[int], bool]


class DecodeGate:
    """First come, first served admission on decode KV (see the module docstring)."""

    def __init__(self, room: Room, *, max_wait_s: float) -> None:
        self._room = room
        self.max_wait_s = max_wait_s
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        """Requests held now (a Prometheus gauge reads it)."""
        return len(self._waiters)

    async def wait(self, blocks: int) -> None:
        """Returns once a decode engine has room for `blocks` and every request that came
        before has gone; the caller must take the room before its next `await` (the check and
        the taking are then one step of the event loop). Raises `NoEngineError` after
        `max_wait_s` (the request is overload, 503)."""
        if not self._waiters and self._room(blocks):
            return
        loop = asyncio.get_running_loop()
        entry = (blocks, loop.create_future())
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(self.max_wait_s):
                while True:
                    await entry[1]
                    if self._room(blocks):
                        return
                    # Woken, but the room went to no one yet: wait at the head again.
                    entry = (blocks, loop.create_future())
                    self._waiters[0] = entry
        except TimeoutError:
            raise NoEngineError(
                f"no decode engine had room for {blocks} KV blocks within {self.max_wait_s:g} s"
            ) from None
        finally:
            # At the head, unless it gave up (timeout, client gone) behind others.
            self._waiters.remove(entry)
            # The next request may fit too: look once this one has taken its room.
            loop.call_soon(self.notify)

    def notify(self) -> None:
        """Room may have freed (a request ended, an engine came up or changed phase): wakes the
        first request held if it fits."""
        if self._waiters:
            blocks, fut = self._waiters[0]
            if not fut.done() and self._room(blocks):
                fut.set_result(None)
