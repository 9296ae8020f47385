"""Differential test: `KvDirectory` and the pure-Python reference driven by the same random calls.

A hypothesis `RuleBasedStateMachine` (the dynamo kv-router harness idea): a small hash alphabet so
chains collide, three nodes, both tiers, explicit times with ties, branches with versions, forks,
ends, evictions, clears, and invalid calls. Invalid calls must raise, in both, an error of a class
the reference finds (when a call breaks several rules, any of them may be reported), and change
nothing. After every step the two must agree on everything observable.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from directory_helpers import TIERS, read_match, semantic_stats
from evolving_infra import KvDirectory, KvDirectoryError
from reference_directory import ReferenceDirectory

MIN = -(2**63)
MAX = 2**63 - 1

# A consistent forest most chains come from, so that stores mostly succeed and build real trees;
# random chains over the same alphabet (plus two outsiders) then collide with it.
UNIVERSE_PARENT: dict[int, int | None] = {
    1: None,
    2: 1,
    3: 2,
    5: 3,
    8: 1,
    -7: None,
    0: -7,
    MIN: 0,
    MAX: None,
    -1: MAX,
}
ALPHABET = [*UNIVERSE_PARENT, 13, 21]


def _path(h: int) -> list[int]:
    path = [h]
    parent = UNIVERSE_PARENT[h]
    while parent is not None:
        path.append(parent)
        parent = UNIVERSE_PARENT[parent]
    return path[::-1]


PATHS = [_path(h) for h in UNIVERSE_PARENT]
LONG_PATHS = [p for p in PATHS if len(p) >= 2]
FIXED_PROBES = [
    *PATHS,
    [13, 21],
    [21, 13],
    [1, 13],
    [13, 1],
    [2, 3],
    [1, 3],
    [1, 2, 3, 5, 13],
    [1, 1],
]
NODES = [0, 1, 2]

nodes = st.sampled_from(NODES)
tiers = st.sampled_from(TIERS)
times = st.sampled_from([0.0, 1.0, 2.0, 2.5, 3.0, 7.0])
branch_ids = st.sampled_from(["a", "b", 0])
versions = st.none() | st.integers(-1, 4)
universe_chains = st.sampled_from(PATHS)
random_chains = st.lists(st.sampled_from(ALPHABET), max_size=4)
chains = st.one_of(universe_chains, universe_chains, random_chains)


NAN = math.nan
INF = math.inf
# (method, args, kwargs): each breaks at least one argument rule
INVALID_CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("store", (2**32, "L2", [1]), {"now": 0.0}),
    ("store", (-1, "L1", [1]), {"now": 0.0}),
    ("store", (0, "L3", [1]), {"now": 0.0}),
    ("store", (0, "L1", [1, 2**63]), {"now": 0.0}),
    ("store", (0, "L1", [13]), {"parent": MIN - 1, "now": 0.0}),
    ("store", (0, "L1", [1]), {"now": NAN}),
    ("store", (1, "L2", [1, 2]), {"now": INF}),
    ("store", (1, "L2", [1, 2]), {"now": -INF}),
    ("remove", (0, "L9", [1]), {}),
    ("remove", (-1, "L1", [1]), {}),
    ("remove", (0, "L1", [2**63]), {}),
    ("clear", (2**32,), {}),
    ("clear", (0, "L0"), {}),
    ("touch", (0, [1, 2**64]), {"now": 0.0}),
    ("touch", (0, [1]), {"now": NAN}),
    ("touch", (-5, [1]), {"now": 0.0}),
    ("match", ([1, 2, MIN - 1],), {}),
    ("refcount", (2**63,), {}),
    ("contains", (MIN - 1,), {}),
    ("branch_set", ("a", [1, 2**63]), {}),
    ("branch_set", ("a", [1]), {"version": 2**63}),
    ("branch_set", ("b", [1, 2]), {"version": MIN - 1}),
    ("eviction_order", (0, "L1"), {"limit": -1}),
    ("eviction_order", (0, "LL"), {}),
    ("evict", (0, "L1", -1), {}),
    ("evict", (2**32, "L1", 1), {}),
]


def _outcome(value: object) -> str:
    """A coarse label of a return value, for `--hypothesis-show-statistics`."""
    if isinstance(value, list):
        return "a non-empty list" if value else "an empty list"
    if isinstance(value, tuple):
        return "a non-empty match" if value[2] else "an empty match"
    return repr(value)


class DirectoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.d = KvDirectory()
        self.ref = ReferenceDirectory()

    def both(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Call `name` on both; they must return the same value or raise compatible errors."""
        call = f"{name}{args}{kwargs}"
        try:
            expected = getattr(self.ref, name)(*args, **kwargs)
        except KvDirectoryError:
            allowed = self.ref.last_faults
            with pytest.raises(KvDirectoryError) as info:
                self._native(name, *args, **kwargs)
            assert isinstance(info.value, allowed), f"{call}: {info.value!r}, expected {allowed}"
            event(f"{name} raised {type(info.value).__name__}")
            return
        assert self.ref.last_faults == ()
        actual = self._native(name, *args, **kwargs)
        assert actual == expected, call
        event(f"{name} returned {_outcome(actual)}")

    def _native(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "contains":
            return args[0] in self.d
        result = getattr(self.d, name)(*args, **kwargs)
        return read_match(result) if name == "match" else result

    # NOTE: hypothesis picks rules uniformly; three store rules keep the directory populated.
    @rule(node=nodes, tier=tiers, hashes=universe_chains, now=times)
    def store_path(self, node: int, tier: str, hashes: list[int], now: float) -> None:
        self.both("store", node, tier, hashes, now=now)

    @rule(node=nodes, tier=tiers, data=st.data(), now=times)
    def store_suffix(self, node: int, tier: str, data: st.DataObject, now: float) -> None:
        """A chain under a parent: mostly one the directory knows, sometimes not."""
        cuts = [(p, k) for p in LONG_PATHS for k in range(1, len(p)) if p[k - 1] in self.ref]
        if not cuts or data.draw(st.integers(0, 4), label="unknown parent?") == 0:
            cuts = [(p, k) for p in LONG_PATHS for k in range(1, len(p))]
        path, k = data.draw(st.sampled_from(cuts), label="path, cut")
        self.both("store", node, tier, path[k:], parent=path[k - 1], now=now)

    @rule(
        node=nodes,
        tier=tiers,
        hashes=random_chains,
        parent=st.none() | st.sampled_from(ALPHABET),
        now=times,
    )
    def store_random(
        self, node: int, tier: str, hashes: list[int], parent: int | None, now: float
    ) -> None:
        self.both("store", node, tier, hashes, parent=parent, now=now)

    @rule(
        node=nodes, tier=tiers, hashes=st.lists(st.sampled_from(ALPHABET), unique=True, max_size=4)
    )
    def remove(self, node: int, tier: str, hashes: list[int]) -> None:
        self.both("remove", node, tier, hashes)

    @rule(node=nodes, hashes=chains, now=times)
    def touch(self, node: int, hashes: list[int], now: float) -> None:
        self.both("touch", node, hashes, now=now)

    @rule(hashes=random_chains)
    def match(self, hashes: list[int]) -> None:
        self.both("match", hashes)

    @rule(branch=branch_ids, hashes=chains, version=versions)
    def branch_set(self, branch: str | int, hashes: list[int], version: int | None) -> None:
        self.both("branch_set", branch, hashes, version=version)

    @rule(branch=branch_ids, hashes=chains, data=st.data())
    def branch_set_near_current_version(
        self, branch: str | int, hashes: list[int], data: st.DataObject
    ) -> None:
        current = self.ref.branch_version(branch)
        if current is None:
            current = 0
        version = data.draw(st.sampled_from([current - 1, current, current + 1]), label="version")
        self.both("branch_set", branch, hashes, version=version)

    @rule(fork=st.booleans(), src=branch_ids, dst=branch_ids)
    def branch_fork_or_end(self, fork: bool, src: str | int, dst: str | int) -> None:
        if fork:
            self.both("branch_fork", src, dst)
        else:
            self.both("branch_end", src)

    @rule(
        action=st.sampled_from(["evict", "eviction_order", "clear"]),
        node=nodes,
        tier=tiers,
        n=st.integers(0, 3),
        both_tiers=st.booleans(),
    )
    def evict_or_clear(self, action: str, node: int, tier: str, n: int, both_tiers: bool) -> None:
        if action == "evict":
            self.both("evict", node, tier, n)
        elif action == "eviction_order":
            self.both("eviction_order", node, tier, limit=n)
        elif both_tiers:
            self.both("clear", node)
        else:
            self.both("clear", node, tier)

    @rule(call=st.sampled_from(INVALID_CALLS))
    def invalid(self, call: tuple[str, tuple[Any, ...], dict[str, Any]]) -> None:
        name, args, kwargs = call
        self.both(name, *args, **kwargs)
        assert self.ref.last_faults, f"{call} should be invalid"

    @invariant()
    def agree(self) -> None:
        assert len(self.d) == len(self.ref)
        assert semantic_stats(self.d) == self.ref.stats()
        for chain in self.ref.paths() + FIXED_PROBES:
            assert read_match(self.d.match(chain)) == self.ref.match(chain), chain
        for h in ALPHABET:
            assert (h in self.d) == (h in self.ref), h
            assert self.d.refcount(h) == self.ref.refcount(h), h
        for node in NODES:
            for tier in TIERS:
                actual = self.d.eviction_order(node, tier)
                assert actual == self.ref.eviction_order(node, tier), (node, tier)


def test_directory_agrees_with_reference() -> None:
    run_state_machine_as_test(
        DirectoryMachine,
        settings=settings(
            max_examples=300,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
