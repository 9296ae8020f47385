"""The simulated engine's prefix cache: its own `KvDirectory`, its KV events, eviction hints.

Each engine keeps a local `KvDirectory` in which it is the only node: the radix tree of its
own L1 (GPU) and L2 (host) blocks, driven by the simulator's `NodeKv` (capacities, pinning,
eviction in the directory's order, demotion to L2). `CacheEvents` listens to that `NodeKv` and
forwards every change to a `KvEventSink` (the SGLang-format ZMQ publisher), with the page's
token ids when the engine knows them, and keeps the set of held blocks per tier.

Eviction hints (`SetEvictionHints`) become branches of the local directory: a hinted block with
priority > 0 gets a branch whose context is the chain from the first page to it, so it and its
ancestors have `R_b > 0` and sort after every unhinted block in the eviction order
`(R_b > 0, T_b, ...)`. The order has two classes only, so priorities > 0 all mean "keep";
priority 0 drops the hint. Running requests register their prompt as a branch too (as the
simulator's `evolving` policy does): the pins of `NodeKv` rely on a running request's blocks
sorting after unpinned blocks of the same class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from evolving_infra._core import KvDirectory
from evolving_infra.nodemodel.kv import BlockParents, KvTier

Medium = Literal["GPU", "CPU"]  # SGLang's StorageMedium names: GPU = L1, CPU (pinned host) = L2
MEDIUM: dict[KvTier, Medium] = {"L1": "GPU", "L2": "CPU"}
HINT_PREFIX = "hint:"


class KvEventSink(Protocol):
    """Where the engine's KV events go, in the order they happen (called on the loop thread;
    must not block). The ZMQ publisher maps them to SGLang's `BlockStored`, `BlockRemoved`
    and `AllBlocksCleared` (medium "CPU" goes on the wire as "CPU_PINNED")."""

    def block_stored(
        self,
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
        medium: Medium,
    ) -> None:
        """`hashes` (a chain under `parent`) are now held in `medium`. `token_ids` are the
        pages' tokens, `page_size` per block, concatenated; empty when not all are known."""

    def block_removed(self, hashes: Sequence[int], medium: Medium) -> None: ...
    def all_blocks_cleared(self) -> None: ...


class CacheEvents:
    """Implements `nodemodel.kv.KvListener` for one engine: held sets, token ids, the sink."""

    def __init__(self, page_size: int, sink: KvEventSink | None = None) -> None:
        self.page_size = page_size
        self.sink = sink
        self.held: dict[KvTier, set[int]] = {"L1": set(), "L2": set()}
        self.tokens: dict[int, tuple[int, ...]] = {}  # block -> its page's token ids
        self.stores = self.removes = 0  # counters, for /server_info

    def learn(self, hashes: Sequence[int], token_ids: Sequence[int]) -> None:
        """Remembers the pages of `token_ids` (whose page hashes are `hashes`)."""
        ps = self.page_size
        for i, h in enumerate(hashes):
            if h not in self.tokens:
                self.tokens[h] = tuple(token_ids[i * ps : (i + 1) * ps])

    def forget(self, hashes: Sequence[int]) -> None:
        """Drops the token ids of blocks no tier holds (a request ended)."""
        l1, l2 = self.held["L1"], self.held["L2"]
        for h in hashes:
            if h not in l1 and h not in l2:
                self.tokens.pop(h, None)

    def holds(self, h: int) -> bool:
        return h in self.held["L1"] or h in self.held["L2"]

    # -- `nodemodel.kv.KvListener` -------------------------------------------------------------

    def stored(self, tier: KvTier, hashes: list[int], parent: int | None) -> None:
        self.held[tier].update(hashes)
        self.stores += 1
        if self.sink is not None:
            ids: list[int] = []
            for h in hashes:
                page = self.tokens.get(h)
                if page is None:
                    ids = []
                    break
                ids.extend(page)
            self.sink.block_stored(hashes, parent, ids, MEDIUM[tier])

    def removed(self, tier: KvTier, hashes: list[int]) -> None:
        self.held[tier].difference_update(hashes)
        self.removes += 1
        # Token ids are not dropped here (an L1 eviction's demotion to L2 follows and needs
        # them): unheld pages are swept once they outnumber the held ones.
        if len(self.tokens) > 2 * (len(self.held["L1"]) + len(self.held["L2"])) + 4096:
            self.tokens = {h: t for h, t in self.tokens.items() if self.holds(h)}
        if self.sink is not None:
            self.sink.block_removed(hashes, MEDIUM[tier])

    def cleared(self) -> None:
        self.held["L1"].clear()
        self.held["L2"].clear()
        self.tokens.clear()
        if self.sink is not None:
            self.sink.all_blocks_cleared()


class Hints:
    """Eviction hints as branches of the local directory (see the module docstring)."""

    def __init__(self, directory: KvDirectory, parents: BlockParents, events: CacheEvents) -> None:
        self.directory = directory
        self.parents = parents
        self.events = events
        self.hinted: set[int] = set()

    def chain(self, h: int) -> list[int] | None:
        """The chain from the first page to `h`, if the engine ever stored `h`."""
        ref = self.parents.pos.get(h)
        if ref is None:
            return None
        arr, j = ref
        return [int(x) for x in arr[: j + 1]]

    def apply(self, hints: Sequence[tuple[int, int]], replace: bool) -> tuple[int, int]:
        """Records (hash, priority) hints; returns (applied, ignored): hints for blocks this
        node holds, and for blocks it does not (those are not recorded)."""
        d = self.directory
        keep: set[int] = set()
        applied = ignored = 0
        for h, priority in hints:
            if priority > 0 and h in self.hinted and self.events.holds(h):
                # A block hash fixes its whole prefix: a block hinted already needs no update
                # (the router repeats its hints every few seconds).
                applied += 1
                keep.add(h)
                continue
            chain = self.chain(h) if self.events.holds(h) else None
            if chain is None:
                ignored += 1
                continue
            applied += 1
            if priority > 0:
                d.branch_set(HINT_PREFIX + str(h), chain)
                self.hinted.add(h)
                keep.add(h)
            elif h in self.hinted:
                d.branch_end(HINT_PREFIX + str(h))
                self.hinted.discard(h)
        if replace:
            for h in self.hinted - keep:
                d.branch_end(HINT_PREFIX + str(h))
            self.hinted &= keep
        return applied, ignored
