"""SGLang KV events built by hand in both encodings (tagged maps, positional arrays): media,
unsigned hashes, unknown fields, undecodable events, whole-batch validation, and the equivalence of
events and direct calls (docs/kv-directory.md, "SGLang events").
"""

from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from directory_helpers import TIERS, Tier, read_match, semantic_stats, snapshot
from evolving_infra import (
    DuplicateHashError,
    EventDecodeError,
    InvalidArgumentError,
    KvDirectory,
    ParentMismatchError,
    UnknownParentError,
)
from reference_directory import reference_block_hashes
from test_golden_sglang import (
    INSERTED_CHAINS,
    MAP_BATCHES,
    fuzz_state,
)

MIN = -(2**63)

# ------------------------------------------------------------------------------------------------
# hand-built events in both encodings

TOKENS = [1, 2, 3, 4]
_ABSENT = object()


def batch(*events: Any, ts: float = 1.0, dp_rank: int | None = 0) -> bytes:
    payload = msgpack.packb([ts, list(events), dp_rank])
    assert isinstance(payload, bytes)
    return payload


def stored(
    encoding: str, hashes: list[int], parent: int | None = None, medium: object = _ABSENT
) -> Any:
    """A BlockStored event as SGLang ≥ 0.5.20 (map) or ≤ 0.5.16 (positional) encodes it."""
    if encoding == "map":
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": TOKENS * len(hashes),
            "block_size": 4,
            "lora_id": None,
        }
        if medium is not _ABSENT:
            event["medium"] = medium
        return event
    fields: list[Any] = ["BlockStored", hashes, parent, TOKENS * len(hashes), 4, None]
    return fields if medium is _ABSENT else [*fields, medium]


def removed(encoding: str, hashes: list[int], medium: object = _ABSENT) -> Any:
    if encoding == "map":
        event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes}
        if medium is not _ABSENT:
            event["medium"] = medium
        return event
    return ["BlockRemoved", hashes] if medium is _ABSENT else ["BlockRemoved", hashes, medium]


def cleared(encoding: str) -> Any:
    return {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]


encodings = pytest.mark.parametrize("encoding", ["map", "positional"])


@encodings
@pytest.mark.parametrize(
    ("medium", "tier"),
    [(_ABSENT, "L1"), (None, "L1"), ("GPU", "L1"), ("CPU", "L2"), ("CPU_PINNED", "L2")],
    ids=["absent", "none", "GPU", "CPU", "CPU_PINNED"],
)
def test_medium_selects_the_tier(encoding: str, medium: object, tier: str) -> None:
    d = KvDirectory()
    assert d.apply_events(4, batch(stored(encoding, [10, 11], None, medium))) == 1
    if tier == "L1":
        assert read_match(d.match([10, 11])) == ({4: (2, 2)}, 0, 2)
        assert d.eviction_order(4, "L1") == [11]
    else:
        assert read_match(d.match([10, 11])) == ({4: (0, 2)}, 2, 2)
        assert d.eviction_order(4, "L2") == [11]
    assert d.apply_events(4, batch(removed(encoding, [11, 10], medium))) == 1
    assert len(d) == 0


@encodings
@pytest.mark.parametrize("medium", ["DISK", "EXTERNAL", "gpu", "NVME", ""])
def test_other_media_are_skipped(encoding: str, medium: str) -> None:
    d = KvDirectory()
    d.store(0, "L1", [10, 11], now=0.0)
    d.store(0, "L2", [10, 11], now=0.0)
    before = snapshot(d, [[10, 11, 12]], [10, 11, 12], [0])
    events = [stored(encoding, [12], 11, medium), removed(encoding, [11, 10], medium)]
    assert d.apply_events(0, batch(*events)) == 0
    assert snapshot(d, [[10, 11, 12]], [10, 11, 12], [0]) == before


@encodings
def test_skipped_event_is_not_validated(encoding: str) -> None:
    d = KvDirectory()
    assert d.apply_events(0, batch(stored(encoding, [12], 999, "DISK"))) == 0
    assert d.apply_events(0, batch(stored(encoding, [5, 5], None, "EXTERNAL"))) == 0
    assert len(d) == 0


