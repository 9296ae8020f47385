"""Validation: every error class, its attributes, and that a refused call changes nothing."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import msgpack
import pytest

from directory_helpers import (
    m,
    scene,
    scene_snapshot,
)
from evolving_infra import (
    BranchExistsError,
    DuplicateHashError,
    EventDecodeError,
    HashRangeError,
    InvalidArgumentError,
    KvDirectory,
    KvDirectoryError,
    ParentMismatchError,
    UnknownBranchError,
    UnknownParentError,
    block_hashes,
)
from reference_directory import reference_block_hashes

MIN = -(2**63)
MAX = 2**63 - 1


# errors: every class, its attributes, and the directory unchanged


def test_error_hierarchy() -> None:
    for cls in (
        UnknownParentError,
        ParentMismatchError,
        DuplicateHashError,
        HashRangeError,
        UnknownBranchError,
        BranchExistsError,
        InvalidArgumentError,
        EventDecodeError,
    ):
        assert issubclass(cls, KvDirectoryError)
    assert issubclass(KvDirectoryError, ValueError)


def expect_unchanged(
    d: KvDirectory, call: Callable[[], object], error: type[KvDirectoryError]
) -> Any:
    """Run `call`, which must raise `error`, and check the scene is untouched; return the error."""
    before = scene_snapshot(d)
    with pytest.raises(error) as info:
        call()
    assert scene_snapshot(d) == before
    return info.value


def test_unknown_parent() -> None:
    d = scene()
    err = expect_unchanged(
        d, lambda: d.store(0, "L1", [20, 21], parent=42, now=0.0), UnknownParentError
    )
    assert err.parent == 42
    err = expect_unchanged(d, lambda: d.store(0, "L1", [], parent=MIN, now=0.0), UnknownParentError)
    assert err.parent == MIN
    # an empty chain under a known parent (or none) is a no-op
    before = scene_snapshot(d)
    d.store(0, "L1", [], parent=1, now=0.0)
    d.store(0, "L1", [], now=0.0)
    assert scene_snapshot(d) == before


def test_parent_mismatch_later_block() -> None:
    d = scene()
    err = expect_unchanged(d, lambda: d.store(1, "L2", [20, 21, 2], now=0.0), ParentMismatchError)
    assert (err.hash, err.parent, err.known_parent) == (2, 21, 1)
    assert 20 not in d


def test_parent_mismatch_first_block_without_parent() -> None:
    d = scene()
    err = expect_unchanged(d, lambda: d.store(3, "L1", [2, 3], now=0.0), ParentMismatchError)
    assert (err.hash, err.parent, err.known_parent) == (2, None, 1)


def test_parent_mismatch_first_block_with_parent() -> None:
    d = scene()
    err = expect_unchanged(d, lambda: d.store(3, "L1", [1], parent=5, now=0.0), ParentMismatchError)
    assert (err.hash, err.parent, err.known_parent) == (1, 5, None)
    err = expect_unchanged(d, lambda: d.store(3, "L1", [3], parent=5, now=0.0), ParentMismatchError)
    assert (err.hash, err.parent, err.known_parent) == (3, 5, 2)


def test_parent_mismatch_against_placeholder() -> None:
    d = scene()
    err = expect_unchanged(d, lambda: d.store(0, "L1", [6], parent=3, now=0.0), ParentMismatchError)
    assert (err.hash, err.parent, err.known_parent) == (6, 3, 2)


def test_parent_mismatch_in_branch_set() -> None:
    d = scene()
    err = expect_unchanged(d, lambda: d.branch_set("z", [2, 3]), ParentMismatchError)
    assert (err.hash, err.parent, err.known_parent) == (2, None, 1)
    err = expect_unchanged(d, lambda: d.branch_set("a", [1, 3]), ParentMismatchError)
    assert (err.hash, err.parent, err.known_parent) == (3, 1, 2)


def test_duplicate_hash() -> None:
    d = scene()
    err = expect_unchanged(d, lambda: d.store(0, "L1", [20, 21, 20], now=0.0), DuplicateHashError)
    assert err.hash == 20
    err = expect_unchanged(d, lambda: d.store(0, "L1", [20, 20], now=0.0), DuplicateHashError)
    assert err.hash == 20
    err = expect_unchanged(
        d, lambda: d.store(0, "L1", [20, 21, 22, 21], parent=4, now=0.0), DuplicateHashError
    )
    assert err.hash == 21
    err = expect_unchanged(d, lambda: d.branch_set("z", [30, 31, 30]), DuplicateHashError)
    assert err.hash == 30
    assert 20 not in d
    assert 30 not in d


def test_chain_containing_its_parent() -> None:
    # The chain repeats its parent. Such a block is necessarily known under another parent too,
    # so either report is right; the directory must not change.
    d = scene()
    before = scene_snapshot(d)
    for hashes in ([4], [20, 4], [20, 21, 4]):
        with pytest.raises((DuplicateHashError, ParentMismatchError)) as info:
            d.store(1, "L1", hashes, parent=4, now=0.0)
        if isinstance(info.value, DuplicateHashError):
            assert info.value.hash == 4
        assert scene_snapshot(d) == before


def test_stale_branch_set_is_validated_first() -> None:
    d = scene()
    d.branch_set("v", [1], version=5)
    expect_unchanged(d, lambda: d.branch_set("v", [2, 3], version=0), ParentMismatchError)
    expect_unchanged(d, lambda: d.branch_set("v", [20, 20], version=0), DuplicateHashError)
    expect_unchanged(d, lambda: d.branch_set("v", [2**63], version=0), HashRangeError)


def test_branch_fork_errors() -> None:
    d = scene()
    err = expect_unchanged(d, lambda: d.branch_fork("zz", "b"), UnknownBranchError)
    assert err.branch == "zz"
    err = expect_unchanged(d, lambda: d.branch_fork(5, "b"), UnknownBranchError)
    assert err.branch == 5
    assert type(err.branch) is int
    err = expect_unchanged(d, lambda: d.branch_fork("a", "a"), BranchExistsError)
    assert err.branch == "a"
    err = expect_unchanged(d, lambda: d.branch_fork("a", 7), BranchExistsError)
    assert err.branch == 7
    assert type(err.branch) is int
    err = expect_unchanged(d, lambda: d.branch_fork(7, "a"), BranchExistsError)
    assert err.branch == "a"


OUT_OF_RANGE = [2**63, -(2**63) - 1, 2**64, 2**64 - 1, 2**200, -(2**200)]


def hash_calls(d: KvDirectory, bad: int) -> list[Callable[[], object]]:
    """Every way a hash enters the directory, with `bad` among good hashes."""
    return [
        lambda: d.store(0, "L1", [bad], now=0.0),
        lambda: d.store(0, "L1", [20, bad], now=0.0),
        lambda: d.store(0, "L1", [20], parent=bad, now=0.0),
        lambda: d.remove(0, "L1", [1, bad]),
        lambda: d.match([1, 2, bad]),
        lambda: d.match([bad]),
        lambda: d.touch(0, [1, bad], now=0.0),
        lambda: d.branch_set("a", [1, bad]),
        lambda: d.branch_set("new", [bad]),
        lambda: d.refcount(bad),
        lambda: bad in d,
    ]


@pytest.mark.parametrize("bad", OUT_OF_RANGE)
def test_hash_range(bad: int) -> None:
    d = scene()
    for call in hash_calls(d, bad):
        err = expect_unchanged(d, call, HashRangeError)
        assert err.value == bad


def test_hash_range_bounds_are_inclusive() -> None:
    d = KvDirectory()
    d.store(0, "L1", [MIN], now=0.0)
    d.store(0, "L1", [MAX], parent=MIN, now=0.0)
    assert m(d, [MIN, MAX]) == ({0: (2, 2)}, 0, 2)
    assert d.refcount(MAX) == 0


def node_calls(d: KvDirectory, node: int) -> list[Callable[[], object]]:
    batch = msgpack.packb([0.0, [], 0])
    return [
        lambda: d.store(node, "L1", [20], now=0.0),
        lambda: d.remove(node, "L1", [1]),
        lambda: d.clear(node),
        lambda: d.clear(node, "L1"),
        lambda: d.touch(node, [1], now=0.0),
        lambda: d.eviction_order(node, "L1"),
        lambda: d.evict(node, "L1", 1),
        lambda: d.apply_events(node, batch),
    ]


@pytest.mark.parametrize("node", [-1, 2**31 - 1, 2**31, 2**32, 2**64, -(2**63)])
def test_invalid_node(node: int) -> None:
    d = scene()
    for call in node_calls(d, node):
        err = expect_unchanged(d, call, InvalidArgumentError)
        assert err.argument == "node"


def test_largest_node() -> None:
    d = KvDirectory()
    top = 2**31 - 2
    d.store(top, "L2", [1], now=0.0)
    d.touch(top, [1], now=1.0)
    assert d.eviction_order(top, "L2") == [1]
    assert m(d, [1]) == ({top: (0, 1)}, 1, 1)
    assert d.evict(top, "L2", 1) == [1]


@pytest.mark.parametrize("tier", ["L3", "l1", "", "GPU", "L1 ", "L12"])
def test_invalid_tier(tier: Any) -> None:
    d = scene()
    calls: list[Callable[[], object]] = [
        lambda: d.store(0, tier, [20], now=0.0),
        lambda: d.remove(0, tier, [1]),
        lambda: d.clear(0, tier),
        lambda: d.eviction_order(0, tier),
        lambda: d.evict(0, tier, 1),
    ]
    for call in calls:
        err = expect_unchanged(d, call, InvalidArgumentError)
        assert err.argument == "tier"


@pytest.mark.parametrize("now", [math.nan, math.inf, -math.inf])
def test_invalid_now(now: float) -> None:
    d = scene()
    for call in (
        lambda: d.store(0, "L1", [20], now=now),
        lambda: d.store(0, "L1", [1, 2], now=now),
        lambda: d.touch(0, [1, 2], now=now),
    ):
        err = expect_unchanged(d, call, InvalidArgumentError)
        assert err.argument == "now"


def test_invalid_counts_and_versions() -> None:
    d = scene()
    err = expect_unchanged(d, lambda: d.eviction_order(0, "L1", limit=-1), InvalidArgumentError)
    assert err.argument == "limit"
    err = expect_unchanged(d, lambda: d.evict(0, "L1", -1), InvalidArgumentError)
    assert err.argument == "n"
    # versions are 64-bit ints
    for version in (2**63, 2**64, -(2**63) - 1):
        err = expect_unchanged(
            d, partial(d.branch_set, "a", [1], version=version), InvalidArgumentError
        )
        assert err.argument == "version"
        err = expect_unchanged(
            d, partial(d.branch_set, "new", [1], version=version), InvalidArgumentError
        )
        assert err.argument == "version"


def test_block_hashes_argument_errors() -> None:
    for page_size in (0, -1):
        with pytest.raises(InvalidArgumentError) as info:
            block_hashes([1, 2, 3], page_size)
        assert info.value.argument == "page_size"
    for token in (-1, 2**32):
        with pytest.raises(InvalidArgumentError) as info:
            block_hashes([1, token, 3, 4], 2)
        assert info.value.argument == "token_ids"


def test_block_hashes_full_pages_only() -> None:
    tokens = list(range(100, 110))
    assert block_hashes([], 4) == []
    assert block_hashes(tokens[:3], 4) == []
    full = block_hashes(tokens, 4)
    assert len(full) == 2
    assert full == reference_block_hashes(tokens, 4)
    assert block_hashes(tokens[:8], 4) == full
    assert block_hashes(tokens[:7], 4) == full[:1]
    # a page hash determines its whole prefix
    assert block_hashes([7, *tokens[1:8]], 4)[1] != full[1]
    assert block_hashes([0, 2**32 - 1], 1) == reference_block_hashes([0, 2**32 - 1], 1)


# ------------------------------------------------------------------------------------------------
