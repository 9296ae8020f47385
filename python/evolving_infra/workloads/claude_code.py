"""Loader for Claude Code agent traces (the kv-cache-tester format, `data/traces/claude-code/`).

One JSON file per conversation (plain, `.json.gz` or `.json.xz`). A conversation is a main
branch plus one branch per sub-agent; every request becomes a `CcRequest` with its absolute time
(seconds since the conversation started) and its prompt as directory block hashes.

The trace's `hash_ids` name 64-token blocks and are scoped to one conversation, so they cannot
be directory hashes as they are: block i's hash is a rolling digest of (conversation id,
hash_ids[0..=i]). Like an SGLang page hash, it determines the whole prefix, so two requests
that share a prefix of `hash_ids` share the same leading hashes (their chains are consistent
with one forest) and two conversations never share a block.

Times are the file's, literally: a sub-agent request's time is its entry's `t` plus the
request's own `t`. NOTE: for a completed sub-agent the entry's `t` is when it *finished*:
`t - duration_ms` falls just after the parent's previous response in every bundled trace, so its
requests' literal times come late. `importers.claude_code_trace` rebuilds spawn times and joins;
the stats' h* follows the literal definition.
"""

from __future__ import annotations

import heapq
import json
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NewType

from evolving_infra.types import BlockHash
from evolving_infra.workloads.blocks import chain_hashes, common_prefix
from evolving_infra.workloads.errors import TraceFormatError
from evolving_infra.workloads.files import read_bytes
from evolving_infra.workloads.model import I64_MAX, I64_MIN, BranchId

ConversationId = NewType("ConversationId", str)

BLOCK_SIZE = 64
TRACE_SUFFIXES = (".json", ".json.gz", ".json.xz")


@dataclass(frozen=True, slots=True)
class CcRequest:
    """One model call of one branch, with its prompt as directory block hashes."""

    conversation: ConversationId
    branch: BranchId
    index: int  # position within the branch, in time order
    t: float  # seconds since the conversation started
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]  # the trace's block ids (conversation-scoped)
    blocks: tuple[BlockHash, ...]  # directory hashes, one per full 64-token block
    model: str
    think_time: float | None  # gap before the request (tool execution, the human); None: unknown
    api_time: float | None  # provider response time; None: unknown
    last_in_branch: bool


@dataclass(frozen=True, slots=True)
class SubAgent:
    """A sub-agent entry: the branch it runs on and how the trace records its life."""

    branch: BranchId
    parent: BranchId
    marker_t: float  # the entry's `t` made absolute; its requests' `t` are relative to it
    duration: float | None  # `duration_ms` in seconds; None: not recorded
    status: str  # "completed", "async_launched", ... ("" when missing)
    subagent_type: str


@dataclass(frozen=True, slots=True)
class Conversation:
    """One trace file: its requests over all branches, sorted by time (file order on ties)."""

    id: ConversationId
    path: Path
    branches: tuple[BranchId, ...]  # the main branch first, then sub-agents in spawn order
    requests: tuple[CcRequest, ...]
    subagents: tuple[SubAgent, ...] = ()  # in file order
    system_tokens: int = 0  # the main agent's system prompt, as the file reports it
    tool_tokens: int = 0  # its tool definitions


