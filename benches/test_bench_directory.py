"""pytest-benchmark benchmarks of `KvDirectory`, one operation each, on a cluster-sized directory.

Run: `make bench-py` (= `.venv/bin/pytest benches -m bench --benchmark-only`). Every benchmark is
marked `bench`; `pytest tests` never collects this folder.

The directory is built once per module (a fixture; ≈8 s on one core, most of it generating the
workload in Python): 1,000 nodes, 20,000 sequences of 100 blocks generated as in `workload.py`
(each shares a random 0..99-block prefix with a random earlier sequence, so they form a tree with a
few hundred roots), each stored on a random node as the blocks new to that node (one event in four
in L2, the rest in L1): ≈1.0 M distinct blocks, ≈1.8 M (node, tier, block) locations (≈1.35 M in
L1), plus 2,000 live branches, each on the full context of a random sequence. Because the
sequences descend from few roots, their first blocks are held by nearly every node (like a shared
system prompt): a query that hits matches ≈940 of the 1,000 nodes (recorded in `extra_info`).

What each benchmark models (one call per round, as a user makes it from Python):
- `store`: an engine reports a prefill of 84 new blocks under a 16-block prompt it holds
  (`store(node, "L1", 84 hashes, parent)`); the chain is removed again after the round.
- `remove`: the engine evicts such a chain (stored before the round, untimed).
- `match_hit` / `match_partial` / `match_miss`: the router looks up a 100-block prompt whose
  100 / 50 / 0 leading blocks are cached somewhere (`match(hashes).l12`, the per-node arrays the
  TTFT predictor uses); queries rotate over 1,000 prompts so caches are not artificially warm.
- `branch_set_extend`: an agent branch's context grows by one 16-block turn on top of a
  100-block cached context (the 16 new blocks become placeholders); reset before each round.
- `branch_set_new`: a sub-agent starts with a fresh branch on a 100-block context (ended after).
- `evict`: the eviction planner takes the 32 first blocks in a node's L1 eviction order (the
  evicted blocks are stored back, untimed, before the next round).
- `apply_events_store` / `apply_events_remove`: one SGLang 0.5.23 `KVEventBatch` (msgpack, tagged
  maps, 16-token pages, token ids included) with a `BlockStored` of 84 blocks / a `BlockRemoved`
  of the same 84 blocks, decoded and applied in Rust.
Each benchmark leaves the directory as it found it (setup/teardown of `benchmark.pedantic`), so
they can run in any order on the shared fixture.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass
from typing import Any, Literal, cast

import msgpack
import pytest

from evolving_infra import KvDirectory
from workload import Chain, FreshBlocks, Workload, generate, signed

pytestmark = pytest.mark.bench

N_NODES = 1_000
N_SEQUENCES = 20_000
SEQ_LEN = 100
N_BRANCHES = 2_000
L2_SHARE = 0.25
PAGE_SIZE = 16
PROMPT = 16  # blocks of a shared prompt the new chains hang under
NEW_BLOCKS = 84
ROUNDS = 2_000
EVICT_N = 32
SEED = 20_260_601

Benchmark = Any  # pytest_benchmark's BenchmarkFixture (untyped)


@dataclass
class Env:
    d: KvDirectory
    w: Workload
    parent_of: dict[int, int | None]
    fresh: FreshBlocks
    rng: random.Random
    evict_node: int
    build_s: float

    def new_chain(self, parent: int | None, n: int) -> list[int]:
        """`n` fresh blocks (signed hashes) under `parent` (signed), not yet in the directory."""
        unsigned_parent = None if parent is None else parent % (1 << 64)
        _, hashes = self.fresh.chain(unsigned_parent, n)
        return [signed(h) for h in hashes]


@pytest.fixture(scope="module")
def env() -> Env:
    t0 = time.perf_counter()
    w = generate(
        SEED, n_workers=N_NODES, n_sequences=N_SEQUENCES, seq_len=SEQ_LEN, n_queries=0, n_appends=0
    )
    rng = random.Random(SEED + 1)
    d = KvDirectory()
    parent_of: dict[int, int | None] = {}
    l1_count: dict[int, int] = {}
    for e in w.stores:
        hashes = e.blocks.signed_hashes()
        tier: Literal["L1", "L2"] = "L2" if rng.random() < L2_SHARE else "L1"
        d.store(e.worker, tier, hashes, e.signed_parent)
        p = e.signed_parent
        for h in hashes:
            parent_of[h] = p
            p = h
        if tier == "L1":
            l1_count[e.worker] = l1_count.get(e.worker, 0) + len(hashes)
    for b in range(N_BRANCHES):
        d.branch_set(f"agent-{b}", w.sequences[rng.randrange(N_SEQUENCES)].signed_hashes())
    evict_node = max(l1_count, key=lambda n: l1_count[n])
    return Env(d, w, parent_of, FreshBlocks(rng), rng, evict_node, time.perf_counter() - t0)


def _held_sequences(e: Env) -> list[tuple[int, Chain]]:
    """(node, sequence) pairs where the node holds the whole sequence (in some tier)."""
    return list(zip(e.w.seq_workers, e.w.sequences, strict=True))


def _chain_pool(e: Env, n: int) -> list[tuple[int, int, list[int]]]:
    """`n` (node, parent, fresh 84-block chain) triples: a new turn under a 16-block prompt the
    node holds."""
    pairs = _held_sequences(e)
    out = []
    for node, seq in e.rng.sample(pairs, n):
        parent = signed(seq.hashes[PROMPT - 1])
        out.append((node, parent, e.new_chain(parent, NEW_BLOCKS)))
    return out


def test_stats(env: Env, benchmark: Benchmark) -> None:
    """`stats()`; also records the fixture's size and build time in the benchmark's extra_info."""
    stats = env.d.stats()
    benchmark.extra_info.update(stats)
    benchmark.extra_info["build_s"] = env.build_s
    assert stats["blocks"] >= 900_000
    benchmark.pedantic(env.d.stats, rounds=20)


def _cleanup(d: KvDirectory, chains: list[tuple[int, int, list[int]]]) -> None:
    """Remove the pool's chains (idempotent; covers `--benchmark-disable`, which skips teardown)."""
    for node, _, chain in chains:
        d.remove(node, "L1", chain)


