"""SGLang wire compatibility: golden hashes and event bytes from real SGLang, hand-built events.

The golden files (tests/data/sglang, see its README) were captured from SGLang's own `RadixCache`.
The expected directory state after each event batch is computed independently of the events, from
the recorded cache operations: `RadixCacheModel` below replays them the way SGLang's paged radix
cache does (a page-granular radix tree, LRU leaf eviction), and the page hashes come from the
reference implementation of the hash formula, itself checked against SGLang's hash vectors.
"""

from __future__ import annotations

import base64
import heapq
import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from directory_helpers import read_match, semantic_stats, snapshot
from evolving_infra import (
    EventDecodeError,
    InvalidArgumentError,
    KvDirectory,
    KvDirectoryError,
    block_hashes,
)
from reference_directory import reference_block_hashes, reference_page_digests

DATA = Path(__file__).parent / "data" / "sglang"
GOLDEN: dict[str, Any] = json.loads((DATA / "radix_events.json").read_text())
POSITIONAL: dict[str, Any] = json.loads((DATA / "radix_events_positional.json").read_text())
PAGE_SIZE: int = GOLDEN["page_size"]
OPS: list[dict[str, Any]] = GOLDEN["ops"]
MAP_BATCHES = [base64.b64decode(b) for b in GOLDEN["event_batches_msgpack_b64"]]
POSITIONAL_BATCHES = [base64.b64decode(b) for b in POSITIONAL["event_batches_msgpack_b64"]]
ENCODINGS = {"map": MAP_BATCHES, "positional": POSITIONAL_BATCHES}
INSERTED = [op["tokens"] for op in OPS if op["op"] == "insert"]
INSERTED_CHAINS = [reference_block_hashes(tokens, PAGE_SIZE) for tokens in INSERTED]
EVERY_HASH = sorted({h for chain in INSERTED_CHAINS for h in chain})

MIN = -(2**63)

# ------------------------------------------------------------------------------------------------
# an independent model of SGLang's RadixCache

Page = tuple[int, ...]


@dataclass(eq=False)
class _RadixNode:
    pages: list[Page]
    parent: _RadixNode | None
    last_access: int
    children: dict[Page, _RadixNode] = field(default_factory=dict)


