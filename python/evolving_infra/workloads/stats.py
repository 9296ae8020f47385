"""Statistics of trace files: request and token counts, waits, and h*, the ideal KV hit rate.

Three input kinds, told apart by suffix and first line (`detect`):
- `claude-code`: the raw Claude Code format (`.json`, `.json.gz`, `.json.xz`, one conversation a
  file, read with `claude_code.load_conversation`);
- `trace`: our format (`.jsonl[.gz|.xz]` whose first line has `"format": "evolving-infra-trace"`);
- `mooncake`: a Mooncake FAST'25 trace (`.jsonl[.gz|.xz]` whose first line has `timestamp` and
  `hash_ids`), read as `importers.mooncake_trace` imports it.

Definitions, per file and in total (the total sums the counts over files, so its ratios are
ratios of sums, never means of per-file ratios):
- `requests`, `prompt_tokens`, `output_tokens`: sums over all requests (sub-agents included).
- `prompt_blocks`: blocks of each prompt: a Claude Code request's `hash_ids` (full 64-token
  blocks), a model request's `Request.prompt_blocks` (shared prefix + own; a Mooncake prompt's
  partial last block counts).
- `ideal_hit_blocks`, `ideal_hit_rate` (h*): one infinite cache per file, replayed in order. A
  request's hits are its leading prompt blocks that each appeared, in any position, in an earlier
  request of the same file; counting stops at the first block never seen. h* = hits / prompt
  blocks. The order and the block identity depend on the kind:
  - Claude Code: the conversation's requests and its sub-agents' merged by their literal times
    (a sub-agent request's time is its entry's `t` plus its own `t`), ties in file order (a
    parent before its sub-agent): exactly `Conversation.requests`. Blocks are the raw
    `hash_ids`, which are scoped to the file.
  - our format and Mooncake: the whole file in nominal replay order (`timeline.trace_timeline`),
    blocks identified by their directory hashes (`blocks.PromptHasher`), so prefixes shared
    across agents (a common system prompt, Mooncake's global ids) count as hits.
- `prefill_decode_ratio`: prompt tokens / output tokens; `uncached_prefill_decode_ratio`: the
  prompt tokens h* leaves to prefill, sum over requests of max(0, prompt tokens - hits x
  block_size), over output tokens (`uncached_prompt_tokens` is that numerator). None (JSON null)
  when there are no output tokens.
- `wait_p50`, `wait_p90`, `wait_p99`: percentiles (linear interpolation between order
  statistics, as numpy's default) of the seconds a request waits before it is issued: Claude
  Code's `think_time` where the file records it, a model request's `wait` otherwise (Mooncake's
  are all 0: it is open-loop, arrivals are agent starts). None when no request has one.
- `agents`, `branches`, `subagents`, `forks`, `compactions`: counted on the model: for a Claude
  Code file, on what `importers.claude_code_trace` makes of it (one agent; branches with at least
  one request; a compaction is a prompt keeping less than half of its branch's previous one).
- `block_size` (tokens; None in a total over different sizes) and `kind` ("mixed" likewise).
"""

from __future__ import annotations

import gzip
import json
import lzma
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from evolving_infra.workloads import jsonl
from evolving_infra.workloads.blocks import PromptHasher, known_prefix
from evolving_infra.workloads.claude_code import (
    BLOCK_SIZE,
    TRACE_SUFFIXES,
    Conversation,
    load_conversation,
)
from evolving_infra.workloads.errors import TraceFormatError
from evolving_infra.workloads.importers import claude_code_trace, mooncake_trace
from evolving_infra.workloads.model import BranchKind, Trace
from evolving_infra.workloads.timeline import trace_timeline

