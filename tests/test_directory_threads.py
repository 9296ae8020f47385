"""One directory shared by threads, as the router's event loop and ingestion threads share it."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import msgpack

from directory_helpers import (
    TIERS,
    read_match,
    semantic_stats,
)
from evolving_infra import (
    KvDirectory,
)
from reference_directory import ReferenceDirectory, reference_block_hashes

MIN = -(2**63)
MAX = 2**63 - 1


# threads


Op = tuple[Any, ...]


def _universe(rng: random.Random) -> list[list[int]]:
    """Consistent chains (real page hashes of prompts sharing prefixes), as agents make them."""
    base = [rng.randrange(50_000) for _ in range(128)]
    prompts = []
    for _ in range(12):
        shared = rng.choice([0, 16, 32, 64, 128])
        tail = [rng.randrange(50_000) for _ in range(rng.choice([8, 32, 64]))]
        prompts.append(base[:shared] + tail)
    return [reference_block_hashes(p, 4) for p in prompts]


def _thread_ops(rng: random.Random, node: int, universe: list[list[int]], count: int) -> list[Op]:
    """A thread's calls; it only changes its own node and branch, so threads commute."""
    ops: list[Op] = []
    held: dict[str, set[int]] = {"L1": set(), "L2": set()}
    for step in range(count):
        chain = rng.choice(universe)
        k = rng.randrange(1, len(chain) + 1)
        tier = rng.choice(["L1", "L2"])
        kind = rng.choice(["store", "store_parent", "remove", "touch", "branch", "match"])
        now = float(rng.randrange(50))
        if kind == "store_parent":
            start = rng.randrange(0, k)
            parent = chain[start - 1] if start else None
            if parent is not None and not (parent in held["L1"] or parent in held["L2"]):
                kind = "store"
            else:
                ops.append(("store", node, tier, chain[start:k], parent, now))
                held[tier] |= set(chain[start:k])
                continue
        if kind == "store":
            ops.append(("store", node, tier, chain[:k], None, now))
            held[tier] |= set(chain[:k])
        elif kind == "remove":
            gone = rng.sample(chain[:k], rng.randrange(0, k + 1))
            ops.append(("remove", node, tier, gone))
            held[tier] -= set(gone)
        elif kind == "touch":
            ops.append(("touch", node, chain[:k], now))
        elif kind == "branch":
            ops.append(("branch_set", f"t{node}-{step % 3}", chain[:k]))
        else:
            ops.append(("match", chain[:k]))
    return ops


def _apply(target: Any, op: Op) -> None:
    kind, *args = op
    if kind == "store":
        node, tier, hashes, parent, now = args
        target.store(node, tier, hashes, parent=parent, now=now)
    elif kind == "remove":
        target.remove(*args)
    elif kind == "touch":
        node, hashes, now = args
        target.touch(node, hashes, now=now)
    elif kind == "branch_set":
        target.branch_set(*args)
    elif kind == "match" and isinstance(target, KvDirectory):
        res = read_match(target.match(args[0]))
        nodes, pool, cluster = res
        assert pool <= cluster <= len(args[0])
        assert all(l12 <= cluster for _, l12 in nodes.values())


def _program_runner(
    d: KvDirectory, barrier: threading.Barrier, errors: list[BaseException]
) -> Callable[[list[Op]], None]:
    """A thread body: wait for the others, apply `program` to `d`, keep any error for the main
    thread to re-raise."""

    def run(program: list[Op]) -> None:
        try:
            barrier.wait()
            for op in program:
                _apply(d, op)
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)

    return run


