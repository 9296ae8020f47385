"""The Claude Code trace loader, on the bundled traces and on hand-made malformed files."""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import random
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from evolving_infra.workloads import (
    BlockHash,
    BranchId,
    Conversation,
    ConversationId,
    TraceFormatError,
    bundled_trace_dir,
    chain_hashes,
    find_trace_files,
    load_conversation,
    load_conversations,
    merge_by_time,
)
from evolving_infra.workloads.model import BlockIds

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces" / "claude-code"


def trace(name: str) -> Conversation:
    return load_conversation(TRACES / f"{name}.json.xz")


@pytest.fixture(scope="module")
def everything() -> list[Conversation]:
    return load_conversations(find_trace_files([TRACES]))


def test_bundled_files_are_found() -> None:
    assert bundled_trace_dir() == TRACES
    files = find_trace_files([TRACES])
    assert len(files) == 24
    assert files == sorted(files)
    assert all(f.name.endswith(".json.xz") for f in files)
    assert (TRACES / "LICENSE").is_file()


@pytest.mark.parametrize(
    ("name", "branches"),
    [
        ("trace_0095", {"trace_0095": 5}),
        ("trace_0630", {"trace_0630": 17}),
        (
            "trace_0277",
            {
                "trace_0277": 9,
                "trace_0277/agent_001": 4,
                "trace_0277/agent_002": 12,
                "trace_0277/agent_003": 17,
                "trace_0277/agent_004": 11,
            },
        ),
    ],
)
def test_request_counts_per_branch(name: str, branches: dict[str, int]) -> None:
    c = trace(name)
    assert c.id == name
    assert list(c.branches) == list(branches)
    assert Counter(r.branch for r in c.requests) == branches


def test_totals_over_the_bundled_set(everything: list[Conversation]) -> None:
    requests = [r for c in everything for r in c.requests]
    assert len(requests) == 3204
    assert sum(len(c.branches) for c in everything) == 24 + 41
    assert sum(len(r.blocks) for r in requests) == 5_389_322
    # Every request's prompt is its full 64-token blocks.
    assert all(len(r.blocks) == len(r.hash_ids) == r.input_tokens // 64 for r in requests)


def test_requests_in_time_order_with_branch_positions() -> None:
    c = trace("trace_0277")
    times = [r.t for r in c.requests]
    assert times == sorted(times)
    # A sub-agent's request times are offsets from its spawn (t = 79.224 for agent_001).
    first_sub = next(r for r in c.requests if r.branch == "trace_0277/agent_001")
    assert first_sub.t == pytest.approx(79.224)
    assert first_sub.index == 0
    for branch in c.branches:
        mine = [r for r in c.requests if r.branch == branch]
        assert [r.index for r in mine] == list(range(len(mine)))
        assert [r.last_in_branch for r in mine] == [False] * (len(mine) - 1) + [True]


def test_optional_timing_fields() -> None:
    c = trace("trace_0095")
    assert c.requests[0].api_time is None  # absent in the file
    assert c.requests[1].think_time is None
    assert c.requests[2].think_time == 5.0
    assert c.requests[2].api_time == pytest.approx(5.59)


def test_chain_hashes_are_pinned() -> None:
    # Golden values: changing the hash changes every directory hash derived from a trace.
    assert chain_hashes(ConversationId("c"), [1, 2, 3]) == (
        -3560858000524656599,
        -1112978684787017893,
        8502436490881254105,
    )


def test_chain_hashes_match_a_naive_rolling_digest() -> None:
    def naive(conversation: str, ids: list[int]) -> list[int]:
        person = b"evinfra-cc-v1"
        digest = hashlib.blake2b(conversation.encode(), digest_size=8, person=person).digest()
        out = []
        for i in ids:
            raw = digest + i.to_bytes(8, "little", signed=True)
            digest = hashlib.blake2b(raw, digest_size=8, person=person).digest()
            out.append(int.from_bytes(digest, "little", signed=True))
        return out

    c = trace("trace_0630")
    for r in c.requests[::4]:
        assert list(r.blocks) == naive(c.id, list(r.hash_ids))
    ids = [5, -(2**63), 2**63 - 1, 5]
    known = chain_hashes(ConversationId("x"), ids[:2])
    assert list(chain_hashes(ConversationId("x"), ids, known)) == naive("x", ids)
    # A view of a branch's id array (what generated traces hold), with a known head.
    rng = random.Random(7)
    many = [rng.randrange(-(2**63), 2**63) for _ in range(5_000)]
    view = BlockIds(array("q", many), 4_321)
    want = naive("y", many[:4_321])
    assert list(chain_hashes(ConversationId("y"), view)) == want
    assert list(chain_hashes(ConversationId("y"), view, tuple(want[:1_000]))) == want  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["trace_0277", "trace_0010", "trace_0274"])