def test_store(env: Env, benchmark: Benchmark) -> None:
    d = env.d
    chains = _chain_pool(env, 64)
    pool = itertools.cycle(chains)

    def setup() -> tuple[tuple[int, str, list[int], int], dict[str, Any]]:
        node, parent, chain = next(pool)
        d.remove(node, "L1", chain)  # no-op unless an earlier (disabled) run left it
        return (node, "L1", chain, parent), {}

    def teardown(node: int, tier: str, chain: list[int], parent: int) -> None:
        d.remove(node, "L1", chain)

    before = len(d)
    benchmark.pedantic(d.store, setup=setup, teardown=teardown, rounds=ROUNDS, warmup_rounds=20)
    _cleanup(d, chains)
    assert len(d) == before


def test_remove(env: Env, benchmark: Benchmark) -> None:
    d = env.d
    pool = itertools.cycle(_chain_pool(env, 64))

    def setup() -> tuple[tuple[int, str, list[int]], dict[str, Any]]:
        node, parent, chain = next(pool)
        d.store(node, "L1", chain, parent)
        return (node, "L1", chain), {}

    def teardown(node: int, tier: str, chain: list[int]) -> None:
        d.remove(node, "L1", chain)  # no-op: already removed

    before = len(d)
    benchmark.pedantic(d.remove, setup=setup, teardown=teardown, rounds=ROUNDS, warmup_rounds=20)
    assert len(d) == before


def _queries(env: Env, held: int) -> list[list[int]]:
    out = []
    for seq in env.rng.sample(env.w.sequences, 1_000):
        prefix = seq.signed_hashes()[:held]
        out.append(prefix + env.new_chain(prefix[-1] if prefix else None, SEQ_LEN - held))
    return out


