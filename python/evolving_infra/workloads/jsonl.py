"""The trace file format, version 1: JSON Lines (`.jsonl`, `.jsonl.gz`, `.jsonl.xz`).

Line 1 is the header; every other line is one record with a `type`. Records refer only to
records above them, so a file can be written and read as a stream. Optional fields may be left
out (their defaults below); unknown fields are an error (a typo must not pass silently).

    {"format": "evolving-infra-trace", "version": 1, "name": str, "block_size": int,
     "prefixes": {name: blocks}?, "meta": {...}?}
    {"type": "agent", "id": str, "workload": str, "namespace": str? (= id), "start": s? (0),
     "follows": agent id? (null), "prefix": name? (null), "until": s? (null)}
    {"type": "branch", "agent": id, "id": str, "kind": "root"|"subagent"|"fork",
     "parent": branch id? (null), "after": int? (null), "delay": s? (0)}
    {"type": "request", "agent": id, "branch": id, "wait": s, "prompt_tokens": int,
     "output_tokens": int, "keep": int? (0), "add": [int]? ([]), "shared": int? (0),
     "join": [branch id]? ([]), "compaction": bool? (false), "end": bool? (false)}

A request's own blocks are written as a delta: the first `keep` blocks of its base, then `add`.
The base is the branch's previous request; for a branch's first request it is the spawning
request of the parent for a fork, and nothing otherwise. See `model` for what the fields mean.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evolving_infra.workloads.blocks import common_prefix
from evolving_infra.workloads.errors import TraceFormatError
from evolving_infra.workloads.files import open_text_for_writing, read_bytes
from evolving_infra.workloads.model import (
    FORMAT,
    FORMAT_VERSION,
    Agent,
    AgentId,
    BlockId,
    Blocks,
    Branch,
    BranchId,
    BranchKind,
    Request,
    Trace,
    TraceError,
    validate,
)

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.xz")
_HEADER_KEYS = {"format", "version", "name", "block_size", "prefixes", "meta"}
_KEYS = {
    "agent": {"type", "id", "workload", "namespace", "start", "follows", "prefix", "until"},
    "branch": {"type", "agent", "id", "kind", "parent", "after", "delay"},
    "request": {
        *("type", "agent", "branch", "wait", "prompt_tokens", "output_tokens", "keep", "add"),
        *("shared", "join", "compaction", "end"),
    },
}


def is_trace_file(path: Path) -> bool:
    return path.name.endswith(SUFFIXES)


# ---- writing --------------------------------------------------------------------------------


def dumps_records(trace: Trace) -> Iterable[dict[str, Any]]:
    """The file's records, header first, defaults left out."""
    header: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "name": trace.name,
        "block_size": trace.block_size,
    }
    if trace.prefixes:
        header["prefixes"] = dict(trace.prefixes)
    if trace.meta:
        header["meta"] = dict(trace.meta)
    yield header
    for a in trace.agents:
        rec: dict[str, Any] = {"type": "agent", "id": a.id, "workload": a.workload}
        _put(rec, "namespace", a.namespace, a.id)
        _put(rec, "start", a.start, 0.0)
        _put(rec, "follows", a.follows, None)
        _put(rec, "prefix", a.prefix, None)
        _put(rec, "until", a.until, None)
        yield rec
        by_id = {b.id: b for b in a.branches}
        for b in a.branches:
            rec = {"type": "branch", "agent": a.id, "id": b.id, "kind": b.kind.value}
            _put(rec, "parent", b.parent, None)
            _put(rec, "after", b.after, None)
            _put(rec, "delay", b.delay, 0.0)
            yield rec
        for b in a.branches:
            base = _first_base(b, by_id)
            for r in b.requests:
                keep = common_prefix(base, r.blocks)
                rec = {
                    "type": "request",
                    "agent": a.id,
                    "branch": b.id,
                    "wait": r.wait,
                    "prompt_tokens": r.prompt_tokens,
                    "output_tokens": r.output_tokens,
                }
                _put(rec, "keep", keep, 0)
                _put(rec, "add", list(r.blocks[keep:]), [])
                _put(rec, "shared", r.shared, 0)
                _put(rec, "join", list(r.join), [])
                _put(rec, "compaction", r.compaction, False)
                _put(rec, "end", r.end, False)
                yield rec
                base = r.blocks


def save(trace: Trace, path: Path) -> None:
    """Writes `trace` to `path` (compressed if the name ends in .gz or .xz)."""
    validate(trace)
    with open_text_for_writing(path) as f:
        for rec in dumps_records(trace):
            f.write(json.dumps(rec, separators=(",", ":")))
            f.write("\n")


def _put(rec: dict[str, Any], key: str, value: Any, default: Any) -> None:
    if value != default:
        rec[key] = value


def _first_base(b: Branch, branches: dict[BranchId, Branch]) -> Blocks:
    if b.kind is BranchKind.FORK and b.parent is not None and b.after is not None:
        return branches[b.parent].requests[b.after].blocks
    return ()


