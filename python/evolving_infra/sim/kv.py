"""A node's KV memory: what it caches (mirrored in the shared `KvDirectory`) and what runs.

L1 (GPU) holds the cache and the KV of running requests; the directory is the record of the
cache, and this class keeps the counts the directory cannot give per node:
- `l1_held`, `l2_held`: blocks the directory says the node holds per tier, tracked exactly from
  the directory's own `locations_l1/l2` counters around each store, and from what `evict`
  returns;
- `reserved`: blocks running requests take beyond what is in the directory (tokens still being
  prefilled or decoded, a partial last page, fetches in flight);
- `pinned`: cached blocks running requests read (their prefixes), which must not be evicted.
`used = l1_held + reserved` never exceeds `l1_capacity`; room is made by evicting up to
`l1_held - pinned` blocks.

Pinning without a pin API: the leaf of a running request's chain gets a far-future last-access
time (`PIN_TIME`; blocks stored for it while it runs get it too), and unpinning touches the
whole chain with the real time. Eviction takes leaves only and orders by `(R_b > 0, T_b, ...)`,
so a pinned leaf comes after every unpinned block of its kind (`R_b = 0` under LRU; under the
branch-aware order a running request's branch is live, so `R_b > 0`) and shields every block
above it. Evictions never exceed `l1_held - pinned`, and `pinned` counts a prefix shared by
running requests once per request (an over-estimate), so a pinned block is never chosen. (Two
running requests with the very same chain share one leaf: the first to finish unpins both.)

L1 evictions are demoted to L2 when the node has one (as SGLang's HiCache writes back), L2
evictions drop the block. A demoted run's parent comes from `BlockParents`.

An optional `KvListener` hears every change to what the node holds, in the order it happens
(the simulated engine turns them into SGLang KV events). The simulator passes none: each hook
is then one `is None` test.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from evolving_infra._core import KvDirectory
from evolving_infra.sim.config import PIN_TIME

IntArray = npt.NDArray[np.int64]
KvTier = Literal["L1", "L2"]


class KvListener(Protocol):
    """Hears what a `NodeKv` now holds, change by change.

    `stored`: the node now holds `hashes` (a chain, child of `parent`) in `tier`; some may have
    been held there already (storing is idempotent, as in the directory). `removed`: it no
    longer holds them there (an L1 eviction comes first, then its L2 demotion as `stored`).
    `cleared`: it holds nothing any more. Lists are the listener's to keep.
    """

    def stored(self, tier: KvTier, hashes: list[int], parent: int | None) -> None: ...
    def removed(self, tier: KvTier, hashes: list[int]) -> None: ...
    def cleared(self) -> None: ...


class BlockParents:
    """Where every block ever stored sits in a chain: demoting an evicted run to L2 needs the
    run's parent and where the run ends.

    Each block maps to (a chain holding it, its index there), the chain kept as an int64 array.
    A block's prefix is the same in every chain that holds it (its hash fixes the prefix), so
    any such chain will do. Evictions come back leaf first, so reversed they are stretches of
    registered chains: one dictionary look-up per stretch and a vectorised comparison find each
    stretch, where a look-up per block (hundreds of thousands per simulated minute, each a
    cache miss in a dictionary of millions) was the simulator's hottest spot.

    NOTE: a block maps to one int, `chain number << INDEX_BITS | index`, rather than to a tuple:
    inserting millions of tuples took three times as long and twice the memory. `pos` shows the
    same map as `(chain, index)` pairs, for readers.
    """

    INDEX_BITS = 24  # chains up to 16M blocks
    _MASK = (1 << INDEX_BITS) - 1

    def __init__(self) -> None:
        self._at: dict[int, int] = {}
        self._chains: list[IntArray] = []
        self.pos = ChainPositions(self)

    def __contains__(self, h: int) -> bool:
        return h in self._at

    def at(self, h: int) -> tuple[IntArray, int] | None:
        """(a chain holding `h`, its index there), or None for a block never registered."""
        ref = self._at.get(h)
        if ref is None:
            return None
        return self._chains[ref >> self.INDEX_BITS], ref & self._MASK

    def register(self, chain: Sequence[int]) -> None:
        """Records a chain from a first page (chains are prefix-closed: the known blocks are a
        prefix of it, so one binary search finds the new ones)."""
        at = self._at
        lo, hi = 0, len(chain)
        while lo < hi:
            mid = (lo + hi) // 2
            if chain[mid] in at:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(chain):
            assert len(chain) <= self._MASK, "a chain longer than INDEX_BITS can index"
            base = len(self._chains) << self.INDEX_BITS
            self._chains.append(np.array(chain, dtype=np.int64))
            at.update(zip(chain[lo:], range(base + lo, base + len(chain)), strict=True))

    def runs(self, blocks: list[int]) -> list[tuple[int, int, int | None]]:
        """`blocks` (each after its parent, if that is among them) cut into parent-child runs:
        (start, end, parent of the first), in order. Unregistered blocks are left out.

        Matched from the end: the last block of a run is the deepest, and any chain holding it
        holds its whole path from the first page, so one comparison against that chain finds
        the whole run, however many turns registered its blocks.
        """
        at, chains, bits, mask = self._at, self._chains, self.INDEX_BITS, self._MASK
        ev = np.array(blocks, dtype=np.int64)
        out: list[tuple[int, int, int | None]] = []
        hi = len(blocks)
        while hi > 0:
            ref = at.get(blocks[hi - 1])
            if ref is None:
                hi -= 1
                continue
            arr, j = chains[ref >> bits], ref & mask
            span = min(hi, j + 1)
            diff = ev[hi - span : hi] != arr[j + 1 - span : j + 1]
            # The run starts after the last mismatch (the block before it is not its parent).
            lo = hi - span + (span - int(diff[::-1].argmax()) if diff.any() else 0)
            first = j - (hi - lo) + 1  # index of the run's first block in `arr`
            out.append((lo, hi, int(arr[first - 1]) if first else None))
            hi = lo
        out.reverse()
        return out


class ChainPositions(Mapping[int, tuple[IntArray, int]]):
    """`BlockParents`' map as `block -> (a chain holding it, its index there)` (read-only)."""

    def __init__(self, parents: BlockParents) -> None:
        self._parents = parents

    def __getitem__(self, h: int) -> tuple[IntArray, int]:
        ref = self._parents.at(h)
        if ref is None:
            raise KeyError(h)
        return ref

    def __contains__(self, h: object) -> bool:
        return h in self._parents._at

    def __iter__(self) -> Iterator[int]:
        return iter(self._parents._at)

    def __len__(self) -> int:
        return len(self._parents._at)


