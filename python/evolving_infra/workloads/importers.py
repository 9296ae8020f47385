"""Importers: real traces into the trace model (`model.Trace`).

- Claude Code (kv-cache-tester JSON, one conversation a file): one agent per conversation, its
  main branch the root, each sub-agent a `subagent` branch. Waits are closed-loop gaps rebuilt
  from the recorded times; a request whose prompt diverges early is a compaction.
- Mooncake (FAST'25 JSONL): open-loop, one single-request agent per line, all in one namespace
  (the trace's hash ids are global, so requests share prefixes across lines).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from evolving_infra.workloads.blocks import common_prefix
from evolving_infra.workloads.claude_code import (
    BLOCK_SIZE,
    CcRequest,
    Conversation,
)
from evolving_infra.workloads.errors import TraceFormatError
from evolving_infra.workloads.files import read_bytes
from evolving_infra.workloads.model import (
    I64_MAX,
    I64_MIN,
    Agent,
    AgentId,
    BlockId,
    Branch,
    BranchId,
    BranchKind,
    Request,
    Trace,
    validate,
)

CLAUDE_CODE_PREFIX = "claude-code-system"
# Real Claude Code sessions open with the same ~15k-token system prompt and tool definitions
# (`system_tokens` + `tool_tokens` is 15.0k-16.8k in the bundled traces; the kv-cache-tester
# README says ~15k). As an option, the first 15,000 tokens are modelled as one prefix shared by
# every session: 234 full blocks of 64 tokens.
CLAUDE_CODE_PREFIX_TOKENS = 15_000
# A prompt that keeps less than this share of its branch's previous prompt "diverges early": the
# history was compacted (or edited). Tail edits (thinking blocks dropped, a last message
# rewritten) keep far more than half, compactions far less.
COMPACTION_KEEP_BELOW = 0.5
# A sub-agent is spawned by the parent's last response at or before its start (the start falls
# 0.1-1 s after that response in every bundled trace; this is the slack allowed).
SPAWN_SLACK_S = 5.0
MOONCAKE_BLOCK_SIZE = 512
MOONCAKE_NAMESPACE = "mooncake"


def claude_code_trace(
    conversations: Sequence[Conversation],
    *,
    shared_prefix: bool = False,
    name: str = "claude-code",
) -> Trace:
    """The conversations as one trace, every session starting at t = 0."""
    prefix_blocks = CLAUDE_CODE_PREFIX_TOKENS // BLOCK_SIZE
    agents = tuple(_cc_agent(c, prefix_blocks if shared_prefix else 0) for c in conversations)
    trace = Trace(
        name=name,
        block_size=BLOCK_SIZE,
        agents=agents,
        prefixes={CLAUDE_CODE_PREFIX: prefix_blocks} if shared_prefix else {},
        meta={
            "source": "Claude Code sessions, kv-cache-tester format (Apache-2.0)",
            "files": [c.path.name for c in conversations],
            "shared_prefix_tokens": CLAUDE_CODE_PREFIX_TOKENS if shared_prefix else 0,
        },
    )
    validate(trace)
    return trace


def _response_time(r: CcRequest) -> float:
    """When the request's response ended; without `api_time`, at its start (no better guess)."""
    return r.t + (r.api_time or 0.0)