@encodings
def test_removed_medium_selects_the_tier(encoding: str) -> None:
    d = KvDirectory()
    d.store(0, "L1", [10, 11], now=0.0)
    d.store(0, "L2", [10, 11], now=0.0)
    assert d.apply_events(0, batch(removed(encoding, [11], "CPU_PINNED"))) == 1
    assert read_match(d.match([10, 11])) == ({0: (2, 2)}, 1, 2)
    assert d.apply_events(0, batch(removed(encoding, [11]))) == 1
    assert read_match(d.match([10, 11])) == ({0: (1, 1)}, 1, 1)
    assert 11 not in d
    assert d.apply_events(0, batch(removed(encoding, [10], "GPU"))) == 1
    assert read_match(d.match([10])) == ({0: (0, 1)}, 1, 1)
    assert d.apply_events(0, batch(removed(encoding, [10], "CPU"))) == 1
    assert len(d) == 0


@encodings
def test_unsigned_hashes_read_as_signed(encoding: str) -> None:
    d = KvDirectory()
    # msgpack encodes these as uint64; the directory reads their two's-complement value
    assert d.apply_events(0, batch(stored(encoding, [2**64 - 1, 2**63]))) == 1
    assert d.apply_events(0, batch(stored(encoding, [2**63 + 5], 2**63))) == 1
    assert [h in d for h in (-1, MIN, MIN + 5)] == [True, True, True]
    assert read_match(d.match([-1, MIN, MIN + 5])) == ({0: (3, 3)}, 0, 3)
    # the signed encoding names the same blocks
    assert d.apply_events(0, batch(removed(encoding, [MIN + 5, MIN]))) == 1
    assert d.apply_events(0, batch(stored(encoding, [7], -1))) == 1
    assert read_match(d.match([-1, 7])) == ({0: (2, 2)}, 0, 2)
    assert len(d) == 2


def test_unknown_keys_and_key_order_in_maps() -> None:
    d = KvDirectory()
    event = {
        "cache_salt": "salt",
        "block_hashes": [10, 11],
        "extra": {"nested": [1, 2.5, b"raw", None], "more": True},
        "token_ids": TOKENS * 2,
        "medium": "CPU_PINNED",
        "session_id": None,
        "parent_block_hash": None,
        "lora_name": "adapter",
        "block_size": 4,
        "lora_id": 3,
        "type": "BlockStored",
    }
    assert d.apply_events(0, batch(event, {"type": "AllBlocksCleared", "why": "test"})) == 2
    assert len(d) == 0
    assert d.apply_events(0, batch(event)) == 1
    assert read_match(d.match([10, 11])) == ({0: (0, 2)}, 2, 2)
    assert (
        d.apply_events(
            0, batch({"medium": "CPU", "block_hashes": [11], "type": "BlockRemoved", "x": 1})
        )
        == 1
    )
    assert read_match(d.match([10, 11])) == ({0: (0, 1)}, 1, 1)


def test_trailing_positional_fields_ignored() -> None:
    d = KvDirectory()
    event = [
        "BlockStored",
        [10, 11],
        None,
        TOKENS * 2,
        4,
        None,
        "CPU_PINNED",
        "salt",
        None,
        "x",
        42,
    ]
    assert d.apply_events(0, batch(event)) == 1
    assert read_match(d.match([10, 11])) == ({0: (0, 2)}, 2, 2)
    assert d.apply_events(0, batch(["BlockRemoved", [11], "CPU_PINNED", "extra", {"k": 1}])) == 1
    assert d.apply_events(0, batch(["AllBlocksCleared", "extra"])) == 1
    assert len(d) == 0


@encodings
def test_all_blocks_cleared_clears_the_node(encoding: str) -> None:
    d = KvDirectory()
    d.store(0, "L1", [10, 11], now=0.0)
    d.store(0, "L2", [10, 11, 12], now=0.0)
    d.store(1, "L1", [10], now=0.0)
    assert d.apply_events(0, batch(cleared(encoding))) == 1
    assert read_match(d.match([10, 11, 12])) == ({1: (1, 1)}, 0, 1)
    assert [h in d for h in (10, 11, 12)] == [True, False, False]
    assert d.eviction_order(0, "L1") == []
    assert d.eviction_order(0, "L2") == []


@encodings
def test_event_count_and_empty_batches(encoding: str) -> None:
    d = KvDirectory()
    assert d.apply_events(0, batch()) == 0
    assert d.apply_events(0, batch(ts=0.0, dp_rank=None)) == 0
    events = [
        stored(encoding, [10, 11]),
        stored(encoding, [20], None, "DISK"),
        stored(encoding, [12], 11, "CPU_PINNED"),
        removed(encoding, [10], "EXTERNAL"),
    ]
    assert d.apply_events(0, batch(*events, dp_rank=None)) == 2
    assert read_match(d.match([10, 11, 12])) == ({0: (2, 3)}, 0, 3)