def find_trace_files(paths: Iterable[Path]) -> list[Path]:
    """Trace files named by `paths`: files as given, folders expanded to their traces, sorted."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.name.endswith(TRACE_SUFFIXES))
            files.extend(found)
        else:
            files.append(path)
    return files


def bundled_trace_dir() -> Path:
    """The Claude Code traces bundled in the source tree (`data/traces/claude-code/`)."""
    # NOTE: the data sits beside the package in a source checkout (an editable install), not
    # inside a wheel; callers should offer a way to name trace files explicitly.
    return Path(__file__).resolve().parents[3] / "data" / "traces" / "claude-code"


def load_conversation(path: Path) -> Conversation:
    """Read and validate one trace file; raises `TraceFormatError` (OSError if unreadable)."""
    return _Parser(path).parse(_read_json(path))


def load_conversations(paths: Iterable[Path]) -> list[Conversation]:
    return [load_conversation(p) for p in paths]


def merge_by_time(conversations: Sequence[Conversation]) -> Iterator[CcRequest]:
    """All requests of conversations that start together at t = 0, in time order.

    Ties go to the conversation listed first, then to file order within it.
    """
    return heapq.merge(*(c.requests for c in conversations), key=lambda r: r.t)


def _read_json(path: Path) -> Any:
    data = read_bytes(path)
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceFormatError(path, None, f"not JSON: {e}") from None


class _Parser:
    """Validates one file's JSON; every error names the file and the field's JSON path."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conversation = ConversationId("")
        self.requests: list[CcRequest] = []  # file order; index and last_in_branch set at the end
        self.branches: list[BranchId] = []
        # Last request of each branch: the next one usually extends its prompt, so only the
        # new blocks are validated and hashed (and the tuples share the common prefix).
        self.prev: dict[BranchId, CcRequest] = {}
        self.subagents: list[SubAgent] = []

    def fail(self, field: str | None, reason: str) -> TraceFormatError:
        return TraceFormatError(self.path, field, reason)

    def get(self, obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
        field = f"{where}.{key}" if where else key
        if key not in obj:
            raise self.fail(field, "missing")
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise self.fail(field, f"expected {_kind_name(kind)}, got {type(value).__name__}")
        return value

    def number(self, obj: dict[str, Any], key: str, where: str) -> float:
        value = float(self.get(obj, key, (int, float), where))
        if not math.isfinite(value) or value < 0:
            raise self.fail(f"{where}.{key}", f"expected a finite number >= 0, got {value}")
        return value

    def optional_number(self, obj: dict[str, Any], key: str, where: str) -> float | None:
        return None if obj.get(key) is None else self.number(obj, key, where)

    def count(self, obj: dict[str, Any], key: str, where: str) -> int:
        value: int = self.get(obj, key, int, where)
        if value < 0:
            raise self.fail(f"{where}.{key}", f"expected an int >= 0, got {value}")
        return value

    def optional_count(self, obj: dict[str, Any], key: str, where: str) -> int:
        return 0 if obj.get(key) is None else self.count(obj, key, where)

    def parse(self, doc: Any) -> Conversation:
        if not isinstance(doc, dict):
            raise self.fail(None, f"expected a JSON object, got {type(doc).__name__}")
        self.conversation = ConversationId(self.get(doc, "id", str, ""))
        block_size = self.get(doc, "block_size", int, "")
        if block_size != BLOCK_SIZE:
            raise self.fail("block_size", f"expected {BLOCK_SIZE}, got {block_size}")
        self.walk(self.get(doc, "requests", list, ""), BranchId(self.conversation), 0.0, "requests")
        # Stable sort: ties keep file order (a sub-agent's first request follows its spawn).
        ordered = sorted(self.requests, key=lambda r: r.t)
        totals = Counter(r.branch for r in ordered)
        seen: Counter[BranchId] = Counter()
        requests = []
        for r in ordered:
            index = seen[r.branch]
            seen[r.branch] += 1
            last = index == totals[r.branch] - 1
            requests.append(replace(r, index=index, last_in_branch=last))
        return Conversation(
            self.conversation,
            self.path,
            tuple(self.branches),
            tuple(requests),
            tuple(self.subagents),
            system_tokens=self.optional_count(doc, "system_tokens", ""),
            tool_tokens=self.optional_count(doc, "tool_tokens", ""),
        )

    def walk(self, items: list[Any], branch: BranchId, t0: float, where: str) -> None:
        self.branches.append(branch)
        for i, item in enumerate(items):
            at = f"{where}[{i}]"
            if not isinstance(item, dict):
                raise self.fail(at, f"expected an object, got {type(item).__name__}")
            kind = self.get(item, "type", str, at)
            t = t0 + self.number(item, "t", at)
            if kind == "subagent":
                agent = self.get(item, "agent_id", str, at)
                sub = BranchId(f"{branch}/{agent}")
                if sub in self.branches:
                    raise self.fail(f"{at}.agent_id", f"duplicate sub-agent {agent!r}")
                duration = self.optional_number(item, "duration_ms", at)
                self.subagents.append(
                    SubAgent(
                        branch=sub,
                        parent=branch,
                        marker_t=t,
                        duration=None if duration is None else duration / 1000,
                        status=str(item.get("status") or ""),
                        subagent_type=str(item.get("subagent_type") or ""),
                    )
                )
                self.walk(self.get(item, "requests", list, at), sub, t, f"{at}.requests")
            elif kind in ("n", "s"):
                self.request(item, branch, t, at)
            else:
                raise self.fail(f"{at}.type", f"expected 'n', 's' or 'subagent', got {kind!r}")

    def request(self, item: dict[str, Any], branch: BranchId, t: float, at: str) -> None:
        ids = tuple(self.get(item, "hash_ids", list, at))
        prev = self.prev.get(branch)
        k = common_prefix(prev.hash_ids, ids) if prev is not None else 0
        for j in range(k, len(ids)):
            block_id = ids[j]
            if isinstance(block_id, bool) or not isinstance(block_id, int):
                kind = type(block_id).__name__
                raise self.fail(f"{at}.hash_ids[{j}]", f"expected an int, got {kind}")
            if not I64_MIN <= block_id <= I64_MAX:
                raise self.fail(f"{at}.hash_ids[{j}]", f"{block_id} is outside signed 64-bit")
        known: tuple[BlockHash, ...] = ()
        if prev is not None:
            ids, known = prev.hash_ids[:k] + ids[k:], prev.blocks[:k]
        request = CcRequest(
            conversation=self.conversation,
            branch=branch,
            index=-1,
            t=t,
            input_tokens=self.count(item, "in", at),
            output_tokens=self.count(item, "out", at),
            hash_ids=ids,
            blocks=chain_hashes(self.conversation, ids, known),
            model=self.get(item, "model", str, at) if "model" in item else "",
            think_time=self.optional_number(item, "think_time", at),
            api_time=self.optional_number(item, "api_time", at),
            last_in_branch=False,
        )
        self.requests.append(request)
        self.prev[branch] = request


def _kind_name(kind: type | tuple[type, ...]) -> str:
    if kind == (int, float):
        return "a number"
    names = {int: "an int", str: "a string", list: "a list", dict: "an object"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)