@pytest.mark.parametrize("held", [SEQ_LEN, SEQ_LEN // 2, 0], ids=["hit", "partial", "miss"])
def test_match(env: Env, benchmark: Benchmark, held: int) -> None:
    d = env.d
    queries = _queries(env, held)
    nxt = itertools.cycle(queries)

    def setup() -> tuple[tuple[list[int]], dict[str, Any]]:
        return (next(nxt),), {}

    def run(q: list[int]) -> object:
        return d.match(q).l12

    benchmark.pedantic(run, setup=setup, rounds=ROUNDS, warmup_rounds=20)
    widths = [len(d.match(q)) for q in queries]
    benchmark.extra_info["nodes_matched_mean"] = sum(widths) / len(widths)
    benchmark.extra_info["nodes_matched_max"] = max(widths)
    m = d.match(queries[0])
    assert int(m.l12.max(initial=0)) == held
    assert m.cluster == held


def test_branch_set_extend(env: Env, benchmark: Benchmark) -> None:
    d = env.d
    base = env.w.sequences[0].signed_hashes()
    extended = base + env.new_chain(base[-1], PAGE_SIZE)

    def setup() -> None:
        d.branch_set("bench-extend", base)

    benchmark.pedantic(
        d.branch_set, args=("bench-extend", extended), setup=setup, rounds=ROUNDS, warmup_rounds=20
    )
    assert d.refcount(extended[-1]) == 1
    assert d.branch_end("bench-extend")
    assert extended[-1] not in d  # the placeholders went with the branch


def test_branch_set_new(env: Env, benchmark: Benchmark) -> None:
    d = env.d
    contexts = itertools.cycle([s.signed_hashes() for s in env.rng.sample(env.w.sequences, 64)])
    used: list[str] = []

    def setup() -> tuple[tuple[str, list[int]], dict[str, Any]]:
        used.append(f"bench-new-{len(used)}")
        return (used[-1], next(contexts)), {}

    def teardown(branch: str, context: list[int]) -> None:
        d.branch_end(branch)

    branches = d.stats()["branches"]
    benchmark.pedantic(
        d.branch_set, setup=setup, teardown=teardown, rounds=ROUNDS, warmup_rounds=20
    )
    for name in used:
        d.branch_end(name)
    assert d.stats()["branches"] == branches


def test_evict(env: Env, benchmark: Benchmark) -> None:
    d = env.d
    node = env.evict_node
    last: list[list[int]] = [[]]

    def restore() -> None:
        # Evicted blocks come out leaf first: store them back parent first.
        for h in reversed(last[0]):
            d.store(node, "L1", [h], env.parent_of[h])
        last[0] = []

    def evict() -> None:
        last[0] = d.evict(node, "L1", EVICT_N)

    locations = d.stats()["locations_l1"]
    benchmark.pedantic(evict, setup=restore, rounds=ROUNDS, warmup_rounds=20)
    assert len(last[0]) == EVICT_N
    restore()
    assert d.stats()["locations_l1"] == locations


def _sglang_batch(events: list[dict[str, Any]]) -> bytes:
    """An SGLang 0.5.23 `KVEventBatch`: [ts, events (tagged maps), attn_dp_rank]."""
    return cast(bytes, msgpack.packb([time.time(), events, 0]))


def _stored_event(chain: list[int], parent: int, rng: random.Random) -> dict[str, Any]:
    tokens = [rng.randrange(150_000) for _ in range(len(chain) * PAGE_SIZE)]
    return {
        "type": "BlockStored",
        "block_hashes": chain,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": PAGE_SIZE,
        "lora_id": None,
        "medium": "GPU",
    }


def _removed_event(chain: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": chain, "medium": "GPU"}


def test_apply_events_store(env: Env, benchmark: Benchmark) -> None:
    d = env.d
    chains = _chain_pool(env, 64)
    pool = itertools.cycle(
        [
            (node, chain, _sglang_batch([_stored_event(chain, parent, env.rng)]))
            for node, parent, chain in chains
        ]
    )

    def setup() -> tuple[tuple[int, bytes], dict[str, Any]]:
        node, chain, payload = next(pool)
        d.remove(node, "L1", chain)
        current[0] = (node, chain)
        return (node, payload), {}

    def teardown(node: int, payload: bytes) -> None:
        d.remove(node, "L1", current[0][1])

    current: list[tuple[int, list[int]]] = [(0, [])]
    before = len(d)
    benchmark.pedantic(
        d.apply_events, setup=setup, teardown=teardown, rounds=ROUNDS, warmup_rounds=20
    )
    _cleanup(d, chains)
    assert len(d) == before


def test_apply_events_remove(env: Env, benchmark: Benchmark) -> None:
    d = env.d
    pool = itertools.cycle(
        [
            (node, parent, chain, _sglang_batch([_removed_event(chain)]))
            for node, parent, chain in _chain_pool(env, 64)
        ]
    )

    def setup() -> tuple[tuple[int, bytes], dict[str, Any]]:
        node, parent, chain, payload = next(pool)
        d.store(node, "L1", chain, parent)
        return (node, payload), {}

    before = len(d)
    benchmark.pedantic(d.apply_events, setup=setup, rounds=ROUNDS, warmup_rounds=20)
    assert len(d) == before