class NodeKv:
    """One node's L1 and L2 as the simulator drives them (see the module docstring)."""

    __slots__ = (
        "demoted",
        "directory",
        "dropped",
        "evicted",
        "l1_capacity",
        "l1_held",
        "l2_capacity",
        "l2_held",
        "listener",
        "node",
        "parents",
        "pinned",
        "reserved",
    )

    def __init__(
        self,
        node: int,
        directory: KvDirectory,
        parents: BlockParents,
        l1_capacity: int,
        l2_capacity: int,
        listener: KvListener | None = None,
    ) -> None:
        self.node = node
        self.listener = listener
        self.directory = directory
        self.parents = parents
        self.l1_capacity = l1_capacity
        self.l2_capacity = l2_capacity
        self.l1_held = self.l2_held = self.reserved = self.pinned = 0
        self.evicted = self.demoted = self.dropped = 0  # counters, for reports

    @property
    def used(self) -> int:
        return self.l1_held + self.reserved

    def room(self, need: int) -> bool:
        """Whether `need` more blocks fit once the unpinned cache is evicted."""
        free = self.l1_capacity - self.l1_held - self.reserved
        return need <= free + max(self.l1_held - self.pinned, 0)

    def reserve(self, need: int, now: float) -> bool:
        """Takes `need` blocks for a running request, evicting as needed; False (nothing
        changed) if they cannot fit."""
        free = self.l1_capacity - self.l1_held - self.reserved
        if need > free:
            if need > free + max(self.l1_held - self.pinned, 0):
                return False
            self._evict(need - free, now)
            if need > self.l1_capacity - self.l1_held - self.reserved:
                return False  # unreachable while `pinned` over-estimates (see above)
        self.reserved += need
        return True

    def store(self, chain: Sequence[int], parent: int | None, now: float) -> int:
        """Stores `chain` (child of `parent`) in L1 with last access `now`; returns the blocks
        newly held (some may be held already). The caller converts its reservation."""
        if not chain:
            return 0
        d = self.directory
        before = d.stats()["locations_l1"]
        d.store(self.node, "L1", chain, parent, now)
        new = d.stats()["locations_l1"] - before
        self.l1_held += new
        if new and self.listener is not None:
            # L1 is prefix-closed (eviction takes leaves), so the blocks held already are a
            # prefix of `chain`: the new ones are its last `new`.
            k = len(chain) - new
            self.listener.stored("L1", list(chain[k:]), chain[k - 1] if k else parent)
        return new

    def pin(self, chain: Sequence[int]) -> None:
        """Pins `chain`, which this node holds in L1: only its leaf needs the far-future time
        (eviction takes leaves, so the leaf shields its ancestors), and re-storing one held
        block sets it in O(1) where a `touch` walks the whole chain."""
        if chain:
            parent = chain[-2] if len(chain) > 1 else None
            self.directory.store(self.node, "L1", chain[-1:], parent, PIN_TIME)

    def unpin(self, chain: Sequence[int], now: float) -> None:
        """The request is done with `chain`: every block it read was used `now` (LRU)."""
        if chain:
            self.directory.touch(self.node, chain, now)

    def fit(self, now: float) -> None:
        """Evicts until `used <= l1_capacity` (after a store landed on blocks it had not
        reserved, e.g. output blocks)."""
        over = self.l1_held + self.reserved - self.l1_capacity
        if over > 0:
            self._evict(min(over, max(self.l1_held - self.pinned, 0)), now)

    def clear(self) -> None:
        """Drops everything the node caches (a restart, or a switch that loses the KV)."""
        assert self.reserved == 0, "only an idle node is cleared"
        assert self.pinned == 0, "only an idle node is cleared"
        self.directory.clear(self.node)
        self.l1_held = self.l2_held = 0
        if self.listener is not None:
            self.listener.cleared()

    # -- eviction -----------------------------------------------------------------------------

    def _evict(self, n: int, now: float) -> None:
        if n <= 0:
            return
        evicted = self.directory.evict(self.node, "L1", n)
        self.l1_held -= len(evicted)
        self.evicted += len(evicted)
        if evicted and self.listener is not None:
            self.listener.removed("L1", list(evicted))
        if self.l2_capacity > 0 and evicted:
            self._demote(evicted, now)

    def _demote(self, evicted: list[int], now: float) -> None:
        # `evict` removes a child before its parent, so reversed, each block's parent comes
        # just before it or is still held in this node's L1 (L1 is prefix-closed): runs of
        # parent-child blocks are valid chains even though the directory may already have
        # dropped the evicted blocks nothing else refers to.
        evicted.reverse()
        d = self.directory
        before = d.stats()["locations_l2"]
        for lo, hi, first in self.parents.runs(evicted):
            # A run whose parent is gone from every tier could never be matched again
            # (matching walks from the first page): dropping it loses nothing.
            if first is None or first in d:
                d.store(self.node, "L2", evicted[lo:hi], first, now)
                if self.listener is not None:
                    self.listener.stored("L2", evicted[lo:hi], first)
        new = d.stats()["locations_l2"] - before
        self.l2_held += new
        self.demoted += new
        over = self.l2_held - self.l2_capacity
        if over > 0:
            dropped = d.evict(self.node, "L2", over)
            self.l2_held -= len(dropped)
            self.dropped += len(dropped)
            if dropped and self.listener is not None:
                self.listener.removed("L2", dropped)
