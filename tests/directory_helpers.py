"""Shared helpers for the KV directory tests: reading a `PrefixMatch`, snapshotting state."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np

from evolving_infra import KvDirectory, PrefixMatch

Tier = Literal["L1", "L2"]
TIERS: tuple[Tier, Tier] = ("L1", "L2")
STATS_KEYS = frozenset(
    {
        "blocks",
        "placeholders",
        "locations",
        "locations_l1",
        "locations_l2",
        "nodes",
        "branches",
        "candidates",
        "memory_bytes",
    }
)

MatchTuple = tuple[dict[int, tuple[int, int]], int, int]


def read_match(m: PrefixMatch) -> MatchTuple:
    """(nodes, pool, cluster) of a match, after checking the numpy view and `node(n)` agree
    with `nodes`."""
    nodes = m.nodes
    node_ids, l1, l12 = m.node_ids, m.l1, m.l12
    for array in (node_ids, l1, l12):
        assert isinstance(array, np.ndarray)
        assert array.dtype == np.int64
        assert array.shape == (len(nodes),)
    ids = [int(x) for x in node_ids]
    assert ids == sorted(nodes), "node_ids must be the nodes of `nodes`, ascending"
    assert [(int(a), int(b)) for a, b in zip(l1, l12, strict=True)] == [nodes[n] for n in ids]
    assert len(m) == len(nodes)
    # One node's figures without the map: every node that holds some, and some that hold none.
    probe = {*ids, 0, 1, 2}
    if ids and ids[-1] + 1 < 2**31 - 1:  # the largest node id is 2^31 - 2
        probe.add(ids[-1] + 1)
    for n in probe:
        assert m.node(n) == nodes.get(n, (0, 0))
    for a, b in nodes.values():
        assert 0 <= a <= b
        assert b > 0
    return dict(nodes), m.pool, m.cluster


def semantic_stats(d: KvDirectory) -> dict[str, int]:
    """The documented `stats()` figures except `memory_bytes` (allocation, not state)."""
    stats = d.stats()
    return {k: v for k, v in stats.items() if k in STATS_KEYS and k != "memory_bytes"}


def snapshot(
    d: KvDirectory,
    chains: Iterable[Sequence[int]] = (),
    hashes: Iterable[int] = (),
    nodes: Iterable[int] = (),
) -> dict[str, Any]:
    """Everything observable about `d` for the given probes (to check a call changed nothing)."""
    chains = [list(c) for c in chains]
    hashes = sorted(set(hashes) | {h for c in chains for h in c})
    return {
        "stats": semantic_stats(d),
        "len": len(d),
        "match": [read_match(d.match(c)) for c in chains],
        "known": [h in d for h in hashes],
        "refcount": [d.refcount(h) for h in hashes],
        "order": [d.eviction_order(n, t) for n in sorted(set(nodes)) for t in TIERS],
    }


# ------------------------------------------------------------------------------------------------
# factories shared by the test_directory*.py files


def scene() -> KvDirectory:
    """Three nodes, both tiers, two branches (one referring to a placeholder, 6).

    node 0: L1 [1, 2, 3] @1, L2 [1, 2, 3, 4] @2; node 1: L1 [1, 5] @3; node 2: L2 [-9, -8] @4;
    branch "a" = [1, 2, 6]; branch 7 = [1, 5].
    """
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3], now=1.0)
    d.store(0, "L2", [1, 2, 3, 4], now=2.0)
    d.store(1, "L1", [1, 5], now=3.0)
    d.store(2, "L2", [-9, -8], now=4.0)
    assert d.branch_set("a", [1, 2, 6]) is True
    assert d.branch_set(7, [1, 5]) is True
    return d


PROBE_CHAINS: list[list[int]] = [
    [1, 2, 3, 4],
    [1, 2, 3, 4, 7],
    [1, 5],
    [1, 2, 6],
    [-9, -8],
    [2, 3],
    [9, 10],
]
PROBE_HASHES = list(range(-10, 11))
PROBE_NODES = [0, 1, 2, 3]


def scene_snapshot(d: KvDirectory) -> dict[str, Any]:
    return snapshot(d, PROBE_CHAINS, PROBE_HASHES, PROBE_NODES)


def m(d: KvDirectory, hashes: Sequence[int]) -> tuple[dict[int, tuple[int, int]], int, int]:
    return read_match(d.match(hashes))