def _cc_agent(c: Conversation, prefix_blocks: int) -> Agent:
    by_branch: dict[BranchId, list[CcRequest]] = {b: [] for b in c.branches}
    for r in c.requests:
        by_branch[r.branch].append(r)
    subs = {s.branch: s for s in c.subagents}
    # Spawn time, spawning request and end of each sub-agent, from the recorded times.
    starts: dict[BranchId, float] = {}
    spawned_by: dict[BranchId, int | None] = {}
    for s in c.subagents:
        own = by_branch[s.branch]
        finished = s.duration is not None and s.duration > 0 and s.status != "async_launched"
        # NOTE: a finished entry's `t` is its end (see claude_code's module doc): start before it.
        starts[s.branch] = s.marker_t - s.duration if finished and s.duration else s.marker_t
        shift = starts[s.branch] - s.marker_t
        by_branch[s.branch] = [_shifted(r, shift) for r in own]
        latest = starts[s.branch] + SPAWN_SLACK_S
        before = [i for i, p in enumerate(by_branch[s.parent]) if _response_time(p) <= latest]
        spawned_by[s.branch] = before[-1] if before else None
    ends = {b: _response_time(rs[-1]) for b, rs in by_branch.items() if rs}
    # A parent's request after the spawning one joins the sub-agents that finished before it
    # (Claude Code's Task tool returns the sub-agent's result); background ones are not joined.
    joins: dict[tuple[BranchId, int], list[BranchId]] = {}
    for s in c.subagents:
        k = spawned_by[s.branch]
        if s.status == "async_launched" or k is None or k + 1 >= len(by_branch[s.parent]):
            continue
        if ends.get(s.branch, math.inf) <= by_branch[s.parent][k + 1].t + SPAWN_SLACK_S:
            joins.setdefault((s.parent, k + 1), []).append(s.branch)

    branches = []
    for b in c.branches:
        rs = by_branch[b]
        if not rs:
            continue  # a sub-agent entry without requests adds nothing to replay
        sub = subs.get(b)
        kind, after, begin, delay = BranchKind.ROOT, None, 0.0, 0.0
        parent: BranchId | None = None
        if sub is not None:
            kind, parent, after, begin = BranchKind.SUBAGENT, sub.parent, spawned_by[b], starts[b]
            ref = 0.0 if after is None else _response_time(by_branch[sub.parent][after])
            delay = max(0.0, begin - ref)
        requests = []
        first_ids = rs[0].hash_ids
        ready: float = begin
        prev_ids: tuple[int, ...] | None = None
        for i, r in enumerate(rs):
            joined = tuple(j for j in joins.get((b, i), []) if by_branch.get(j))
            if joined:
                ready = max(ready, *(ends[j] for j in joined))
            shared = 0
            if prefix_blocks and kind is BranchKind.ROOT:
                # Up to where the prompt still equals the session's first one: a prompt that
                # diverges inside the system prompt (it was edited) shares only what is equal.
                shared = min(prefix_blocks, common_prefix(first_ids, r.hash_ids))
            compaction = prev_ids is not None and common_prefix(
                prev_ids, r.hash_ids
            ) < COMPACTION_KEEP_BELOW * len(prev_ids)
            requests.append(
                Request(
                    wait=max(0.0, r.t - ready),
                    prompt_tokens=r.input_tokens,
                    output_tokens=r.output_tokens,
                    blocks=tuple(BlockId(h) for h in r.hash_ids[shared:]),
                    shared=shared,
                    join=joined,
                    compaction=compaction,
                    end=i == len(rs) - 1,
                )
            )
            ready, prev_ids = _response_time(r), r.hash_ids
        branches.append(Branch(b, kind, parent, after, delay, tuple(requests)))
    return Agent(
        id=AgentId(c.id),
        workload="claude-code",
        namespace=c.id,
        branches=tuple(branches),
        prefix=CLAUDE_CODE_PREFIX if prefix_blocks else None,
    )


def _shifted(r: CcRequest, by: float) -> CcRequest:
    return replace(r, t=r.t + by)


def mooncake_trace(path: Path, *, name: str | None = None) -> Trace:
    """A Mooncake FAST'25 JSONL trace (`timestamp` ms, `input_length`, `output_length`,
    `hash_ids` of 512-token blocks, global): each line an agent arriving at its timestamp."""
    data = read_bytes(path)
    agents = []
    for n, raw in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not raw.strip():
            continue
        rec = _mooncake_record(path, n, raw)
        blocks = tuple(BlockId(h) for h in rec["hash_ids"])
        request = Request(
            wait=0.0,
            prompt_tokens=rec["input_length"],
            output_tokens=rec["output_length"],
            blocks=blocks,
            end=True,
        )
        if len(blocks) != -(-request.prompt_tokens // MOONCAKE_BLOCK_SIZE):
            raise TraceFormatError(
                path,
                "hash_ids",
                f"{len(blocks)} blocks for {request.prompt_tokens} tokens "
                f"(expected ceil(input_length / {MOONCAKE_BLOCK_SIZE}))",
                line=n,
            )
        root = Branch(BranchId("root"), BranchKind.ROOT, requests=(request,))
        agents.append(
            Agent(
                id=AgentId(f"r{n}"),
                workload="mooncake",
                namespace=MOONCAKE_NAMESPACE,
                branches=(root,),
                start=rec["timestamp"] / 1000,
            )
        )
    if not agents:
        raise TraceFormatError(path, None, "no requests")
    trace = Trace(
        name=name or path.name.split(".")[0],
        block_size=MOONCAKE_BLOCK_SIZE,
        agents=tuple(agents),
        meta={"source": "Mooncake FAST'25 trace (Apache-2.0)", "file": path.name},
    )
    validate(trace)
    return trace


def _mooncake_record(path: Path, line: int, raw: str) -> dict[str, Any]:
    try:
        rec = json.loads(raw)
    except json.JSONDecodeError as e:
        raise TraceFormatError(path, None, f"not JSON: {e.msg}", line=line) from None
    if not isinstance(rec, dict):
        raise TraceFormatError(path, None, "expected a JSON object", line=line)
    for key in ("timestamp", "input_length", "output_length"):
        v = rec.get(key)
        if key not in rec:
            raise TraceFormatError(path, key, "missing", line=line)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise TraceFormatError(path, key, f"expected a number >= 0, got {v!r}", line=line)
        if key != "timestamp" and not isinstance(v, int):
            raise TraceFormatError(path, key, f"expected an int, got {v!r}", line=line)
    ids = rec.get("hash_ids")
    if not isinstance(ids, list):
        raise TraceFormatError(path, "hash_ids", "expected a list of ints", line=line)
    for j, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or not I64_MIN <= h <= I64_MAX:
            raise TraceFormatError(
                path, f"hash_ids[{j}]", f"expected a 64-bit int, got {h!r}", line=line
            )
    return rec