Kind = Literal["claude-code", "trace", "mooncake"]
PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class Stats:
    """Counts of one file (or a total over files); `to_dict` adds the derived ratios."""

    kind: str
    block_size: int | None
    requests: int = 0
    agents: int = 0
    branches: int = 0
    subagents: int = 0
    forks: int = 0
    compactions: int = 0
    prompt_blocks: int = 0
    ideal_hit_blocks: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    uncached_prompt_tokens: int = 0
    waits: list[float] = field(default_factory=list, repr=False)

    def add_request(self, prompt_tokens: int, output_tokens: int, blocks: int, hits: int) -> None:
        assert self.block_size is not None, "a file's stats have one block size"
        self.requests += 1
        self.prompt_blocks += blocks
        self.ideal_hit_blocks += hits
        self.prompt_tokens += prompt_tokens
        self.output_tokens += output_tokens
        self.uncached_prompt_tokens += max(0, prompt_tokens - hits * self.block_size)

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the counts, the ratios and the wait percentiles."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "block_size": self.block_size,
            "requests": self.requests,
            "agents": self.agents,
            "branches": self.branches,
            "subagents": self.subagents,
            "forks": self.forks,
            "compactions": self.compactions,
            "prompt_blocks": self.prompt_blocks,
            "ideal_hit_blocks": self.ideal_hit_blocks,
            "ideal_hit_rate": self.ideal_hit_rate,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "uncached_prompt_tokens": self.uncached_prompt_tokens,
            "prefill_decode_ratio": _ratio(self.prompt_tokens, self.output_tokens),
            "uncached_prefill_decode_ratio": _ratio(
                self.uncached_prompt_tokens, self.output_tokens
            ),
        }
        ordered = sorted(self.waits)
        for q in PERCENTILES:
            out[f"wait_p{q}"] = percentile(ordered, q)
        return out


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """The q-th percentile of sorted values, interpolated linearly; None when there are none."""
    if not ordered:
        return None
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class IdealCache:
    """h*'s one infinite cache: a prompt hits its leading blocks that were all seen before.

    The one definition of h* for `trace stats`, the simulator (`sim/metrics.py`) and the live
    replayer (`replay/summary.py`). With `chained` ids (directory hashes, where a block's hash
    fixes its whole prefix) the seen blocks of a prompt are a prefix of it, found by bisection:
    the simulator adds every prefill's prompt, thousands of blocks long. Raw ids (a Claude Code
    file's `hash_ids`) are scanned from the start.
    """

    def __init__(self, chained: bool = True) -> None:
        self.chained = chained
        self.seen: set[int] = set()
        self.hits = 0
        self.blocks = 0

    def add(self, blocks: Sequence[int]) -> int:
        """Counts one prompt; returns its hits."""
        seen = self.seen
        if self.chained:
            lo = known_prefix(blocks, seen)
            seen.update(blocks[lo:])
        else:
            lo = 0
            while lo < len(blocks) and blocks[lo] in seen:
                lo += 1
            seen.update(blocks)
        self.hits += lo
        self.blocks += len(blocks)
        return lo

    @property
    def rate(self) -> float | None:
        return self.hits / self.blocks if self.blocks else None


def conversation_stats(c: Conversation) -> Stats:
    """Stats of one Claude Code conversation (h* over raw `hash_ids`, literal time order)."""
    s = Stats(kind="claude-code", block_size=BLOCK_SIZE)
    cache = IdealCache(chained=False)
    for r in c.requests:
        hits = cache.add(r.hash_ids)
        s.add_request(r.input_tokens, r.output_tokens, len(r.hash_ids), hits)
        if r.think_time is not None:
            s.waits.append(r.think_time)
    _count_structure(s, claude_code_trace([c]))
    return s


def trace_stats(trace: Trace, kind: str = "trace") -> Stats:
    """Stats of a model trace (h* over directory hashes, nominal replay order)."""
    s = Stats(kind=kind, block_size=trace.block_size)
    cache = IdealCache()
    hasher = PromptHasher(trace)
    branches = {(a.id, b.id): b for a in trace.agents for b in a.branches}
    for x in trace_timeline(trace):
        r = x.request
        hashes = hasher.hashes(x.agent, branches[(x.agent.id, x.branch)], r)
        s.add_request(r.prompt_tokens, r.output_tokens, r.prompt_blocks, cache.add(hashes))
        s.waits.append(r.wait)
    _count_structure(s, trace)
    return s


