"""A node's KV accounting against the directory: reserve, pin, evict, demote to L2, drop."""

from __future__ import annotations

import random

import pytest

from evolving_infra import KvDirectory
from evolving_infra.nodemodel.kv import NodeKv


def chain(rng: random.Random, n: int, prefix: list[int] | None = None) -> list[int]:
    return [*(prefix or []), *(rng.getrandbits(62) for _ in range(n))]


def make(l1: int, l2: int) -> tuple[KvDirectory, NodeKv]:
    d = KvDirectory()
    return d, NodeKv(0, d, l1, l2)


def l1_of(d: KvDirectory, hashes: list[int], node: int = 0) -> int:
    return d.match(hashes).nodes.get(node, (0, 0))[0]


def test_store_counts_only_new_blocks() -> None:
    rng = random.Random(0)
    d, kv = make(100, 0)
    a = chain(rng, 10)
    assert kv.store(a[:6], None, 1.0) == 6
    assert kv.store(a, None, 2.0) == 4  # the first six are held already
    assert kv.l1_held == 10 == d.stats()["locations_l1"]


def test_eviction_spares_pinned_chains_and_demotes_to_l2() -> None:
    rng = random.Random(1)
    d, kv = make(12, 100)
    a, b = chain(rng, 6), chain(rng, 6)
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


def test_an_unpin_leaves_other_running_requests_pinned() -> None:
    """Request 2's prompt is a prefix of request 1's (a shorter turn of the same context): when
    1 finishes, its unpin touches the shared blocks, and 2's leaf among them must stay pinned,
    or an eviction takes the prefix 2 is reading (under LRU it is the oldest leaf left)."""
    rng = random.Random(3)
    d, kv = make(20, 100)
    long = chain(rng, 10)
    short = long[:6]
    other = chain(rng, 4)
    kv.store(long, None, 1.0)
    kv.pin(short, key=2)  # request 2 reads the first six blocks
    kv.pin(long, key=1)  # request 1 the whole chain
    kv.pinned += len(short) + len(long)
    kv.store(other, None, 2.0)
    kv.unpin(long, 3.0, key=1)  # request 1 is done: its blocks were used at t = 3
    kv.pinned -= len(long)
    # Everything not pinned may go (6 free + 8 evictable): `other` and request 1's four own
    # blocks, not request 2's, though they were used at t = 3 and `other` at t = 2.
    assert not kv.room(15)
    assert kv.reserve(14, 4.0)
    assert l1_of(d, short) == 6
    assert l1_of(d, other) == 0
    assert l1_of(d, long) == 6
    # Once request 2 is done too, its prefix is as evictable as any block.
    kv.reserved -= 14
    kv.unpin(short, 5.0, key=2)
    kv.pinned -= len(short)
    assert kv.reserve(20, 6.0)
    assert kv.l1_held == 0


def test_the_same_prompt_twice_stays_pinned_until_both_are_done() -> None:
    rng = random.Random(4)
    d, kv = make(10, 100)
    a = chain(rng, 5)
    kv.store(a, None, 1.0)
    kv.pin(a, key=1)
    kv.pin(a, key=2)
    kv.pinned += 2 * len(a)
    kv.unpin(a, 2.0, key=1)
    kv.pinned -= len(a)
    kv.store(chain(rng, 5), None, 3.0)  # newer than a's touch at t = 2
    assert kv.reserve(5, 4.0)  # room for five more: the newer chain goes, not a
    assert l1_of(d, a) == 5


def test_l2_overflow_drops_blocks() -> None:
    rng = random.Random(2)
    d, kv = make(8, 5)
    a = chain(rng, 8)
    kv.store(a, None, 1.0)
    assert kv.reserve(8, 2.0)
    assert kv.l2_held == 5
    assert kv.dropped == 3
    assert d.stats()["locations_l2"] == 5
    assert d.match(a).pool == 5  # L2 keeps the shallowest blocks (the deepest leave first)


def test_clear_needs_an_idle_node() -> None:
    rng = random.Random(5)
    d, kv = make(10, 10)
    a = chain(rng, 4)
    kv.store(a, None, 1.0)
    kv.reserved = 1
    with pytest.raises(AssertionError):
        kv.clear()
    kv.reserved = 0
    kv.clear()
    assert kv.l1_held == 0
    assert d.stats()["locations"] == 0


class Heard:
    """A `KvListener` that records what it hears."""

    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []

    def stored(self, tier: str, hashes: list[int], parent: int | None) -> None:
        self.events.append(("stored", tier, list(hashes), parent))

    def removed(self, tier: str, hashes: list[int]) -> None:
        self.events.append(("removed", tier, list(hashes)))

    def cleared(self) -> None:
        self.events.append(("cleared",))


def test_demotion_is_heard_as_the_l1_removal_then_one_store_per_run() -> None:
    """Two branches share four blocks; evicting both tails (the older first, deepest first)
    is heard as one L1 removal in eviction order, then each tail stored in L2 as a chain under
    the shared block it hangs from, the way an engine reports HiCache's write-back."""
    rng = random.Random(6)
    d, heard = KvDirectory(), Heard()
    kv = NodeKv(0, d, 30, 100, listener=heard)
    a = chain(rng, 10)
    b = chain(rng, 6, prefix=a[:4])
    kv.store(a, None, 1.0)
    kv.store(b[4:], a[3], 2.0)
    heard.events.clear()
    assert kv.reserve(26, 3.0)  # 14 free: 12 blocks go
    assert heard.events == [
        ("removed", "L1", [*reversed(a[4:]), *reversed(b[4:])]),
        ("stored", "L2", b[4:], a[3]),
        ("stored", "L2", a[4:], a[3]),
    ]
    assert (kv.l1_held, kv.l2_held, kv.demoted) == (4, 12, 12)
    assert d.match(a).nodes[0] == (4, 10)
    assert d.match(b).nodes[0] == (4, 10)


@pytest.mark.parametrize("pooled", [False, True])
def test_a_pooled_l2_keeps_one_copy_of_a_block(pooled: bool) -> None:
    """The shared pool is a store of blocks (Mooncake's, one copy per key): a node demoting a
    block another node already holds in L2 keeps none; per-node L2s keep both."""
    rng = random.Random(5)
    d = KvDirectory()
    a, b = NodeKv(0, d, 10, 100, pooled=pooled), NodeKv(1, d, 10, 100, pooled=pooled)
    shared, mine, theirs = chain(rng, 4), chain(rng, 3), chain(rng, 3)
    a.store(shared + mine, None, 1.0)
    b.store(shared + theirs, None, 1.0)
    assert a.reserve(10, 2.0)  # everything node 0 holds goes to its L2
    assert a.l2_held == 7
    assert b.reserve(10, 3.0)  # node 1's copy of the shared prefix is already in the pool
    assert b.l1_held == 0
    assert b.l2_held == (3 if pooled else 7) == d.held(1, "L2")
    assert b.deduped == (4 if pooled else 0)
    # Node 1's own blocks hang under a prefix only the pool holds: the pool still has it all.
    m = d.match(shared + theirs)
    assert m.pool == 7
    assert m.nodes.get(1, (0, 0)) == ((0, 0) if pooled else (0, 7))
    assert d.held_elsewhere(1, "L2", shared + theirs + mine) == shared + mine
