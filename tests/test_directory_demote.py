"""`KvDirectory.demote`: `evict` from L1 whose blocks are then held in the node's L2.

Checked against the two calls it replaces (`evict`, then a `store` of each run of the evicted
blocks, parents first) on random forests of chains held by a few nodes, branches included (they
change the eviction order and keep blocks known). The Rust differential test checks the same
against the reference model (`rust/kvdir/tests/differential.rs`, op `Demote`).
"""

from __future__ import annotations

import math
import random

import pytest

from evolving_infra import InvalidArgumentError, KvDirectory

NODES = 3


def chains(rng: random.Random, n: int) -> list[list[int]]:
    """`n` chains from first pages, each forking off an earlier one at a random depth."""
    out: list[list[int]] = []
    for _ in range(n):
        base = rng.choice(out) if out and rng.random() < 0.7 else []
        fork = base[: rng.randrange(len(base) + 1)]
        out.append(fork + [rng.getrandbits(62) for _ in range(rng.randrange(1, 12))])
    return out


def build(seed: int) -> tuple[KvDirectory, list[list[int]]]:
    rng = random.Random(seed)
    cs = chains(rng, 30)
    d = KvDirectory()
    for t, c in enumerate(cs):
        node = rng.randrange(NODES)
        k = rng.randrange(len(c))  # held from a first page, so L1 stays prefix-closed
        d.store(node, "L1", c[: k + 1], None, float(t))
        if rng.random() < 0.3:
            d.store(node, "L2", c[: rng.randrange(1, len(c) + 1)], None, float(t))
        if rng.random() < 0.3:
            d.branch_set(f"b{t}", c[: rng.randrange(1, len(c) + 1)])
    return d, cs


def parents_of(cs: list[list[int]]) -> dict[int, int | None]:
    return {h: c[i - 1] if i else None for c in cs for i, h in enumerate(c)}


def evict_then_store(
    d: KvDirectory, node: int, n: int, now: float, parent: dict[int, int | None]
) -> list[int]:
    """What `demote` replaces: reversed, the evicted blocks are runs of parent-child chains."""
    evicted = d.evict(node, "L1", n)
    run: list[int] = []
    for h in reversed(evicted):
        if run and parent[h] == run[-1]:
            run.append(h)
            continue
        if run:
            d.store(node, "L2", run, parent[run[0]], now)
        run = [h]
    if run:
        d.store(node, "L2", run, parent[run[0]], now)
    return evicted


def state(d: KvDirectory, cs: list[list[int]]) -> tuple[object, ...]:
    stats = d.stats()
    stats.pop("memory_bytes")
    orders = [d.eviction_order(n, t) for n in range(NODES) for t in ("L1", "L2")]
    matches = [d.match(c).nodes for c in cs]
    return stats, len(d), orders, matches


@pytest.mark.parametrize("seed", range(8))
def test_demote_equals_evict_then_storing_each_run_in_l2(seed: int) -> None:
    rng = random.Random(100 + seed)
    for step in range(6):
        a, cs = build(seed)
        b, _ = build(seed)
        parent = parents_of(cs)
        node, n, now = rng.randrange(NODES), rng.randrange(0, 40), 100.0 + step
        hashes, parents = a.demote(node, n, now)
        assert hashes == evict_then_store(b, node, n, now, parent)
        assert state(a, cs) == state(b, cs)
        assert parents == [parent[h] for h in hashes]
        for h in hashes:  # every demoted block is held in the node's L2 now
            assert h in a


def test_demote_reports_runs_and_first_pages() -> None:
    d = KvDirectory()
    d.store(0, "L1", [1, 2, 3], None, 1.0)
    d.store(0, "L1", [4], 2, 2.0)  # a fork under 2, more recent
    assert d.demote(0, 10, 5.0) == ([3, 4, 2, 1], [2, 2, 1, None])
    assert d.held(0, "L1") == 0
    assert d.held(0, "L2") == 4
    assert d.match([1, 2, 3]).nodes == {0: (0, 3)}
    assert d.eviction_order(0, "L2") == [3, 4]  # the same time: deeper first, then by hash


def test_demote_arguments() -> None:
    d = KvDirectory()
    assert d.demote(5, 3, 1.0) == ([], [])  # an unknown node: nothing to demote
    with pytest.raises(InvalidArgumentError):
        d.demote(0, -1, 1.0)
    with pytest.raises(InvalidArgumentError):
        d.demote(0, 1, math.nan)
    with pytest.raises(InvalidArgumentError):
        d.demote(-1, 1, 1.0)
