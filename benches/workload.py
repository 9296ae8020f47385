"""Seeded generator of the shared KV-directory workload (notes `dynamo-kv-router.md` §4.1).

Shape (defaults): 64 workers; 2,000 sequences of 100 blocks; sequence i > 0 shares a uniform-random
0..99-block prefix with a uniform-random earlier sequence and runs on a uniform-random worker. Each
sequence gives one *store* event holding only the blocks new to its worker (≈167k blocks, ≈84 per
event). Then 10,000 *queries* (a uniform-random 0..100-block prefix of a random sequence, padded to
100 blocks with fresh blocks), 20,000 single-block *appends* (a fresh block at the tail of a random
sequence, on that sequence's worker) and a *removal* of everything, leaf first: one remove event per
store/append event, in reverse order, each listing its blocks last to first (so the index ends
empty, and Dynamo's prefix-closed removal and our per-block removal mean the same thing).

Block identity, shared by both systems:
- a block's *content id* (`tokens`, unsigned 64-bit) stands for the hash of its tokens: Dynamo's
  `LocalBlockHash` (`tokens_hash`), which is what `RadixTree.find_matches` walks;
- its *sequence hash* (`hashes`, unsigned 64-bit) is a rolling hash of the parent's sequence hash
  and the content id (the first 8 bytes of BLAKE2b), like SGLang's page hash: Dynamo's
  `ExternalSequenceBlockHash` (`block_hash`); our directory takes its signed view (`signed`), so
  both systems see the same blocks and `find_matches(tokens)` scores equal `match(hashes).l12`.

Everything is drawn from one `random.Random(seed)`; the same seed gives the same workload.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field

U64 = 1 << 64
I64_MAX = (1 << 63) - 1


def signed(h: int) -> int:
    """Signed 64-bit view of an unsigned 64-bit hash (our directory's block id)."""
    return h - U64 if h > I64_MAX else h


def chain_hash(parent: int | None, content: int) -> int:
    """Sequence hash (unsigned 64-bit) of a block with content id `content` under `parent`."""
    data = (parent or 0).to_bytes(8, "little") + content.to_bytes(8, "little")
    if parent is None:
        data = b"\x00" + data
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class Chain:
    """A run of consecutive blocks of one sequence: content ids and sequence hashes (unsigned)."""

    tokens: list[int]
    hashes: list[int]

    def __len__(self) -> int:
        return len(self.hashes)

    def signed_hashes(self) -> list[int]:
        """The sequence hashes as our directory takes them."""
        return [signed(h) for h in self.hashes]


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """`worker` now holds `blocks`, the first of which has parent `parent` (unsigned) or none."""

    worker: int
    parent: int | None
    blocks: Chain

    @property
    def signed_parent(self) -> int | None:
        return None if self.parent is None else signed(self.parent)


@dataclass(frozen=True, slots=True)
class RemoveEvent:
    """`worker` no longer holds `hashes` (unsigned sequence hashes, listed leaf first)."""

    worker: int
    hashes: list[int]


@dataclass(slots=True)
class Workload:
    """The generated workload; see the module docstring for its shape."""

    seed: int
    n_workers: int
    seq_len: int
    sequences: list[Chain]
    seq_workers: list[int]
    stores: list[StoreEvent]
    queries: list[Chain]
    appends: list[StoreEvent]
    removals: list[RemoveEvent]
    #: worker -> sequence hashes it holds after all stores and appends (for reference checks)
    held: dict[int, set[int]] = field(default_factory=dict)

    @property
    def stored_blocks(self) -> int:
        return sum(len(e.blocks) for e in self.stores)

    @property
    def unique_blocks(self) -> int:
        return len({h for s in self.sequences for h in s.hashes})


class FreshBlocks:
    """Fresh content ids (unique within one workload)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._seen: set[int] = set()

    def __call__(self) -> int:
        while True:
            c = self._rng.getrandbits(64)
            if c not in self._seen:
                self._seen.add(c)
                return c

    def chain(self, parent: int | None, n: int) -> tuple[list[int], list[int]]:
        """`n` fresh blocks under `parent`: (content ids, sequence hashes)."""
        tokens: list[int] = []
        hashes: list[int] = []
        for _ in range(n):
            c = self()
            parent = chain_hash(parent, c)
            tokens.append(c)
            hashes.append(parent)
        return tokens, hashes


def generate(
    seed: int = 1234,
    *,
    n_workers: int = 64,
    n_sequences: int = 2_000,
    seq_len: int = 100,
    n_queries: int = 10_000,
    n_appends: int = 20_000,
    share: tuple[float, float] = (0.0, 1.0),
) -> Workload:
    """Generate the workload (see the module docstring). Sizes default to notes §4.1."""
    rng = random.Random(seed)
    fresh = FreshBlocks(rng)
    sequences: list[Chain] = []
    seq_workers: list[int] = []
    stores: list[StoreEvent] = []
    held: dict[int, set[int]] = {}
    for i in range(n_sequences):
        if i == 0:
            shared = 0
            base: Chain | None = None
        else:
            base = sequences[rng.randrange(i)]
            lo = int(share[0] * seq_len)
            shared = rng.randint(lo, max(lo, int(share[1] * seq_len) - 1))
        worker = rng.randrange(n_workers)
        tokens = list(base.tokens[:shared]) if base is not None else []
        hashes = list(base.hashes[:shared]) if base is not None else []
        new_t, new_h = fresh.chain(hashes[-1] if hashes else None, seq_len - shared)
        seq = Chain(tokens + new_t, hashes + new_h)
        sequences.append(seq)
        seq_workers.append(worker)
        # Blocks new to the worker: what it holds is prefix-closed, so they are a suffix.
        mine = held.setdefault(worker, set())
        k = 0
        while k < seq_len and seq.hashes[k] in mine:
            k += 1
        parent = seq.hashes[k - 1] if k > 0 else None
        stores.append(StoreEvent(worker, parent, Chain(seq.tokens[k:], seq.hashes[k:])))
        mine.update(seq.hashes[k:])

    queries: list[Chain] = []
    for _ in range(n_queries):
        seq = sequences[rng.randrange(n_sequences)]
        p = rng.randint(0, seq_len)
        q_t, q_h = fresh.chain(seq.hashes[p - 1] if p > 0 else None, seq_len - p)
        queries.append(Chain(seq.tokens[:p] + q_t, seq.hashes[:p] + q_h))

    appends: list[StoreEvent] = []
    tails = [s.hashes[-1] for s in sequences]
    for _ in range(n_appends):
        i = rng.randrange(n_sequences)
        t, h = fresh.chain(tails[i], 1)
        appends.append(StoreEvent(seq_workers[i], tails[i], Chain(t, h)))
        held[seq_workers[i]].add(h[0])
        tails[i] = h[0]

    removals = [RemoveEvent(e.worker, e.blocks.hashes[::-1]) for e in reversed(stores + appends)]
    return Workload(
        seed=seed,
        n_workers=n_workers,
        seq_len=seq_len,
        sequences=sequences,
        seq_workers=seq_workers,
        stores=stores,
        queries=queries,
        appends=appends,
        removals=removals,
        held=held,
    )


# --- Dynamo encoding (JSON `KvCacheEvent`, notes §3.2) -----------------------------------------


def dynamo_store_json(event_id: int, e: StoreEvent) -> bytes:
    """A `stored` event for `RadixTree.apply_event(e.worker, ...)`."""
    blocks = [
        {"block_hash": h, "tokens_hash": t}
        for h, t in zip(e.blocks.hashes, e.blocks.tokens, strict=True)
    ]
    doc = {"event_id": event_id, "data": {"stored": {"parent_hash": e.parent, "blocks": blocks}}}
    return json.dumps(doc, separators=(",", ":")).encode()


def dynamo_remove_json(event_id: int, e: RemoveEvent) -> bytes:
    """A `removed` event for `RadixTree.apply_event(e.worker, ...)`."""
    doc = {"event_id": event_id, "data": {"removed": {"block_hashes": e.hashes}}}
    return json.dumps(doc, separators=(",", ":")).encode()


def reference_match(w: Workload, query: Chain) -> dict[int, int]:
    """Per-worker leading blocks of `query` held, from the generator's own bookkeeping.

    Valid once every store has been applied (queries never contain appended blocks: they are fresh).
    """
    out: dict[int, int] = {}
    for worker, mine in w.held.items():
        k = 0
        for h in query.hashes:
            if h not in mine:
                break
            k += 1
        if k:
            out[worker] = k
    return out
