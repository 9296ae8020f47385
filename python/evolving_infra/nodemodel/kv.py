"""A node's KV memory: what it caches (mirrored in the shared `KvDirectory`) and what runs.

L1 (GPU) holds the cache and the KV of running requests; the directory is the record of the
cache, and this class keeps the counts the directory cannot give per node:
- `l1_held`, `l2_held`: blocks the directory says the node holds per tier, tracked exactly from
  the directory's count of them (`held`, O(1)) around each store, and from what `evict`
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
running requests once per request (an over-estimate), so a pinned block is never chosen.
An unpin touches the whole chain, which also gives the real time to the leaf of another running
request that lies on it (one whose prompt is a prefix of this one, or the same prompt): the node
remembers each running request's pinned leaf by its key (`pin`, `pinned_to`) and an `unpin`
pins those leaves again. (Without it, a Claude Code run under LRU with a shared pool evicted a
decoding request's prompt and crashed on an unknown parent, 2026-12-01.)

L1 evictions are demoted to L2 when the node has one (as SGLang's HiCache writes back), in one
directory call (`KvDirectory.demote`: the blocks never leave the directory, so no record of
their parents is needed), L2 evictions drop the block. With `pooled` (`SimConfig.
pool_one_copy`) the nodes' L2s are one key-value store keeping one copy per block: a demoted
block some other node already holds in L2 leaves this node's L2 at once (`deduped`), so a
prompt cached on its prefill node and on its decode node takes the pool's room once, not
twice, and is read from the pool rather than from local host memory.
`BlockParents` is the simulated engine's record of chains (its eviction hints read it);
`NodeKv` only keeps it for the engine's node to extend (`parents`, None in the simulator).

An optional `KvListener` hears every change to what the node holds, in the order it happens
(the simulated engine turns them into SGLang KV events). The simulator passes none: each hook
is then one `is None` test.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from evolving_infra._core import KvDirectory
from evolving_infra.workloads.blocks import known_prefix

IntArray = npt.NDArray[np.int64]
KvTier = Literal["L1", "L2"]
# Far-future last-access time: how a running request pins its blocks (the module docstring).
PIN_TIME = 1e15


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
    """Where every block a simulated engine stored sits in a chain: the router's eviction hints
    name blocks by hash, and the engine turns each into a branch of its local directory, which
    needs the chain from the first page (`engines/sim/cache.Hints`). (The simulator needs no
    such record: `KvDirectory.demote` keeps evicted blocks known while it moves them to L2.)

    A chain is registered as it grows (a prompt, then its response, then the next prompt...),
    and each registration keeps only the blocks not seen before, in a *segment*: a list of
    blocks, the first one's parent being the segment's `up` (None: a first page). New blocks
    that continue a segment's last block extend it (a branch's turns make one segment until a
    fork or a compaction), others start a segment. Each block maps to (its segment, its index
    there). A block's prefix is the same in every chain that holds it (its hash fixes the
    prefix), so the segments form a tree and a block's path from the first page is its
    segment's prefix after its ancestors' paths.

    NOTE: segments rather than every registered chain whole: a request registers its prompt and
    then prompt + response, so keeping whole chains held the prompts twice over (8 bytes a block
    per registration) and converted each to an array. A block maps to one int, `segment number
    << INDEX_BITS | index`, rather than to a tuple: inserting millions of tuples took three
    times as long and twice the memory. `pos` shows a block's path as `(chain, index)` pairs.
    """

    INDEX_BITS = 24  # segments up to 16M blocks
    _MASK = (1 << INDEX_BITS) - 1

    def __init__(self) -> None:
        self._at: dict[int, int] = {}
        self._segments: list[list[int]] = []
        self._up: list[int | None] = []  # the parent of each segment's first block
        self.pos = ChainPositions(self)

    def __contains__(self, h: int) -> bool:
        return h in self._at

    def at(self, h: int) -> tuple[IntArray, int] | None:
        """(the path from the first page to `h`, `h`'s index there), or None for a block never
        registered."""
        ref = self._at.get(h)
        if ref is None:
            return None
        parts: list[list[int]] = []
        while ref is not None:
            s, j = ref >> self.INDEX_BITS, ref & self._MASK
            parts.append(self._segments[s][: j + 1])
            up = self._up[s]
            ref = None if up is None else self._at[up]
        path = np.array([x for part in reversed(parts) for x in part], dtype=np.int64)
        return path, len(path) - 1

    def __len__(self) -> int:
        return len(self._at)

    def prune(self, keep: Iterable[int]) -> int:
        """Forgets every block that is neither in `keep` nor an ancestor of one of them (so the
        known blocks of any chain stay a prefix of it, as `register` needs); returns how many
        were forgotten. Linear in the blocks known.

        A simulated engine serves without end and prunes what no tier holds and no live request
        needs, or the map grows by every page it ever saw (~100 bytes each; ~2,000 pages a
        second per engine under the soak)."""
        at, segments, ups = self._at, self._segments, self._up
        bits, mask = self.INDEX_BITS, self._MASK
        kept = [0] * len(segments)  # per segment, the length of its prefix that stays
        for h in keep:
            ref = at.get(h)
            if ref is not None:
                s, j = ref >> bits, ref & mask
                kept[s] = max(kept[s], j + 1)
        # A segment is created after the one holding its parent block (`register` finds the
        # parent in `_at` first), so walking back, a kept segment keeps its parent's path.
        for s in range(len(segments) - 1, -1, -1):
            up = ups[s]
            if kept[s] and up is not None:
                ref = at[up]
                p, j = ref >> bits, ref & mask
                kept[p] = max(kept[p], j + 1)
        new_at: dict[int, int] = {}
        new_segments: list[list[int]] = []
        new_ups: list[int | None] = []
        for s, n in enumerate(kept):
            if n:
                base = len(new_segments) << bits
                segment = segments[s] if n == len(segments[s]) else segments[s][:n]
                new_segments.append(segment)
                new_ups.append(ups[s])
                new_at.update(zip(segment, range(base, base + n), strict=True))
        forgotten = len(at) - len(new_at)
        self._at, self._segments, self._up = new_at, new_segments, new_ups
        return forgotten

    def register(self, chain: Sequence[int]) -> None:
        """Records a chain from a first page (chains are prefix-closed: the known blocks are a
        prefix of it, so one binary search finds the new ones)."""
        at = self._at
        lo = known_prefix(chain, at)
        if lo == len(chain):
            return
        new = chain[lo:]
        up = chain[lo - 1] if lo else None
        ref = at[up] if up is not None else -1
        segments = self._segments
        if ref >= 0 and (ref & self._MASK) == len(segments[ref >> self.INDEX_BITS]) - 1:
            # The chain goes on from a segment's last block (a branch's next turn): extend it,
            # so that a branch's path is one long segment rather than one per turn.
            s = ref >> self.INDEX_BITS
            start = len(segments[s])
            segments[s].extend(new)
        else:
            s, start = len(segments), 0
            segments.append(list(new))
            self._up.append(up)
        assert start + len(new) <= self._MASK, "a segment longer than INDEX_BITS can index"
        base = (s << self.INDEX_BITS) + start
        at.update(zip(new, range(base, base + len(new)), strict=True))


class ChainPositions(Mapping[int, tuple[IntArray, int]]):
    """`BlockParents`' map as `block -> (its path from the first page, its index there)`
    (read-only)."""

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
        "_pins",
        "deduped",
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
        "pooled",
        "reserved",
    )

    def __init__(
        self,
        node: int,
        directory: KvDirectory,
        l1_capacity: int,
        l2_capacity: int,
        listener: KvListener | None = None,
        parents: BlockParents | None = None,
        pooled: bool = False,
    ) -> None:
        self.node = node
        self.pooled = pooled
        self.listener = listener
        self.directory = directory
        self.parents = parents
        self.l1_capacity = l1_capacity
        self.l2_capacity = l2_capacity
        self.l1_held = self.l2_held = self.reserved = self.pinned = 0
        # Each running request's pinned leaf, by the request's key: (leaf, its depth in the
        # request's chain). An unpin re-pins the others' leaves that lie on its chain.
        self._pins: dict[int, tuple[int, int]] = {}
        self.evicted = self.demoted = self.dropped = self.deduped = 0  # counters, for reports

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
        d, node = self.directory, self.node
        # NOTE: `held` is O(1); two `stats()` per store (which walks every place and branch)
        # were a quarter of the directory's time at 3,072 GPUs.
        before = d.held(node, "L1")
        d.store(node, "L1", chain, parent, now)
        new = d.held(node, "L1") - before
        self.l1_held += new
        if new and self.listener is not None:
            # L1 is prefix-closed (eviction takes leaves), so the blocks held already are a
            # prefix of `chain`: the new ones are its last `new`.
            k = len(chain) - new
            self.listener.stored("L1", list(chain[k:]), chain[k - 1] if k else parent)
        return new

    def pin(self, chain: Sequence[int], key: int | None = None) -> None:
        """Pins `chain`, which this node holds in L1: only its leaf needs the far-future time
        (eviction takes leaves, so the leaf shields its ancestors), and re-storing one held
        block sets it in O(1) where a `touch` walks the whole chain. `key` names the request
        (its id): its leaf is remembered, so that another request's unpin leaves it pinned."""
        if chain:
            parent = chain[-2] if len(chain) > 1 else None
            self.directory.store(self.node, "L1", chain[-1:], parent, PIN_TIME)
            if key is not None:
                self._pins[key] = (chain[-1], len(chain) - 1)

    def pinned_to(self, key: int, chain: Sequence[int], end: int) -> None:
        """Request `key` now pins `chain[:end]`, whose blocks the caller stored at `PIN_TIME`
        (its prefetch, prefill or KV arrival extended what it pins)."""
        if end > 0:
            self._pins[key] = (chain[end - 1], end - 1)

    def unpin(self, chain: Sequence[int], now: float, key: int | None = None) -> None:
        """The request is done with `chain`: every block it read was used `now` (LRU).

        The touch also gives the real time to the leaf of any other running request that lies
        on `chain` (a request whose prompt is a prefix of this one, or the same): those leaves
        are pinned again, else an eviction could take a prefix a running request reads."""
        if key is not None:
            self._pins.pop(key, None)
        if not chain:
            return
        self.directory.touch(self.node, chain, now)
        n = len(chain)
        for leaf, depth in self._pins.values():
            if depth < n and chain[depth] == leaf:
                parent = chain[depth - 1] if depth else None
                self.directory.store(self.node, "L1", [leaf], parent, PIN_TIME)

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
        self._pins.clear()
        if self.listener is not None:
            self.listener.cleared()

    # -- eviction -----------------------------------------------------------------------------

    def _evict(self, n: int, now: float) -> None:
        if n <= 0:
            return
        d, node = self.directory, self.node
        if self.l2_capacity <= 0:
            evicted = d.evict(node, "L1", n)
            self._evicted(evicted)
            return
        before = d.held(node, "L2")
        evicted, parents = d.demote(node, n, now)
        self._evicted(evicted)
        if evicted and self.listener is not None:
            self._report_runs(evicted, parents)
        if self.pooled and evicted:
            # Children first, as `remove` walks best: a block and then its parent.
            copies = d.held_elsewhere(node, "L2", evicted)
            if copies:
                d.remove(node, "L2", copies)
                self.deduped += len(copies)
                if self.listener is not None:
                    self.listener.removed("L2", copies)
        new = d.held(node, "L2") - before
        self.l2_held += new
        self.demoted += new
        self._drop_l2_over()

    def _evicted(self, evicted: list[int]) -> None:
        self.l1_held -= len(evicted)
        self.evicted += len(evicted)
        if evicted and self.listener is not None:
            self.listener.removed("L1", list(evicted))

    def _report_runs(self, evicted: list[int], parents: list[int | None]) -> None:
        """The demoted blocks as the listener hears stores: reversed (parents first), one chain
        per run of parent-child blocks, each under its first block's parent."""
        assert self.listener is not None
        run: list[int] = []
        first: int | None = None
        for h, p in zip(reversed(evicted), reversed(parents), strict=True):
            if run and p == run[-1]:
                run.append(h)
                continue
            if run:
                self.listener.stored("L2", run, first)
            run, first = [h], p
        if run:
            self.listener.stored("L2", run, first)

    def _drop_l2_over(self) -> None:
        d = self.directory
        over = self.l2_held - self.l2_capacity
        if over > 0:
            dropped = d.evict(self.node, "L2", over)
            self.l2_held -= len(dropped)
            self.dropped += len(dropped)
            if dropped and self.listener is not None:
                self.listener.removed("L2", dropped)