# ---- reading --------------------------------------------------------------------------------


@dataclass(slots=True)
class _BranchDraft:
    branch: Branch  # without requests yet
    line: int
    requests: list[Request] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _AgentDraft:
    agent: Agent  # without branches yet
    line: int
    branches: dict[BranchId, _BranchDraft] = field(default_factory=dict)


class _Reader:
    """Parses one file; every error names the file, the line and the field."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.line = 0
        self.agents: dict[AgentId, _AgentDraft] = {}

    def fail(self, field: str | None, reason: str, line: int | None = None) -> TraceFormatError:
        return TraceFormatError(self.path, field, reason, line=self.line if line is None else line)

    def get(self, rec: dict[str, Any], key: str, check: Callable[[Any], bool], kind: str) -> Any:
        if key not in rec:
            raise self.fail(key, "missing")
        value = rec[key]
        if not check(value):
            raise self.fail(key, f"expected {kind}, got {json.dumps(value)[:40]}")
        return value

    def opt(
        self, rec: dict[str, Any], key: str, check: Callable[[Any], bool], kind: str, default: Any
    ) -> Any:
        return self.get(rec, key, check, kind) if rec.get(key) is not None else default

    def read(self, data: bytes) -> Trace:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(None, f"not UTF-8: {e}", line=0) from None
        header: dict[str, Any] | None = None
        for self.line, raw in enumerate(text.splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError as e:
                raise self.fail(None, f"not JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(rec, dict):
                raise self.fail(None, f"expected a JSON object, got {type(rec).__name__}")
            if header is None:
                header = self.header(rec)
                continue
            kind = self.get(rec, "type", _is_str, "a string")
            if kind not in _KEYS:
                raise self.fail("type", f"expected 'agent', 'branch' or 'request', got {kind!r}")
            unknown = sorted(set(rec) - _KEYS[kind])
            if unknown:
                raise self.fail(unknown[0], f"unknown field of a {kind} record")
            getattr(self, kind)(rec)
        if header is None:
            raise self.fail(None, "empty file: no header line", line=1)
        return self.finish(header)

    def header(self, rec: dict[str, Any]) -> dict[str, Any]:
        if rec.get("format") != FORMAT:
            got = json.dumps(rec.get("format"))
            raise self.fail("format", f"expected {FORMAT!r} (is this a trace file?), got {got}")
        version = self.get(rec, "version", _is_int, "an int")
        if version != FORMAT_VERSION:
            raise self.fail("version", f"this reader knows version {FORMAT_VERSION}, not {version}")
        unknown = sorted(set(rec) - _HEADER_KEYS)
        if unknown:
            raise self.fail(unknown[0], "unknown field of the header")
        self.get(rec, "name", _is_str, "a string")
        self.get(rec, "block_size", _is_pos_int, "an int > 0")
        prefixes = self.opt(rec, "prefixes", _is_dict, "an object", {})
        for name, size in prefixes.items():
            if not _is_pos_int(size):
                raise self.fail(f"prefixes.{name}", f"expected an int > 0, got {size!r}")
        meta = self.opt(rec, "meta", _is_dict, "an object", {})
        # Python's parser takes NaN and Infinity, which are not JSON: a saved copy would not be.
        try:
            json.dumps(meta, allow_nan=False)
        except ValueError:
            raise self.fail("meta", "NaN and Infinity are not JSON numbers") from None
        return rec

    def agent(self, rec: dict[str, Any]) -> None:
        agent_id = AgentId(self.get(rec, "id", _is_str, "a string"))
        if agent_id in self.agents:
            raise self.fail("id", f"duplicate agent {agent_id!r}")
        follows = self.opt(rec, "follows", _is_str, "an agent id", None)
        if follows is not None and follows not in self.agents:
            raise self.fail("follows", f"{follows!r} is not an agent above")
        agent = Agent(
            id=agent_id,
            workload=self.get(rec, "workload", _is_str, "a string"),
            namespace=self.opt(rec, "namespace", _is_str, "a string", agent_id),
            branches=(),
            start=self.opt(rec, "start", _is_seconds, "seconds >= 0", 0.0),
            follows=follows,
            prefix=self.opt(rec, "prefix", _is_str, "a string", None),
            until=self.opt(rec, "until", _is_seconds, "seconds >= 0", None),
        )
        self.agents[agent_id] = _AgentDraft(agent, self.line)

    def owner(self, rec: dict[str, Any]) -> _AgentDraft:
        agent_id = self.get(rec, "agent", _is_str, "an agent id")
        if agent_id not in self.agents:
            raise self.fail("agent", f"{agent_id!r} is not an agent above")
        return self.agents[agent_id]

    def branch(self, rec: dict[str, Any]) -> None:
        a = self.owner(rec)
        branch_id = BranchId(self.get(rec, "id", _is_str, "a string"))
        if branch_id in a.branches:
            raise self.fail("id", f"duplicate branch {branch_id!r} of agent {a.agent.id!r}")
        kind = self.get(rec, "kind", lambda v: v in set(BranchKind), "'root', 'subagent' or 'fork'")
        parent = self.opt(rec, "parent", _is_str, "a branch id", None)
        if parent is not None and parent not in a.branches:
            raise self.fail("parent", f"{parent!r} is not a branch above")
        branch = Branch(
            id=branch_id,
            kind=BranchKind(kind),
            parent=parent,
            after=self.opt(rec, "after", _is_nat, "an int >= 0", None),
            delay=self.opt(rec, "delay", _is_seconds, "seconds >= 0", 0.0),
        )
        a.branches[branch_id] = _BranchDraft(branch, self.line)

    def request(self, rec: dict[str, Any]) -> None:
        a = self.owner(rec)
        branch_id = self.get(rec, "branch", _is_str, "a branch id")
        if branch_id not in a.branches:
            raise self.fail("branch", f"{branch_id!r} is not a branch of {a.agent.id!r} above")
        b = a.branches[branch_id]
        base = self.base(a, b)
        keep = self.opt(rec, "keep", _is_nat, "an int >= 0", 0)
        if keep > len(base):
            raise self.fail("keep", f"{keep} > the {len(base)} blocks of the base prompt")
        add = self.opt(rec, "add", _is_list, "a list of ints", [])
        for j, v in enumerate(add):
            if not _is_int(v):
                raise self.fail(f"add[{j}]", f"expected an int, got {json.dumps(v)[:40]}")
        join = self.opt(rec, "join", _is_list, "a list of branch ids", [])
        for j, v in enumerate(join):
            if not _is_str(v):
                raise self.fail(f"join[{j}]", f"expected a branch id, got {json.dumps(v)[:40]}")
        b.requests.append(
            Request(
                wait=self.get(rec, "wait", _is_seconds, "seconds >= 0"),
                prompt_tokens=self.get(rec, "prompt_tokens", _is_nat, "an int >= 0"),
                output_tokens=self.get(rec, "output_tokens", _is_nat, "an int >= 0"),
                blocks=tuple(base[:keep]) + tuple(BlockId(v) for v in add),
                shared=self.opt(rec, "shared", _is_nat, "an int >= 0", 0),
                join=tuple(BranchId(v) for v in join),
                compaction=self.opt(rec, "compaction", _is_bool, "true or false", False),
                end=self.opt(rec, "end", _is_bool, "true or false", False),
            )
        )
        b.lines.append(self.line)

    def base(self, a: _AgentDraft, b: _BranchDraft) -> Blocks:
        if b.requests:
            return b.requests[-1].blocks
        br = b.branch
        if br.kind is BranchKind.FORK and br.parent is not None and br.after is not None:
            parent = a.branches[br.parent]
            if br.after >= len(parent.requests):
                raise self.fail(
                    "branch",
                    f"fork {br.id!r} starts from request {br.after} of {br.parent!r}, "
                    "which is not above",
                )
            return parent.requests[br.after].blocks
        return ()

    def finish(self, header: dict[str, Any]) -> Trace:
        agents = []
        for a in self.agents.values():
            branches = tuple(
                Branch(
                    id=b.branch.id,
                    kind=b.branch.kind,
                    parent=b.branch.parent,
                    after=b.branch.after,
                    delay=b.branch.delay,
                    requests=tuple(b.requests),
                )
                for b in a.branches.values()
            )
            agents.append(
                Agent(
                    id=a.agent.id,
                    workload=a.agent.workload,
                    namespace=a.agent.namespace,
                    branches=branches,
                    start=a.agent.start,
                    follows=a.agent.follows,
                    prefix=a.agent.prefix,
                    until=a.agent.until,
                )
            )
        trace = Trace(
            name=header["name"],
            block_size=header["block_size"],
            agents=tuple(agents),
            prefixes=dict(header.get("prefixes") or {}),
            meta=dict(header.get("meta") or {}),
        )
        try:
            validate(trace)
        except TraceError as e:
            raise self.fail(e.field, e.reason, line=self.line_of(e)) from None
        return trace

    def line_of(self, e: TraceError) -> int:
        """The line of the record a model error is about."""
        if e.agent is None or e.agent not in self.agents:
            return 1
        a = self.agents[e.agent]
        if e.branch is None or e.branch not in a.branches:
            return a.line
        b = a.branches[e.branch]
        if e.request is None or e.request >= len(b.lines):
            return b.line
        return b.lines[e.request]


def load(path: Path) -> Trace:
    """Reads and validates a trace file; raises `TraceFormatError` (OSError if unreadable)."""
    return _Reader(path).read(read_bytes(path))


def loads(data: bytes, path: Path = Path("<bytes>")) -> Trace:
    return _Reader(path).read(data)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_nat(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _is_pos_int(v: Any) -> bool:
    return _is_int(v) and v > 0


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_list(v: Any) -> bool:
    return isinstance(v, list)


def _is_dict(v: Any) -> bool:
    return isinstance(v, dict)


def _is_seconds(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