def _count_structure(s: Stats, trace: Trace) -> None:
    for a in trace.agents:
        s.agents += 1
        for b in a.branches:
            s.branches += 1
            s.subagents += b.kind is BranchKind.SUBAGENT
            s.forks += b.kind is BranchKind.FORK
            s.compactions += sum(r.compaction for r in b.requests)


def total(stats: Iterable[Stats]) -> Stats:
    """The sum of per-file stats (waits pooled; ratios then come from the sums)."""
    items = list(stats)
    kinds = {s.kind for s in items}
    sizes = {s.block_size for s in items}
    out = Stats(
        kind=kinds.pop() if len(kinds) == 1 else "mixed",
        block_size=sizes.pop() if len(sizes) == 1 else None,
    )
    for s in items:
        for name in _SUMMED:
            setattr(out, name, getattr(out, name) + getattr(s, name))
        out.waits.extend(s.waits)
    return out


_SUMMED = (
    *("requests", "agents", "branches", "subagents", "forks", "compactions", "prompt_blocks"),
    *("ideal_hit_blocks", "prompt_tokens", "output_tokens", "uncached_prompt_tokens"),
)


# ---- files ----------------------------------------------------------------------------------


def is_stats_file(path: Path) -> bool:
    """Whether the name is one of a kind `detect` tells apart (by suffix alone)."""
    return path.name.endswith(TRACE_SUFFIXES) or jsonl.is_trace_file(path)


def find_files(paths: Iterable[Path]) -> list[Path]:
    """Files as given; folders expanded (recursively, sorted) to the trace files inside."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and is_stats_file(p)))
        else:
            files.append(path)
    return files


def detect(path: Path) -> Kind:
    """The file's kind, from its suffix and (for JSON Lines) its first line.

    A JSON Lines file is Mooncake's when its first record has `timestamp` and `hash_ids` and no
    `format`; anything else is ours, so that our reader reports what is wrong with it.
    """
    if path.name.endswith(TRACE_SUFFIXES):
        return "claude-code"
    if not jsonl.is_trace_file(path):
        suffixes = ", ".join((*TRACE_SUFFIXES, *jsonl.SUFFIXES))
        raise TraceFormatError(path, None, f"not a trace file name (expected {suffixes})")
    try:
        rec = json.loads(_first_line(path))
    except (json.JSONDecodeError, UnicodeDecodeError, lzma.LZMAError, gzip.BadGzipFile, EOFError):
        return "trace"
    if isinstance(rec, dict) and "format" not in rec and {"timestamp", "hash_ids"} <= set(rec):
        return "mooncake"
    return "trace"


def _first_line(path: Path) -> str:
    """The first line that is not blank; "" if there is none."""
    # Only the head of the file: the reader of its kind reads all of it afterwards.
    with _open_text(path) as f:
        for line in f:
            if line.strip():
                return line
    return ""


def _open_text(path: Path) -> IO[str]:
    if path.name.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def load_file(path: Path) -> tuple[Kind, Trace | Conversation]:
    """Reads and validates a file of any kind; raises `TraceFormatError` (OSError if unreadable)."""
    kind = detect(path)
    if kind == "claude-code":
        return kind, load_conversation(path)
    if kind == "trace":
        return kind, jsonl.load(path)
    return kind, mooncake_trace(path)


def validate_file(path: Path) -> tuple[Kind, int]:
    """Reads and checks a file of any kind, model traces replayed too; returns kind, requests."""
    kind, loaded = load_file(path)
    if isinstance(loaded, Conversation):
        return kind, len(loaded.requests)
    with _replay_errors(path):
        trace_timeline(loaded)
    return kind, loaded.request_count


def file_stats(path: Path) -> Stats:
    """Stats of one file of any kind."""
    kind, loaded = load_file(path)
    if isinstance(loaded, Conversation):
        return conversation_stats(loaded)
    with _replay_errors(path):
        return trace_stats(loaded, kind=kind)


@contextmanager
def _replay_errors(path: Path) -> Iterator[None]:
    # The format's checks are per record: requests joining each other's branches in a cycle
    # only show when the trace is replayed (`timeline` raises a plain ValueError).
    try:
        yield
    except TraceFormatError:
        raise
    except ValueError as e:
        raise TraceFormatError(path, "join", str(e)) from None