def test_chains_form_one_forest(name: str) -> None:
    """Equal hashes mean equal prefixes: one parent and one trace block id per hash."""
    c = trace(name)
    parent: dict[BlockHash, BlockHash | None] = {}
    block_id: dict[BlockHash, int] = {}
    for r in c.requests:
        assert all(-(2**63) <= b < 2**63 for b in r.blocks)
        assert len(set(r.blocks)) == len(r.blocks)
        for i, b in enumerate(r.blocks):
            assert parent.setdefault(b, r.blocks[i - 1] if i else None) == (
                r.blocks[i - 1] if i else None
            )
            assert block_id.setdefault(b, r.hash_ids[i]) == r.hash_ids[i]


def test_shared_hash_id_prefixes_share_block_hashes() -> None:
    c = trace("trace_0277")
    subs = [r for r in c.requests if r.branch != BranchId(c.id) and r.index == 0]
    assert len(subs) == 4
    pairs = [(a, b) for a in c.requests[:20] for b in c.requests[:20]] + [
        (subs[0], s) for s in subs[1:]
    ]
    for a, b in pairs:
        k = 0
        while k < min(len(a.hash_ids), len(b.hash_ids)) and a.hash_ids[k] == b.hash_ids[k]:
            k += 1
        assert a.blocks[:k] == b.blocks[:k]
        assert set(a.blocks[k:]).isdisjoint(b.blocks[k:])
    # Sub-agents of one conversation share their ~180-block system prefix.
    assert subs[0].blocks[:150] == subs[1].blocks[:150]


def test_no_block_collides_across_conversations(everything: list[Conversation]) -> None:
    seen: dict[BlockHash, ConversationId] = {}
    for c in everything:
        for b in {b for r in c.requests for b in r.blocks}:
            assert seen.setdefault(b, c.id) == c.id


def test_same_ids_in_two_conversations_give_disjoint_chains(tmp_path: Path) -> None:
    doc = minimal_doc()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(doc))
    b.write_text(json.dumps(doc | {"id": "other"}))
    ra, rb = load_conversation(a).requests[0], load_conversation(b).requests[0]
    assert ra.hash_ids == rb.hash_ids
    assert set(ra.blocks).isdisjoint(rb.blocks)


def test_merge_by_time_interleaves_conversations() -> None:
    cs = [trace("trace_0485"), trace("trace_0630"), trace("trace_0095")]
    merged = list(merge_by_time(cs))
    assert len(merged) == 12 + 17 + 5
    assert [r.t for r in merged] == sorted(r.t for r in merged)
    assert merged[:3] == [cs[0].requests[0], cs[1].requests[0], cs[2].requests[0]]  # t = 0 ties