class RadixCacheModel:
    """SGLang's paged `RadixCache` reduced to what decides which pages it holds.

    As in SGLang: `insert` walks the tree refreshing each visited node's access time, splits a node
    where the new key diverges inside it (the split-off upper part is a new node) and hangs the
    rest of the key under it as a new leaf; `evict(num_tokens)` frees least recently used leaves
    (a parent left childless joins the candidates) until at least `num_tokens` are freed. SGLang
    stamps nodes with `time.monotonic()`; a counter gives the same order without ties.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.clock = itertools.count(1)
        self.root = _RadixNode([], None, 0)

    def _pages(self, tokens: list[int]) -> list[Page]:
        assert len(tokens) % self.page_size == 0, "the golden inserts are page-aligned"
        size = self.page_size
        return [tuple(tokens[i : i + size]) for i in range(0, len(tokens), size)]

    def insert(self, tokens: list[int]) -> None:
        pages = self._pages(tokens)
        node = self.root
        node.last_access = next(self.clock)
        i = 0
        while i < len(pages) and pages[i] in node.children:
            child = node.children[pages[i]]
            child.last_access = next(self.clock)
            k = 0
            while k < len(child.pages) and i + k < len(pages) and child.pages[k] == pages[i + k]:
                k += 1
            if k < len(child.pages):
                upper = _RadixNode(child.pages[:k], node, next(self.clock))
                upper.children[child.pages[k]] = child
                node.children[pages[i]] = upper
                child.pages = child.pages[k:]
                child.parent = upper
                child = upper
            node = child
            i += k
        if i < len(pages):
            node.children[pages[i]] = _RadixNode(pages[i:], node, next(self.clock))

    def evict(self, num_tokens: int) -> None:
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            evicted += len(leaf.pages) * self.page_size
            del parent.children[leaf.pages[0]]
            if not parent.children and parent is not self.root:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def reset(self) -> None:
        self.root = _RadixNode([], None, next(self.clock))

    def _nodes(self) -> Iterator[_RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _leaves(self) -> list[_RadixNode]:
        return [node for node in self._nodes() if not node.children]

    def _tokens(self, node: _RadixNode) -> list[int]:
        parts: list[Page] = []
        current: _RadixNode | None = node
        while current is not None:
            parts[:0] = current.pages
            current = current.parent
        return [t for page in parts for t in page]

    def held(self) -> set[int]:
        """Page hashes of every page the cache holds."""
        out: set[int] = set()
        for node in self._nodes():
            out |= set(reference_block_hashes(self._tokens(node), self.page_size))
        return out

    def leaf_pages(self) -> set[int]:
        """Hash of the last page of each leaf: the pages with no child held."""
        return {reference_block_hashes(self._tokens(n), self.page_size)[-1] for n in self._leaves()}


def model_after_each_op() -> list[tuple[set[int], set[int]]]:
    """(held pages, leaf pages) after each recorded op."""
    model = RadixCacheModel(PAGE_SIZE)
    states = []
    for op in OPS:
        if op["op"] == "insert":
            model.insert(op["tokens"])
        elif op["op"] == "evict":
            model.evict(op["num_tokens"])
        else:
            assert op["op"] == "reset", op
            model.reset()
        states.append((model.held(), model.leaf_pages()))
    return states


EXPECTED = model_after_each_op()


def leading(chain: list[int], held: set[int]) -> int:
    count = 0
    for h in chain:
        if h not in held:
            break
        count += 1
    return count


def depth_of(h: int) -> int:
    for chain in INSERTED_CHAINS:
        if h in chain:
            return chain.index(h)
    raise AssertionError(h)


# ------------------------------------------------------------------------------------------------
# hashes


def test_golden_files_line_up() -> None:
    assert GOLDEN["sglang_version"] == "0.5.23"
    assert POSITIONAL["sglang_version"] == "0.5.4"
    assert POSITIONAL["ops"] == OPS
    assert len(MAP_BATCHES) == len(POSITIONAL_BATCHES) == len(OPS)
    assert {op["op"] for op in OPS} == {"insert", "evict", "reset"}


@pytest.mark.parametrize(
    "vector", GOLDEN["hash_vectors"], ids=lambda v: f"page{v['page_size']}-{len(v['token_ids'])}"
)
def test_block_hashes_match_sglang(vector: dict[str, Any]) -> None:
    tokens, page_size = vector["token_ids"], vector["page_size"]
    assert block_hashes(tokens, page_size) == vector["block_hashes_int64"]
    # the test's own reference of the formula agrees, digest by digest
    assert reference_page_digests(tokens, page_size) == vector["page_hashes_hex"]
    assert reference_block_hashes(tokens, page_size) == vector["block_hashes_int64"]
    # a partial trailing page has no hash
    if len(tokens) % page_size == 0 and page_size > 1:
        assert block_hashes(tokens[:-1], page_size) == vector["block_hashes_int64"][:-1]


def test_hash_vectors_cover_every_page_size() -> None:
    assert {v["page_size"] for v in GOLDEN["hash_vectors"]} == {1, 4, 16, 32, 64}


def test_golden_stored_hashes_are_page_hashes() -> None:
    """Every hash SGLang put in a BlockStored is a page hash of some inserted sequence."""
    for payload in MAP_BATCHES:
        for event in msgpack.unpackb(payload)[1]:
            if event["type"] == "BlockStored":
                assert set(event["block_hashes"]) <= set(EVERY_HASH)


# ------------------------------------------------------------------------------------------------
# replaying the golden batches


def check_against_model(d: KvDirectory, held: set[int], leaves: set[int]) -> None:
    n = len(held)
    assert semantic_stats(d) == {
        "blocks": n,
        "placeholders": 0,
        "locations": n,
        "locations_l1": n,
        "locations_l2": 0,
        "nodes": 1 if n else 0,
        "branches": 0,
        "candidates": len(leaves),
    }
    assert len(d) == n
    for chain in INSERTED_CHAINS:
        k = leading(chain, held)
        assert read_match(d.match(chain)) == ({0: (k, k)} if k else {}, 0, k)
    for h in EVERY_HASH:
        assert (h in d) == (h in held)
    assert set(d.eviction_order(0, "L1")) == leaves
    assert d.eviction_order(0, "L2") == []


@pytest.mark.parametrize("encoding", ["map", "positional"])
def test_replay_leaves_the_state_the_ops_imply(encoding: str) -> None:
    d = KvDirectory()
    stored_in: dict[int, int] = {}
    for i, payload in enumerate(ENCODINGS[encoding]):
        assert d.apply_events(0, payload) == 1
        held, leaves = EXPECTED[i]
        check_against_model(d, held, leaves)
        # last-access time is the time of the batch that stored the block: earlier batches first,
        # then (same batch, same time) deeper blocks first, then the smaller hash
        for h in held - set(stored_in):
            stored_in[h] = i
        stored_in = {h: b for h, b in stored_in.items() if h in held}
        order = d.eviction_order(0, "L1")
        assert order == sorted(leaves, key=lambda h: (stored_in[h], -depth_of(h), h))
    assert len(d) == 0


@pytest.mark.parametrize("encoding", ["map", "positional"])
def test_replay_with_explicit_now(encoding: str) -> None:
    """`apply_events(node, payload, now)` as docs/kv-directory.md gives it (the stub omits `now`).

    Times run backwards here, so the eviction order can only come from `now`, not from a clock.
    """
    d: Any = KvDirectory()
    stored_in: dict[int, int] = {}
    for i, payload in enumerate(ENCODINGS[encoding]):
        assert d.apply_events(0, payload, now=100.0 - i) == 1
        held, leaves = EXPECTED[i]
        check_against_model(d, held, leaves)
        for h in held - set(stored_in):
            stored_in[h] = i
        stored_in = {h: b for h, b in stored_in.items() if h in held}
        order = d.eviction_order(0, "L1")
        assert order == sorted(leaves, key=lambda h: (-stored_in[h], -depth_of(h), h))
        if i == 8:
            before = snapshot(d, INSERTED_CHAINS, EVERY_HASH, [0])
            for bad in (math.nan, math.inf, -math.inf):
                with pytest.raises(InvalidArgumentError) as info:
                    d.apply_events(0, ENCODINGS[encoding][i + 1], now=bad)
                assert info.value.argument == "now"
            assert snapshot(d, INSERTED_CHAINS, EVERY_HASH, [0]) == before


def test_both_encodings_give_identical_states() -> None:
    by_map, by_positional = KvDirectory(), KvDirectory()
    for map_payload, positional_payload in zip(MAP_BATCHES, POSITIONAL_BATCHES, strict=True):
        assert by_map.apply_events(0, map_payload) == by_positional.apply_events(
            0, positional_payload
        )
        assert snapshot(by_map, INSERTED_CHAINS, EVERY_HASH, [0]) == snapshot(
            by_positional, INSERTED_CHAINS, EVERY_HASH, [0]
        )


def test_replay_on_another_node_leaves_node_zero_alone() -> None:
    d = KvDirectory()
    for payload in MAP_BATCHES[:6]:
        d.apply_events(0, payload)
    for payload in POSITIONAL_BATCHES:
        d.apply_events(3, payload)
    held, leaves = EXPECTED[5]
    check_against_model(d, held, leaves)


# ------------------------------------------------------------------------------------------------
# corrupt bytes: an error, and nothing changed


def replayed(encoding: str, upto: int) -> KvDirectory:
    d = KvDirectory()
    for payload in ENCODINGS[encoding][:upto]:
        d.apply_events(0, payload)
    return d


def quick_state(d: KvDirectory) -> tuple[Any, ...]:
    return (semantic_stats(d), len(d), d.eviction_order(0, "L1"), d.eviction_order(0, "L2"))


@pytest.mark.parametrize("encoding", ["map", "positional"])
def test_truncated_batches_raise_and_change_nothing(encoding: str) -> None:
    d = KvDirectory()
    for payload in ENCODINGS[encoding]:
        before = snapshot(d, INSERTED_CHAINS, EVERY_HASH, [0])
        quick = quick_state(d)
        for cut in range(len(payload)):
            with pytest.raises(EventDecodeError) as info:
                d.apply_events(0, payload[:cut])
            assert isinstance(info.value.offset, int)
            assert 0 <= info.value.offset <= cut
            assert quick_state(d) == quick
        assert snapshot(d, INSERTED_CHAINS, EVERY_HASH, [0]) == before
        d.apply_events(0, payload)


@pytest.mark.parametrize("encoding", ["map", "positional"])
def test_flipped_bytes_raise_or_apply_but_never_half_apply(encoding: str) -> None:
    for i, payload in enumerate(ENCODINGS[encoding]):
        d = replayed(encoding, i)
        for position in range(len(payload)):
            for mask in (0xFF, 0x01, 0x80):
                corrupt = bytearray(payload)
                corrupt[position] ^= mask
                quick = quick_state(d)
                try:
                    applied = d.apply_events(0, bytes(corrupt))
                except KvDirectoryError:
                    assert quick_state(d) == quick
                    continue
                assert applied in (0, 1)
                stats = d.stats()
                assert stats["locations"] == stats["locations_l1"] + stats["locations_l2"]
                d = replayed(encoding, i)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU_PINNED"]),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(
            st.sampled_from(
                ["type", "block_hashes", "parent_block_hash", "medium", "token_ids", "x"]
            ),
            children,
            max_size=5,
        )
    ),
    max_leaves=20,
)


def fuzz_state() -> KvDirectory:
    d = replayed("map", 3)
    d.store(1, "L2", [1, 2, 3], now=0.0)
    d.branch_set("b", [1, 2, 7])
    return d


def _apply_fuzz(payload: bytes) -> None:
    d = fuzz_state()
    before = snapshot(d, [*INSERTED_CHAINS, [1, 2, 3, 7]], [1, 2, 3, 7], [0, 1])
    error: KvDirectoryError | None = None
    try:
        d.apply_events(0, payload)
    except KvDirectoryError as e:
        error = e
    if isinstance(error, EventDecodeError):
        assert 0 <= error.offset <= len(payload)
    if error is not None:
        assert snapshot(d, [*INSERTED_CHAINS, [1, 2, 3, 7]], [1, 2, 3, 7], [0, 1]) == before


FUZZ_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@FUZZ_SETTINGS
@given(st.binary(max_size=300))
def test_random_bytes(payload: bytes) -> None:
    _apply_fuzz(payload)


@FUZZ_SETTINGS
@given(st.sampled_from(MAP_BATCHES + POSITIONAL_BATCHES), st.data())
def test_golden_prefix_with_random_tail(payload: bytes, data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(payload)))
    _apply_fuzz(payload[:cut] + data.draw(st.binary(max_size=40)))


@FUZZ_SETTINGS
@given(st.floats() | st.integers(0, 10), st.lists(msgpack_values, max_size=4), msgpack_values)
def test_random_msgpack_batches(ts: float, events: list[Any], dp_rank: Any) -> None:
    _apply_fuzz(msgpack.packb([ts, events, dp_rank]))


@FUZZ_SETTINGS
@given(msgpack_values)
def test_random_msgpack_values(value: Any) -> None:
    _apply_fuzz(msgpack.packb(value))