def test_threads_agree_with_sequential_reference() -> None:
    rng = random.Random(20240611)
    universe = _universe(rng)
    n_threads = 4
    programs = [_thread_ops(rng, node, universe, 1500) for node in range(n_threads)]
    d = KvDirectory()
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads + 1)
    done = threading.Event()

    worker = _program_runner(d, barrier, errors)

    def reader() -> None:
        try:
            barrier.wait()
            while not done.is_set():
                stats = d.stats()
                assert stats["locations"] == stats["locations_l1"] + stats["locations_l2"]
                assert stats["placeholders"] <= stats["blocks"]
                for chain in universe[:4]:
                    read_match(d.match(chain))
                d.eviction_order(0, "L1", limit=5)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(p,)) for p in programs]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads[:-1]:
        t.join(timeout=120)
    done.set()
    threads[-1].join(timeout=120)
    assert not any(t.is_alive() for t in threads), "deadlock"
    if errors:
        raise errors[0]

    ref = ReferenceDirectory()
    for program in programs:
        for op in program:
            _apply(ref, op)
    assert semantic_stats(d) == ref.stats()
    assert len(d) == len(ref)
    for chain in universe:
        for k in (1, len(chain) // 2, len(chain)):
            assert read_match(d.match(chain[:k])) == ref.match(chain[:k])
    for node in range(n_threads):
        for tier in ("L1", "L2"):
            assert d.eviction_order(node, tier) == ref.eviction_order(node, tier)
    for h in {h for chain in universe for h in chain}:
        assert d.refcount(h) == ref.refcount(h)
        assert (h in d) == (h in ref)


def test_threads_applying_events_concurrently() -> None:
    """Event ingestion threads for different nodes while another thread matches."""
    rng = random.Random(5)
    universe = _universe(rng)
    d = KvDirectory()
    errors: list[BaseException] = []

    def ingest(node: int) -> None:
        try:
            for i in range(200):
                chain = universe[(node + i) % len(universe)]
                stored = {
                    "type": "BlockStored",
                    "block_hashes": chain,
                    "parent_block_hash": None,
                    "token_ids": [],
                    "block_size": 4,
                    "lora_id": None,
                    "medium": "GPU",
                }
                removed = {
                    "type": "BlockRemoved",
                    "block_hashes": chain[len(chain) // 2 :],
                    "medium": "GPU",
                }
                events: list[dict[str, Any]] = [stored, removed] if i % 2 else [stored]
                assert d.apply_events(node, msgpack.packb([float(i), events, 0])) == len(events)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=ingest, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for chain in universe:
            read_match(d.match(chain))
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    # every node ended on an odd step: the first half of its last chain is held
    for node in range(4):
        chain = universe[(node + 199) % len(universe)]
        res = read_match(d.match(chain))
        assert res[0][node] == (len(chain) // 2, len(chain) // 2)


def test_threads_with_long_calls() -> None:
    """Chains longer than the directory's long-call threshold, so calls release the GIL and
    really run at the same time; every node's calls stay in its own thread (so they commute)."""
    rng = random.Random(11)
    base = [rng.randrange(2**32) for _ in range(6000)]
    other = [rng.randrange(2**32) for _ in range(6000)]
    universe = [
        reference_block_hashes(base[:5000], 1),
        reference_block_hashes(base[:2500] + other[:3000], 1),
        reference_block_hashes(other[3000:], 1),
    ]
    programs: list[list[Op]] = []
    for node in range(4):
        program: list[Op] = []
        for step in range(30):
            chain = universe[(node + step) % 3]
            k = rng.randrange(2100, len(chain) + 1)
            tier = "L1" if step % 2 else "L2"
            kind = step % 5
            if kind in (0, 1):
                program.append(("store", node, tier, chain[:k], None, float(step)))
            elif kind == 2:
                program.append(("remove", node, tier, chain[k // 2 : k]))
            elif kind == 3:
                program.append(("branch_set", f"long{node}", chain[:k]))
            else:
                program.append(("touch", node, chain[:k], float(step)))
            program.append(("match", chain))
        programs.append(program)

    d = KvDirectory()
    errors: list[BaseException] = []
    barrier = threading.Barrier(5)

    worker = _program_runner(d, barrier, errors)

    def ingest() -> None:
        try:
            barrier.wait()
            for i in range(30):
                chain = universe[i % 3]
                event = {
                    "type": "BlockStored",
                    "block_hashes": chain,
                    "parent_block_hash": None,
                    "token_ids": [],
                    "block_size": 1,
                    "lora_id": None,
                    "medium": "CPU_PINNED",
                }
                assert d.apply_events(9, msgpack.packb([float(i), [event], 0])) == 1
                gone = {"type": "BlockRemoved", "block_hashes": chain[100:], "medium": "CPU"}
                assert d.apply_events(9, msgpack.packb([float(i), [gone], 0])) == 1
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(p,)) for p in programs]
    threads.append(threading.Thread(target=ingest))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "deadlock"
    if errors:
        raise errors[0]

    ref = ReferenceDirectory()
    for program in programs:
        for op in program:
            _apply(ref, op)
    for chain in universe:
        ref.store(9, "L2", chain, now=0.0)
        ref.remove(9, "L2", chain[100:])
    assert semantic_stats(d) == ref.stats()
    assert len(d) == len(ref)
    for chain in universe:
        assert read_match(d.match(chain)) == ref.match(chain)
    for node in range(4):
        for place_tier in TIERS:
            assert d.eviction_order(node, place_tier) == ref.eviction_order(node, place_tier)
    assert sorted(d.eviction_order(9, "L2")) == sorted(ref.eviction_order(9, "L2"))
    for chain in universe:
        for h in chain[::97]:
            assert d.refcount(h) == ref.refcount(h)