@pytest.mark.parametrize("suffix", [".json", ".json.gz", ".json.xz"])
def test_compressed_and_plain_files_read_alike(tmp_path: Path, suffix: str) -> None:
    raw = lzma.decompress((TRACES / "trace_0095.json.xz").read_bytes())
    path = tmp_path / f"trace_0095{suffix}"
    opener = {".json": lambda b: b, ".json.gz": gzip.compress, ".json.xz": lzma.compress}
    path.write_bytes(opener[suffix](raw))
    assert load_conversation(path).requests == trace("trace_0095").requests


def minimal_doc() -> dict[str, Any]:
    request = {"t": 0.0, "type": "n", "model": "m", "in": 200, "out": 10, "hash_ids": [1, 2, 3]}
    sub = {"t": 5.0, "type": "subagent", "agent_id": "agent_001", "requests": [dict(request)]}
    return {"id": "conv", "block_size": 64, "requests": [request, sub]}


def test_minimal_doc_loads(tmp_path: Path) -> None:
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(minimal_doc()))
    c = load_conversation(path)
    assert c.branches == ("conv", "conv/agent_001")
    assert [(r.branch, r.t) for r in c.requests] == [("conv", 0.0), ("conv/agent_001", 5.0)]
    assert c.requests[0].blocks == c.requests[1].blocks  # same conversation, same ids


def _set(doc: dict[str, Any], path: list[str | int], value: Any) -> None:
    obj: Any = doc
    for key in path[:-1]:
        obj = obj[key]
    if value is _DELETE:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value


_DELETE = object()


@pytest.mark.parametrize(
    ("where", "value", "field", "reason"),
    [
        (["id"], _DELETE, "id", "missing"),
        (["id"], 7, "id", "expected a string, got int"),
        (["block_size"], 16, "block_size", "expected 64"),
        (["requests"], {}, "requests", "expected a list"),
        (["requests", 0], "x", "requests[0]", "expected an object"),
        (["requests", 0, "type"], "q", "requests[0].type", "got 'q'"),
        (["requests", 0, "t"], -1.0, "requests[0].t", ">= 0"),
        (["requests", 0, "t"], True, "requests[0].t", "got bool"),
        (["requests", 0, "in"], -5, "requests[0].in", ">= 0"),
        (["requests", 0, "out"], _DELETE, "requests[0].out", "missing"),
        (["requests", 0, "hash_ids", 2], "3", "requests[0].hash_ids[2]", "expected an int"),
        (["requests", 0, "hash_ids", 1], 2**63, "requests[0].hash_ids[1]", "signed 64-bit"),
        (["requests", 0, "think_time"], "soon", "requests[0].think_time", "a number"),
        (["requests", 1, "requests"], _DELETE, "requests[1].requests", "missing"),
        (
            ["requests", 1, "requests", 0, "hash_ids"],
            None,
            "requests[1].requests[0].hash_ids",
            "expected a list",
        ),
    ],
)
def test_malformed_fields_are_named(
    tmp_path: Path, where: list[str | int], value: Any, field: str, reason: str
) -> None:
    doc = minimal_doc()
    _set(doc, where, value)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceFormatError) as info:
        load_conversation(path)
    assert info.value.path == path
    assert info.value.field == field
    assert reason in info.value.reason
    assert str(path) in str(info.value)
    assert field in str(info.value)


def test_duplicate_sub_agent_is_an_error(tmp_path: Path) -> None:
    doc = minimal_doc()
    doc["requests"].append(doc["requests"][1])
    path = tmp_path / "dup.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceFormatError, match="duplicate sub-agent") as info:
        load_conversation(path)
    assert info.value.field == "requests[2].agent_id"


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("broken.json", b'{"id": ', "not JSON"),
        ("list.json", b"[1, 2]", "expected a JSON object"),
        ("corrupt.json.xz", b"not xz at all", "cannot decompress"),
        ("corrupt.json.gz", b"not gzip", "cannot decompress"),
    ],
)
def test_unreadable_files_name_the_file(
    tmp_path: Path, name: str, content: bytes, reason: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=reason) as info:
        load_conversation(path)
    assert info.value.path == path
    assert info.value.field is None