@encodings
def test_batch_is_validated_as_a_whole(encoding: str) -> None:
    d = KvDirectory()
    # the second event's parent is stored by the first
    events = [stored(encoding, [10, 11]), stored(encoding, [12], 11, "CPU")]
    assert d.apply_events(0, batch(*events)) == 2
    assert read_match(d.match([10, 11, 12])) == ({0: (2, 3)}, 0, 3)


@encodings
def test_garbage_is_dropped_when_the_batch_ends(encoding: str) -> None:
    d = KvDirectory()
    d.store(0, "L1", [10, 11], now=0.0)
    # 11 would be garbage after the removal, but the batch stores a child under it
    assert d.apply_events(0, batch(removed(encoding, [11]), stored(encoding, [12], 11))) == 2
    assert [h in d for h in (10, 11, 12)] == [True, True, True]
    assert read_match(d.match([10, 11, 12])) == ({0: (1, 1)}, 0, 1)
    assert d.stats()["placeholders"] == 1
    # a clear followed by a store under a block the clear released
    assert d.apply_events(0, batch(cleared(encoding), stored(encoding, [13], 10))) == 2
    assert [h in d for h in (10, 11, 12, 13)] == [True, False, False, True]
    assert read_match(d.match([10, 13])) == ({}, 0, 0)
    assert d.eviction_order(0, "L1") == [13]
    # and garbage does go once the batch is over
    assert d.apply_events(0, batch(removed(encoding, [13]))) == 1
    assert len(d) == 0


@encodings
@pytest.mark.parametrize(
    ("events", "error"),
    [
        (lambda e: [stored(e, [10, 11]), stored(e, [12], 99)], UnknownParentError),
        (lambda e: [stored(e, [10, 11]), stored(e, [9, 11])], ParentMismatchError),
        (lambda e: [stored(e, [10, 11]), stored(e, [12, 13, 12])], DuplicateHashError),
        (lambda e: [stored(e, [10, 11]), stored(e, [1, 2])], ParentMismatchError),
        (
            lambda e: [cleared(e), stored(e, [20, 21]), removed(e, [2]), stored(e, [22], 30)],
            UnknownParentError,
        ),
    ],
    ids=["unknown-parent", "mismatch", "duplicate", "mismatch-existing", "after-clear"],
)
def test_invalid_batch_changes_nothing(encoding: str, events: Any, error: type[Exception]) -> None:
    d = KvDirectory()
    d.store(0, "L1", [2, 1], now=0.0)  # 1 is known under 2
    d.store(1, "L1", [2], now=0.0)
    before = snapshot(d, [[2, 1], [10, 11, 12]], [1, 2, 5, 9, 10, 11, 12, 13], [0, 1])
    with pytest.raises(error):
        d.apply_events(0, batch(*events(encoding)))
    assert snapshot(d, [[2, 1], [10, 11, 12]], [1, 2, 5, 9, 10, 11, 12, 13], [0, 1]) == before


NOT_A_BATCH: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("reserved-byte", b"\xc1"),
    ("nil", msgpack.packb(None)),
    ("an-int", msgpack.packb(7)),
    ("a-map", msgpack.packb({"ts": 1.0, "events": []})),
    ("a-string", msgpack.packb("BlockStored")),
    ("empty-array", msgpack.packb([])),
    ("one-element", msgpack.packb([1.0])),
    ("events-not-a-list", msgpack.packb([1.0, 5, 0])),
    ("events-nil", msgpack.packb([1.0, None, 0])),
]

