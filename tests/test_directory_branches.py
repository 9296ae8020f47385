"""Branches: versions, placeholders, compaction, fork and end (DESIGN §2, "Branches")."""

from __future__ import annotations

import pytest

from directory_helpers import (
    m,
    scene,
    scene_snapshot,
    semantic_stats,
)
from evolving_infra import (
    KvDirectory,
    ParentMismatchError,
)

MIN = -(2**63)
MAX = 2**63 - 1


# branches


def test_refcount_counts_live_branches() -> None:
    d = KvDirectory()
    d.branch_set("a", [1, 2])
    d.branch_set("b", [1, 3])
    assert [d.refcount(h) for h in (1, 2, 3, 99)] == [2, 1, 1, 0]
    assert d.stats()["branches"] == 2


def test_branch_ids_int_and_str_are_distinct() -> None:
    d = KvDirectory()
    d.branch_set(1, [1])
    d.branch_set("1", [1])
    assert d.refcount(1) == 2
    assert d.stats()["branches"] == 2
    assert d.branch_end(1) is True
    assert d.refcount(1) == 1
    assert d.branch_end(1) is False
    assert d.branch_end("1") is True
    assert d.branch_end("1") is False
    assert len(d) == 0


def test_branch_versions_without_version_count_up_from_zero() -> None:
    d = KvDirectory()
    assert d.branch_set("b", [1]) is True  # version 0
    assert d.branch_set("b", [1, 2], version=0) is True  # equal applies
    assert d.branch_set("b", [1, 2, 3]) is True  # version 1
    assert d.branch_set("b", [4], version=0) is False  # stale
    assert d.refcount(3) == 1
    assert 4 not in d
    assert d.branch_set("b", [4], version=1) is True
    assert d.branch_set("b", [5]) is True  # version 2
    assert d.branch_set("b", [6], version=1) is False
    assert d.branch_set("b", [6], version=2) is True
    assert [d.refcount(h) for h in (1, 3, 4, 5, 6)] == [0, 0, 0, 0, 1]


def test_branch_versions_jump_and_continue() -> None:
    d = KvDirectory()
    assert d.branch_set("b", [1], version=10) is True
    assert d.branch_set("b", [2], version=3) is False
    assert d.branch_set("b", [2]) is True  # version 11
    assert d.branch_set("b", [3], version=10) is False
    assert d.branch_set("b", [3], version=11) is True
    assert d.branch_set("b", [3, 9], version=11) is True  # applying an equal version keeps it
    assert d.branch_set("b", [3], version=11) is True
    assert d.branch_set("b", [4], version=50) is True
    assert d.branch_set("b", [5], version=49) is False
    assert [d.refcount(h) for h in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 0]


def test_stale_branch_set_changes_nothing() -> None:
    d = scene()
    d.branch_set("v", [1, 2], version=5)
    before = scene_snapshot(d)
    assert d.branch_set("v", [7, 8], version=4) is False
    assert d.branch_set("v", [], version=0) is False
    assert scene_snapshot(d) == before
    assert 7 not in d


def test_branch_versions_are_any_64_bit_int() -> None:
    d = KvDirectory()
    assert d.branch_set("n", [1], version=-5) is True
    assert d.branch_set("n", [2], version=-6) is False
    assert d.branch_set("n", [2]) is True  # version -4
    assert d.branch_set("n", [3], version=-5) is False
    assert d.branch_set("n", [3], version=-4) is True
    assert d.branch_set("m", [4], version=2**63 - 1) is True
    assert d.branch_set("m", [5], version=2**63 - 2) is False
    assert [d.refcount(h) for h in (1, 2, 3, 4, 5)] == [0, 0, 1, 1, 0]


def test_ended_branch_starts_over() -> None:
    d = KvDirectory()
    d.branch_set("b", [1], version=5)
    d.branch_end("b")
    assert d.branch_set("b", [2], version=0) is True
    assert d.branch_set("b", [3]) is True  # version 1
    assert d.branch_set("b", [4], version=0) is False
    assert d.refcount(3) == 1


def test_placeholders_count_once_stored() -> None:
    d = KvDirectory()
    d.branch_set("a", [1, 2, 3])
    assert len(d) == 3
    assert m(d, [1, 2, 3]) == ({}, 0, 0)
    assert semantic_stats(d) == {
        "blocks": 3,
        "placeholders": 3,
        "locations": 0,
        "locations_l1": 0,
        "locations_l2": 0,
        "nodes": 0,
        "branches": 1,
        "candidates": 0,
    }
    d.store(0, "L1", [1, 2], now=0.0)
    d.store(0, "L1", [9], now=5.0)
    assert [d.refcount(h) for h in (1, 2, 3)] == [1, 1, 1]
    assert d.stats()["placeholders"] == 1
    assert d.eviction_order(0, "L1") == [9, 2]
    # a placeholder fixes its parent like any known block
    with pytest.raises(ParentMismatchError):
        d.store(0, "L1", [7, 3], now=0.0)
    d.store(0, "L2", [3], parent=2, now=0.0)
    assert m(d, [1, 2, 3]) == ({0: (2, 3)}, 0, 3)


def test_compaction_releases_replaced_history() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3, 4], now=1.0)
    d.store(0, "L1", [9], now=5.0)
    d.branch_set("a", [1, 2, 3, 4])
    assert d.eviction_order(0, "L1") == [9, 4]
    assert d.branch_set("a", [1, 5]) is True
    assert [d.refcount(h) for h in (1, 2, 3, 4, 5)] == [1, 0, 0, 0, 1]
    assert d.eviction_order(0, "L1") == [4, 9]
    assert 5 in d
    assert d.stats()["placeholders"] == 1


def test_branch_set_empty_chain() -> None:
    d = KvDirectory()
    d.branch_set("a", [1, 2])
    assert d.branch_set("a", []) is True
    assert len(d) == 0
    assert d.stats()["branches"] == 1


def test_branch_fork_copies_context_and_version() -> None:
    d = KvDirectory()
    d.branch_set("a", [1, 2], version=4)
    d.branch_fork("a", "b")
    assert [d.refcount(h) for h in (1, 2)] == [2, 2]
    assert d.stats()["branches"] == 2
    assert d.branch_set("b", [1], version=3) is False
    assert d.branch_set("b", [1], version=4) is True
    assert [d.refcount(h) for h in (1, 2)] == [2, 1]
    assert d.branch_set("a", [1, 2, 3]) is True  # a: version 5
    assert d.branch_set("a", [1], version=4) is False
    d.branch_fork("b", 7)
    assert d.branch_set(7, [1], version=3) is False
    assert d.branch_set(7, [1]) is True
    assert d.branch_set(7, [8], version=5) is True
    assert [d.refcount(h) for h in (1, 2, 3, 8)] == [2, 1, 1, 1]


def test_branch_fork_of_empty_branch() -> None:
    d = KvDirectory()
    d.branch_set("a", [])
    d.branch_fork("a", "b")
    assert d.stats()["branches"] == 2
    assert d.branch_end("b") is True


def test_branch_end() -> None:
    d = scene()
    assert d.branch_end("nope") is False
    assert d.branch_end(8) is False
    assert d.branch_end("a") is True
    assert 6 not in d
    assert [d.refcount(h) for h in (1, 2, 5)] == [1, 0, 1]
    assert d.branch_end("a") is False
    assert d.branch_end(7) is True
    assert d.stats()["branches"] == 0


# ------------------------------------------------------------------------------------------------
