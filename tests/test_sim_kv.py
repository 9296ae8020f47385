"""A node's KV accounting against the directory: reserve, pin, evict, demote to L2, drop."""

from __future__ import annotations

import random

import pytest

from evolving_infra import KvDirectory
from evolving_infra.sim.kv import BlockParents, NodeKv


def chain(rng: random.Random, n: int, prefix: list[int] | None = None) -> list[int]:
    return [*(prefix or []), *(rng.getrandbits(62) for _ in range(n))]


def make(l1: int, l2: int) -> tuple[KvDirectory, BlockParents, NodeKv]:
    d, parents = KvDirectory(), BlockParents()
    return d, parents, NodeKv(0, d, parents, l1, l2)


def l1_of(d: KvDirectory, hashes: list[int], node: int = 0) -> int:
    return d.match(hashes).nodes.get(node, (0, 0))[0]


def test_store_counts_only_new_blocks() -> None:
    rng = random.Random(0)
    d, parents, kv = make(100, 0)
    a = chain(rng, 10)
    parents.register(a)
    assert kv.store(a[:6], None, 1.0) == 6
    assert kv.store(a, None, 2.0) == 4  # the first six are held already
    assert kv.l1_held == 10 == d.stats()["locations_l1"]


def test_eviction_spares_pinned_chains_and_demotes_to_l2() -> None:
    rng = random.Random(1)
    d, parents, kv = make(12, 100)
    a, b = chain(rng, 6), chain(rng, 6)
    for c in (a, b):
        parents.register(c)
    kv.store(a, None, 1.0)
    kv.store(b, None, 2.0)  # b is more recent: plain LRU would evict a first
    kv.pin(a)
    kv.pinned += len(a)
    assert kv.room(6)
    assert not kv.room(7)  # only b's six blocks are evictable
    assert not kv.reserve(7, 3.0)
    assert kv.l1_held == 12  # a failed reservation changes nothing
    assert kv.reserve(4, 3.0)
    assert l1_of(d, a) == 6  # the pinned chain is whole
    assert l1_of(d, b) == 2  # b lost its four deepest blocks...
    m = d.match(b).nodes[0]
    assert m == (2, 6)  # ...to L2, where the whole chain is still found
    assert kv.l2_held == 4
    assert kv.used == 12
    kv.unpin(a, 4.0)
    kv.pinned -= len(a)
    kv.reserved -= 4
    assert kv.reserve(12, 5.0)  # now everything may go
    assert kv.l1_held == 0
    assert kv.l2_held == 12
    assert d.match(a).nodes[0] == (0, 6)


def test_l2_overflow_drops_blocks() -> None:
    rng = random.Random(2)
    d, parents, kv = make(8, 5)
    a = chain(rng, 8)
    parents.register(a)
    kv.store(a, None, 1.0)
    assert kv.reserve(8, 2.0)
    assert kv.l2_held == 5
    assert kv.dropped == 3
    assert d.stats()["locations_l2"] == 5
    assert d.match(a).pool == 5  # L2 keeps the shallowest blocks (the deepest leave first)


def test_fork_shares_a_prefix_and_runs_cut_at_true_breaks() -> None:
    rng = random.Random(3)
    parents = BlockParents()
    a = chain(rng, 30)
    parents.register(a[:10])
    parents.register(a[:20])  # later turns of one branch register longer chains
    parents.register(a)
    b = chain(rng, 10, prefix=a[:5])
    parents.register(b)
    # Reversed evictions: parents before children, two chains, one after the other.
    ev = [*a[12:30], *b[5:15]]
    assert parents.runs(ev) == [(0, 18, a[11]), (18, 28, b[4])]
    # Two stretches of one chain with a gap, a first page, and an unknown block.
    assert parents.runs([*a[3:8], *a[20:25]]) == [(0, 5, a[2]), (5, 10, a[19])]
    assert parents.runs([a[0], 12345, a[1], a[2]]) == [(0, 1, None), (2, 4, a[0])]


def test_interleaved_chains_are_regrouped() -> None:
    rng = random.Random(4)
    parents = BlockParents()
    chains = [chain(rng, 80) for _ in range(2)]
    for c in chains:
        parents.register(c)
    # Two chains evicted at the same time interleave by depth.
    ev = [h for pair in zip(*chains, strict=True) for h in pair]
    runs = parents.runs(ev)
    assert sum(hi - lo for lo, hi, _ in runs) == len(ev)
    for lo, hi, first in runs:
        c = next(c for c in chains if ev[lo] in c)
        i = c.index(ev[lo])
        assert first == (c[i - 1] if i else None)
        assert ev[lo:hi] == c[i : i + hi - lo]


def test_clear_needs_an_idle_node() -> None:
    rng = random.Random(5)
    d, parents, kv = make(10, 10)
    a = chain(rng, 4)
    parents.register(a)
    kv.store(a, None, 1.0)
    kv.reserved = 1
    with pytest.raises(AssertionError):
        kv.clear()
    kv.reserved = 0
    kv.clear()
    assert kv.l1_held == 0
    assert d.stats()["locations"] == 0