# events that cannot be decoded; each is sent after a valid event, which must not apply either
BAD_EVENTS: list[tuple[str, Any]] = [
    ("an-int", 5),
    ("nil", None),
    ("a-string", "BlockStored"),
    ("map-without-type", {"block_hashes": [1], "parent_block_hash": None}),
    ("type-not-a-string", {"type": 7, "block_hashes": [1]}),
    ("hashes-a-string", {"type": "BlockStored", "block_hashes": "1", "parent_block_hash": None}),
    ("hash-a-float", {"type": "BlockStored", "block_hashes": [1.5], "parent_block_hash": None}),
    ("hash-a-list", {"type": "BlockRemoved", "block_hashes": [[1]]}),
    ("hash-a-string", {"type": "BlockRemoved", "block_hashes": ["1"]}),
    ("parent-a-string", {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": "0"}),
    ("removed-without-hashes", {"type": "BlockRemoved"}),
    ("stored-without-hashes", {"type": "BlockStored", "parent_block_hash": None}),
    ("positional-without-hashes", ["BlockStored"]),
    ("positional-hashes-nil", ["BlockRemoved", None]),
    ("positional-hash-a-float", ["BlockRemoved", [2.0]]),
    ("positional-empty", []),
    ("positional-name-not-a-string", [3, [1]]),
]


def _expect_decode_error(payload: bytes) -> None:
    d = fuzz_state()
    before = snapshot(d, INSERTED_CHAINS, [1, 2, 3, 7, 40, 41], [0, 1])
    with pytest.raises(EventDecodeError) as info:
        d.apply_events(0, payload)
    assert isinstance(info.value.offset, int)
    assert 0 <= info.value.offset <= len(payload)
    assert snapshot(d, INSERTED_CHAINS, [1, 2, 3, 7, 40, 41], [0, 1]) == before


@pytest.mark.parametrize("payload", [p for _, p in NOT_A_BATCH], ids=[n for n, _ in NOT_A_BATCH])
def test_not_a_batch_is_a_decode_error(payload: bytes) -> None:
    _expect_decode_error(payload)


@pytest.mark.parametrize("event", [e for _, e in BAD_EVENTS], ids=[n for n, _ in BAD_EVENTS])
def test_bad_event_is_a_decode_error(event: Any) -> None:
    _expect_decode_error(batch(stored("map", [40, 41]), event))
    _expect_decode_error(batch(stored("positional", [40, 41]), event))


@pytest.mark.parametrize("node", [-1, 2**32])
def test_apply_events_validates_node(node: int) -> None:
    d = KvDirectory()
    with pytest.raises(InvalidArgumentError) as info:
        d.apply_events(node, MAP_BATCHES[0])
    assert info.value.argument == "node"
    assert len(d) == 0


# ------------------------------------------------------------------------------------------------
# events and direct calls are the same thing

UNIVERSE = [reference_block_hashes(list(range(s, s + 24)), 4) for s in (0, 0, 100, 200)]
UNIVERSE[1] = reference_block_hashes(list(range(0, 12)) + list(range(500, 512)), 4)


EventOp = tuple[str, int, Tier, list[int], int | None]


@st.composite
def event_ops(draw: st.DrawFn) -> EventOp:
    kind = draw(st.sampled_from(["store", "store", "remove", "clear"]))
    node = draw(st.integers(0, 2))
    tier = draw(st.sampled_from(TIERS))
    chain = draw(st.sampled_from(UNIVERSE))
    start = draw(st.integers(0, len(chain) - 1))
    end = draw(st.integers(start + 1, len(chain)))
    parent = chain[start - 1] if start else None
    return kind, node, tier, chain[start:end], parent


def _encode_hash(h: int, unsigned: bool) -> int:
    return h + 2**64 if unsigned and h < 0 else h


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(event_ops(), st.booleans(), st.booleans()), max_size=25))
def test_events_equal_direct_calls(ops: list[tuple[EventOp, bool, bool]]) -> None:
    by_events, direct = KvDirectory(), KvDirectory()
    for (kind, node, tier, hashes, parent), positional, unsigned in ops:
        encoding = "positional" if positional else "map"
        medium = "GPU" if tier == "L1" else "CPU_PINNED"
        wire = [_encode_hash(h, unsigned) for h in hashes]
        wire_parent = None if parent is None else _encode_hash(parent, unsigned)
        try:
            if kind == "store":
                direct.store(node, tier, hashes, parent=parent)
            elif kind == "remove":
                direct.remove(node, tier, hashes)
            else:
                direct.clear(node)
        except UnknownParentError:
            with pytest.raises(UnknownParentError):
                by_events.apply_events(node, batch(stored(encoding, wire, wire_parent, medium)))
            continue
        if kind == "store":
            event = stored(encoding, wire, wire_parent, medium)
        elif kind == "remove":
            event = removed(encoding, wire, medium)
        else:
            event = cleared(encoding)
        assert by_events.apply_events(node, batch(event)) == 1
        assert semantic_stats(by_events) == semantic_stats(direct)
    for chain in UNIVERSE:
        assert read_match(by_events.match(chain)) == read_match(direct.match(chain))
    for node in range(3):
        for tier in TIERS:
            assert sorted(by_events.eviction_order(node, tier)) == sorted(
                direct.eviction_order(node, tier)
            )
