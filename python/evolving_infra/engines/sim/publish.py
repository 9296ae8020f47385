"""The simulated engine's KV events on the wire: `KvEventSink` → SGLang's ZMQ publisher.

SGLang publishes the events of one scheduler iteration as one `KVEventBatch`; here the events
raised during one turn of the event loop (one engine iteration's bookkeeping runs in one
callback) are gathered and published as one batch at the end of the turn. Media go on the wire
with SGLang's names (`GPU`, `CPU_PINNED`), pages with their token ids when the engine knows
them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from evolving_infra.engines.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventPublisher,
    Medium,
)
from evolving_infra.engines.sim.cache import Medium as CacheMedium

WIRE_MEDIUM: dict[CacheMedium, Medium] = {"GPU": Medium.GPU, "CPU": Medium.CPU}


class ZmqKvSink:
    """Implements `cache.KvEventSink` on a `KvEventPublisher` (see the module docstring)."""

    def __init__(
        self,
        publisher: KvEventPublisher,
        page_size: int,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.publisher = publisher
        self.page_size = page_size
        self.loop = loop or asyncio.get_running_loop()
        self._pending: list[KvEvent] = []

    def _add(self, event: KvEvent) -> None:
        if not self._pending:
            self.loop.call_soon(self.flush)
        self._pending.append(event)

    def flush(self) -> None:
        """Publishes the events gathered so far as one batch."""
        if self._pending:
            events, self._pending = self._pending, []
            self.publisher.publish(events)

    def block_stored(
        self,
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        medium: CacheMedium,
    ) -> None:
        self._add(
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=parent,
                token_ids=list(token_ids),
                block_size=self.page_size,
                medium=WIRE_MEDIUM[medium],
            )
        )

    def block_removed(self, hashes: Sequence[int], medium: CacheMedium) -> None:
        self._add(BlockRemoved(block_hashes=list(hashes), medium=WIRE_MEDIUM[medium]))

    def all_blocks_cleared(self) -> None:
        self._add(AllBlocksCleared())
