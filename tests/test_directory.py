"""Exact-expectation tests of `KvDirectory` against DESIGN §2 and docs/kv-directory.md:
match, touch, eviction order, garbage and clear.

Small factories, exact block ids, exact eviction orders (vLLM's test_prefix_caching.py style).
Block hashes here are small ints: the directory never looks inside a hash, only at its chain.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from directory_helpers import (
    STATS_KEYS,
    m,
    read_match,
    scene,
    scene_snapshot,
    semantic_stats,
)
from evolving_infra import (
    KvDirectory,
    KvDirectoryError,
    PrefixMatch,
)

MIN = -(2**63)
MAX = 2**63 - 1


# ------------------------------------------------------------------------------------------------
# the scene itself (also pins down stats)


def test_scene_state() -> None:
    d = scene()
    assert m(d, [1, 2, 3, 4]) == ({0: (3, 4), 1: (1, 1)}, 4, 4)
    assert m(d, [1, 2, 3, 4, 7]) == ({0: (3, 4), 1: (1, 1)}, 4, 4)
    assert m(d, [1, 5]) == ({0: (1, 1), 1: (2, 2)}, 1, 2)
    assert m(d, [1, 2, 6]) == ({0: (2, 2), 1: (1, 1)}, 2, 2)
    assert m(d, [-9, -8]) == ({2: (0, 2)}, 2, 2)
    assert [d.refcount(h) for h in (1, 2, 3, 4, 5, 6, -9, 99)] == [2, 1, 0, 0, 1, 1, 0, 0]
    assert d.eviction_order(0, "L1") == [3]
    assert d.eviction_order(0, "L2") == [4]
    assert d.eviction_order(1, "L1") == [5]
    assert d.eviction_order(1, "L2") == []
    assert d.eviction_order(2, "L2") == [-8]
    assert len(d) == 8
    assert semantic_stats(d) == {
        "blocks": 8,
        "placeholders": 1,
        "locations": 11,
        "locations_l1": 5,
        "locations_l2": 6,
        "nodes": 3,
        "branches": 2,
        "candidates": 4,
    }


def test_stats_keys_and_types() -> None:
    empty = KvDirectory().stats()
    assert set(empty) >= STATS_KEYS
    assert all(type(v) is int for v in empty.values())
    assert {
        k: v for k, v in empty.items() if k in STATS_KEYS and k != "memory_bytes"
    } == dict.fromkeys(STATS_KEYS - {"memory_bytes"}, 0)
    assert empty["memory_bytes"] >= 0
    d = KvDirectory()
    d.store(0, "L1", list(range(1, 20_001)), now=0.0)
    stats = d.stats()
    assert stats["blocks"] == 20_000
    assert stats["memory_bytes"] > empty["memory_bytes"]
    assert all(type(v) is int for v in stats.values())


def test_held_counts_each_nodes_blocks_per_tier() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3], now=0.0)
    d.store(0, "L2", [1, 2], now=0.0)
    d.store(4, "L2", [1, 2, 3, 7], now=0.0)
    assert (d.held(0, "L1"), d.held(0, "L2"), d.held(0)) == (3, 2, 5)
    assert (d.held(4), d.held(9)) == (4, 0)
    d.remove(0, "L1", [3])
    assert d.held(0, "L1") == 2
    assert d.evict(4, "L2", 2) == [7, 3]
    assert d.held(4) == 2
    d.clear(0)
    assert d.held(0) == 0
    assert sum(d.held(n) for n in (0, 4)) == d.stats()["locations"]
    with pytest.raises(KvDirectoryError):
        d.held(0, "L3")  # type: ignore[arg-type]


def test_len_and_contains() -> None:
    d = scene()
    assert len(d) == 8
    assert [h in d for h in (1, 2, 3, 4, 5, 6, -9, -8)] == [True] * 8
    assert [h in d for h in (0, 7, 99, MIN, MAX)] == [False] * 5


# ------------------------------------------------------------------------------------------------
# match


def test_match_empty_directory_and_empty_query() -> None:
    d = KvDirectory()
    assert m(d, [1, 2]) == ({}, 0, 0)
    d.store(0, "L1", [1, 2], now=0.0)
    assert m(d, []) == ({}, 0, 0)
    empty = d.match([])
    assert isinstance(empty, PrefixMatch)
    assert len(empty) == 0


def test_match_counts_leading_blocks_only() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3], now=0.0)
    assert m(d, [1, 2, 3]) == ({0: (3, 3)}, 0, 3)
    assert m(d, [1, 2]) == ({0: (2, 2)}, 0, 2)
    assert m(d, [1, 2, 3, 4, 5]) == ({0: (3, 3)}, 0, 3)
    assert m(d, [1, 4, 3]) == ({0: (1, 1)}, 0, 1), "stops at the unknown block 4"
    assert m(d, [4, 1, 2]) == ({}, 0, 0)


def test_match_stops_at_parent_mismatch() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3], now=0.0)
    d.store(0, "L1", [9], now=0.0)
    # 3 is known and held, but its parent is 2, not 1
    assert m(d, [1, 3]) == ({0: (1, 1)}, 0, 1)
    # 9 is a first page: its recorded parent (none) is not 2
    assert m(d, [1, 2, 9]) == ({0: (2, 2)}, 0, 2)
    # a repeated block: 1's parent is not 3
    assert m(d, [1, 2, 3, 1]) == ({0: (3, 3)}, 0, 3)
    assert m(d, [1, 1]) == ({0: (1, 1)}, 0, 1)


def test_match_first_block_with_a_parent_counts_nothing() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3], now=0.0)
    d.store(1, "L2", [2, 3], parent=1, now=0.0)
    assert m(d, [2, 3]) == ({}, 0, 0)
    assert m(d, [3]) == ({}, 0, 0)


def test_match_l1_and_l12_per_node() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2], now=0.0)
    d.store(0, "L2", [1, 2, 3, 4], now=0.0)
    d.store(1, "L2", [1], now=0.0)
    d.store(2, "L1", [1, 2, 3], now=0.0)
    # node 3: L1 {1, 3}, L2 {1, 2}: l1 stops at the gap, l12 sees 1, 2 (L2) and 3 (L1)
    d.store(3, "L1", [1, 2, 3], now=0.0)
    d.store(3, "L2", [1, 2], now=0.0)
    d.remove(3, "L1", [2])
    assert m(d, [1, 2, 3, 4, 5]) == (
        {0: (2, 4), 1: (0, 1), 2: (3, 3), 3: (1, 3)},
        4,
        4,
    )


def test_match_pool_and_cluster() -> None:
    d = KvDirectory()
    d.store(5, "L1", [1], now=0.0)
    d.store(6, "L1", [1, 2], parent=None, now=0.0)
    d.remove(6, "L1", [1])
    d.store(7, "L2", [1, 2, 3], now=0.0)
    d.remove(7, "L2", [2])
    d.store(8, "L1", [1, 2, 3, 4], now=0.0)
    d.remove(8, "L1", [1, 2, 3])
    # 1: n5 L1, n7 L2; 2: n6 L1; 3: n7 L2; 4: n8 L1
    # pool: leading blocks in some L2: 1 yes, 2 no -> 1
    # cluster: every block is held somewhere -> 4, although no single node holds more than 1
    assert m(d, [1, 2, 3, 4]) == ({5: (1, 1), 7: (0, 1)}, 1, 4)
    d.store(9, "L2", [1, 2], now=0.0)
    assert m(d, [1, 2, 3, 4]) == ({5: (1, 1), 7: (0, 1), 9: (0, 2)}, 3, 4)


def test_match_numpy_view_aligned_ascending_int64() -> None:
    d = KvDirectory()
    top = 1000
    d.store(top, "L1", [1, 2, 3], now=0.0)
    d.store(7, "L2", [1], now=0.0)
    d.store(2, "L1", [1, 2], now=0.0)
    d.store(2, "L2", [1, 2, 3, 4], now=0.0)
    d.store(4, "L1", [9], now=0.0)  # holds nothing of the query
    res = d.match([1, 2, 3, 4])
    assert res.nodes == {2: (2, 4), 7: (0, 1), top: (3, 3)}
    assert res.node_ids.dtype == np.int64
    assert res.l1.dtype == np.int64
    assert res.l12.dtype == np.int64
    assert res.node_ids.tolist() == [2, 7, top]
    assert res.l1.tolist() == [2, 0, 3]
    assert res.l12.tolist() == [4, 1, 3]
    assert len(res) == 3
    assert res.pool == 4
    assert res.cluster == 4
    read_match(res)


def test_match_result_is_a_snapshot() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2], now=0.0)
    res = d.match([1, 2])
    d.clear(0)
    assert res.nodes == {0: (2, 2)}
    assert res.cluster == 2
    assert res.l12.tolist() == [2]


def test_match_extreme_hashes() -> None:
    d = KvDirectory()
    d.store(0, "L1", [MIN, MAX, 0, -1], now=0.0)
    assert m(d, [MIN, MAX, 0, -1]) == ({0: (4, 4)}, 0, 4)
    assert [h in d for h in (MIN, MAX, 0, -1)] == [True] * 4


# ------------------------------------------------------------------------------------------------
# touch and last-access time


def test_touch_moves_blocks_back_in_eviction_order() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3], now=1.0)
    d.store(0, "L2", [1, 2], now=1.0)
    d.store(0, "L1", [7, 8], now=3.0)
    d.store(0, "L2", [7], now=3.0)
    assert d.eviction_order(0, "L1") == [3, 8]
    assert d.eviction_order(0, "L2") == [2, 7]
    d.touch(0, [1, 2, 3], now=5.0)
    # every tier node 0 holds them in
    assert d.eviction_order(0, "L1") == [8, 3]
    assert d.eviction_order(0, "L2") == [7, 2]


def test_touch_sets_time_even_backwards() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1], now=5.0)
    d.store(0, "L1", [2], now=3.0)
    assert d.eviction_order(0, "L1") == [2, 1]
    d.touch(0, [1], now=1.0)
    assert d.eviction_order(0, "L1") == [1, 2]


def test_touch_stops_at_first_block_the_node_does_not_hold() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3], now=5.0)
    d.store(1, "L1", [1, 2], now=5.0)
    d.remove(0, "L1", [2])  # 2 stays known (3 is its child), held by node 1 only
    # candidates at (0, L1): 1 and 3, both @5: the deeper block first
    assert d.eviction_order(0, "L1") == [3, 1]
    d.touch(0, [1, 2, 3], now=1.0)
    # only 1 was touched: the walk stopped at 2, which node 0 holds in no tier
    assert d.eviction_order(0, "L1") == [1, 3]


def test_touch_continues_across_tiers() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3], now=5.0)
    d.store(0, "L2", [1, 2], now=5.0)
    d.remove(0, "L1", [2])  # node 0: 1 in L1+L2, 2 in L2, 3 in L1
    d.touch(0, [1, 2, 3], now=1.0)
    d.store(0, "L1", [9], now=2.0)
    d.store(0, "L2", [9], now=2.0)
    assert d.eviction_order(0, "L1") == [3, 1, 9]
    assert d.eviction_order(0, "L2") == [2, 9]


def test_touch_stops_like_match() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3], now=5.0)
    d.store(0, "L1", [9], now=6.0)
    assert d.eviction_order(0, "L1") == [3, 9]
    # each of these must leave 3 alone (touching it at 10 would put it last)
    d.touch(0, [2, 3], now=10.0)  # the first block has a parent: nothing
    d.touch(0, [1, 3], now=10.0)  # 3's parent is not 1: 1 only
    d.touch(0, [1, 2, 4, 3], now=10.0)  # 4 is unknown: stops before 3
    d.touch(0, [1, 2, 2, 3], now=10.0)  # the second 2 is not 2's child
    d.touch(1, [1, 2, 3], now=10.0)  # node 1 holds nothing
    assert d.eviction_order(0, "L1") == [3, 9]
    # and this one must leave 9 alone (touching it at 0 would put it first)
    d.touch(0, [5, 9], now=0.0)  # 5 is unknown: nothing
    assert d.eviction_order(0, "L1") == [3, 9]
    d.touch(0, [1, 2, 3], now=10.0)
    assert d.eviction_order(0, "L1") == [9, 3]


def test_touch_is_per_node() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1], now=1.0)
    d.store(0, "L1", [2], now=2.0)
    d.store(1, "L1", [1], now=1.0)
    d.store(1, "L1", [2], now=2.0)
    d.touch(1, [1], now=3.0)
    assert d.eviction_order(0, "L1") == [1, 2]
    assert d.eviction_order(1, "L1") == [2, 1]


def test_store_refreshes_time_per_node_and_tier() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2], now=1.0)
    d.store(0, "L1", [5], now=2.0)
    assert d.eviction_order(0, "L1") == [2, 5]
    d.store(0, "L1", [1, 2], now=3.0)
    assert d.eviction_order(0, "L1") == [5, 2]
    # storing elsewhere (other tier, other node) leaves (0, L1) alone
    d.store(0, "L2", [5], now=9.0)
    d.store(1, "L1", [5], now=9.0)
    assert d.eviction_order(0, "L1") == [5, 2]
    assert d.eviction_order(0, "L2") == [5]


def test_store_does_not_refresh_the_parent() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2], now=5.0)
    d.store(0, "L1", [9], now=3.0)
    d.store(0, "L1", [3], parent=2, now=1.0)
    assert d.eviction_order(0, "L1") == [3, 9]
    d.remove(0, "L1", [3])
    # 2 kept its own time (5), it was not stored by the call above
    assert d.eviction_order(0, "L1") == [9, 2]


def test_now_none_reads_a_monotonic_clock() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1])
    time.sleep(0.002)
    d.store(0, "L1", [2])
    assert d.eviction_order(0, "L1") == [1, 2]
    time.sleep(0.002)
    d.touch(0, [1])
    assert d.eviction_order(0, "L1") == [2, 1]


# ------------------------------------------------------------------------------------------------
# eviction


def test_eviction_ties_go_to_deeper_then_smaller_hash() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2], now=0.0)
    d.store(0, "L1", [5, 6, 7], now=0.0)
    assert d.eviction_order(0, "L1") == [7, 2]
    assert d.evict(0, "L1", 10) == [7, 2, 6, 1, 5]
    assert d.eviction_order(0, "L1") == []
    assert len(d) == 0


def test_eviction_time_comes_before_depth() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2], now=5.0)
    d.store(0, "L1", [3], now=1.0)
    d.store(0, "L1", [4, 5, 6], now=3.0)
    assert d.eviction_order(0, "L1") == [3, 6, 2]


def test_eviction_hash_tiebreak_is_signed() -> None:
    d = KvDirectory()
    for h in (3, MAX, -5, MIN, 0):
        d.store(0, "L2", [h], now=0.0)
    assert d.eviction_order(0, "L2") == [MIN, -5, 0, 3, MAX]


def test_eviction_order_limit() -> None:
    d = KvDirectory()
    for i, h in enumerate((10, 20, 30, 40)):
        d.store(0, "L1", [h], now=float(i))
    assert d.eviction_order(0, "L1", limit=0) == []
    assert d.eviction_order(0, "L1", limit=2) == [10, 20]
    assert d.eviction_order(0, "L1", limit=4) == [10, 20, 30, 40]
    assert d.eviction_order(0, "L1", limit=100) == [10, 20, 30, 40]
    assert d.eviction_order(0, "L1", None) == [10, 20, 30, 40]


def test_eviction_live_branches_go_last() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2], now=0.0)
    d.store(0, "L1", [3, 4], now=9.0)
    d.branch_set("b", [1, 2])
    assert d.eviction_order(0, "L1") == [4, 2]
    assert d.evict(0, "L1", 10) == [4, 3, 2, 1]
    # still referenced by the branch: known placeholders
    assert [h in d for h in (1, 2, 3, 4)] == [True, True, False, False]
    assert d.refcount(1) == 1
    assert d.stats()["placeholders"] == 2


def test_eviction_order_follows_refcount_crossing_zero() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2], now=0.0)
    d.store(0, "L1", [3], now=5.0)
    d.branch_set("a", [1, 2])
    d.branch_set("b", [1, 2])
    assert d.eviction_order(0, "L1") == [3, 2]
    d.branch_end("a")
    assert d.eviction_order(0, "L1") == [3, 2]
    d.branch_end("b")
    assert d.eviction_order(0, "L1") == [2, 3]
    d.branch_set("c", [1, 2])
    assert d.eviction_order(0, "L1") == [3, 2]
    d.branch_set("c", [1])  # 2 loses its count; 1 keeps it but is not a candidate
    assert d.eviction_order(0, "L1") == [2, 3]


def test_eviction_candidates_are_per_node_and_tier() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2], now=0.0)
    d.store(0, "L2", [1, 2, 3], now=0.0)
    d.store(1, "L1", [1, 2, 3, 4], now=0.0)
    # a child held at another (node, tier) does not hide its parent
    assert d.eviction_order(0, "L1") == [2]
    assert d.eviction_order(0, "L2") == [3]
    assert d.eviction_order(1, "L1") == [4]
    assert d.eviction_order(1, "L2") == []
    assert d.eviction_order(9, "L1") == []
    assert d.stats()["candidates"] == 3


def test_evict_cascades_to_parents_in_removal_order() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 5], now=5.0)
    d.store(0, "L1", [9], now=3.0)
    d.store(0, "L1", [3], parent=2, now=1.0)
    # 3 @1; then 9 @3 beats 5 @5 (2 is not a candidate while 5 is held)
    assert d.evict(0, "L1", 1) == [3]
    assert d.eviction_order(0, "L1") == [9, 5]
    assert d.evict(0, "L1", 3) == [9, 5, 2]
    assert d.eviction_order(0, "L1") == [1]
    assert [h in d for h in (1, 2, 3, 5, 9)] == [True, False, False, False, False]
    assert d.evict(0, "L1", 5) == [1]
    assert d.evict(0, "L1", 5) == []
    assert len(d) == 0


def test_evict_zero_changes_nothing() -> None:
    d = scene()
    before = scene_snapshot(d)
    assert d.evict(0, "L1", 0) == []
    assert scene_snapshot(d) == before


def test_evict_only_affects_its_place() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3], now=0.0)
    d.store(0, "L2", [1, 2], now=0.0)
    d.store(1, "L1", [1, 2], now=0.0)
    assert d.evict(0, "L1", 3) == [3, 2, 1]
    assert [h in d for h in (1, 2, 3)] == [True, True, False]
    assert m(d, [1, 2, 3]) == ({0: (0, 2), 1: (2, 2)}, 2, 2)


# ------------------------------------------------------------------------------------------------
# garbage


def test_removed_chain_is_forgotten() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3], now=0.0)
    d.remove(0, "L1", [3, 1, 2])
    assert len(d) == 0
    assert [h in d for h in (1, 2, 3)] == [False] * 3
    assert semantic_stats(d) == dict.fromkeys(STATS_KEYS - {"memory_bytes"}, 0)


def test_removed_middle_block_stays_known_while_it_has_children() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3], now=0.0)
    d.remove(0, "L1", [2])
    assert 2 in d
    assert len(d) == 3
    assert d.stats()["placeholders"] == 1
    assert m(d, [1, 2, 3]) == ({0: (1, 1)}, 0, 1)
    assert d.eviction_order(0, "L1") == [3, 1]
    d.remove(0, "L1", [3])
    # 3 goes, then 2 (unheld, unreferenced, childless); 1 is still held
    assert [h in d for h in (1, 2, 3)] == [True, False, False]
    assert len(d) == 1
    assert d.stats()["placeholders"] == 0


def test_block_held_elsewhere_survives_removal() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2], now=0.0)
    d.store(1, "L2", [1, 2], now=0.0)
    d.remove(0, "L1", [1, 2])
    assert len(d) == 2
    assert m(d, [1, 2]) == ({1: (0, 2)}, 2, 2)


def test_dropped_block_is_unknown_again() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2], now=0.0)
    d.evict(0, "L1", 1)
    assert 2 not in d
    # 2 may now come back under another parent
    d.store(0, "L1", [5, 2], now=0.0)
    assert m(d, [5, 2]) == ({0: (2, 2)}, 0, 2)
    assert m(d, [1, 2]) == ({0: (1, 1)}, 0, 1)


def test_remove_ignores_unknown_and_unheld_blocks() -> None:
    d = scene()
    before = scene_snapshot(d)
    d.remove(0, "L1", [42, MIN, MAX])
    d.remove(3, "L1", [1, 2, 3])  # node 3 holds nothing
    d.remove(1, "L2", [1, 5])  # node 1 holds them in L1 only
    d.remove(0, "L1", [])
    d.remove(0, "L1", [6])  # a placeholder
    assert scene_snapshot(d) == before
    d.remove(0, "L1", [3, 3])  # repeats: the second is simply not held any more
    assert d.eviction_order(0, "L1") == [2]


def test_placeholder_dropped_when_branch_ends() -> None:
    d = KvDirectory()
    d.branch_set("a", [1, 2, 3])
    d.store(0, "L1", [1, 2], now=0.0)
    assert d.stats()["placeholders"] == 1
    assert d.branch_end("a") is True
    assert [h in d for h in (1, 2, 3)] == [True, True, False]
    assert d.stats()["placeholders"] == 0
    assert d.refcount(1) == 0


def test_interior_placeholder_kept_for_referenced_descendant() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3], now=0.0)
    d.branch_set("a", [1, 2, 3, 4])
    d.clear(0)
    assert len(d) == 4
    assert d.stats()["placeholders"] == 4
    d.branch_set("a", [1])
    assert len(d) == 1
    d.branch_end("a")
    assert len(d) == 0


# ------------------------------------------------------------------------------------------------
# clear


def test_clear_node_both_tiers() -> None:
    d = scene()
    d.clear(0)
    assert m(d, [1, 2, 3, 4]) == ({1: (1, 1)}, 0, 1)
    assert [h in d for h in (1, 2, 3, 4, 5, 6)] == [True, True, False, False, True, True]
    assert d.eviction_order(0, "L1") == []
    assert d.eviction_order(0, "L2") == []
    assert d.stats()["nodes"] == 2


def test_clear_one_tier() -> None:
    d = scene()
    d.clear(0, "L2")
    assert m(d, [1, 2, 3, 4]) == ({0: (3, 3), 1: (1, 1)}, 0, 3)
    assert 4 not in d
    assert d.eviction_order(0, "L1") == [3]
    d.clear(0, "L1")
    assert d.stats()["nodes"] == 2
    d.clear(3)  # holds nothing
    d.clear(3, "L1")
    assert d.stats()["nodes"] == 2


# ------------------------------------------------------------------------------------------------
