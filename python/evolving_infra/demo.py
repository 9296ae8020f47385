"""`evolving-infra demo`: replay real Claude Code sessions into a KvDirectory on a toy cluster.

Every bundled conversation starts at t = 0 and they run concurrently; each request is routed to
one of N nodes, which serves its cached prefix from L1 (GPU) or L2 (host) and stores the rest.
Nodes have fixed L1 and L2 capacities in blocks; eviction goes through the directory's own order
(blocks no live branch needs first, then least recently used) and L1 evictions are demoted to
L2. No timing model: requests take no time, so the figures are about cache placement only.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, cast

import structlog
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from evolving_infra import KvDirectory
from evolving_infra.argtypes import natural_int, positive_int
from evolving_infra.workloads import (
    BlockHash,
    CcRequest,
    Conversation,
    TraceFormatError,
    bundled_trace_dir,
    find_trace_files,
    load_conversation,
    merge_by_time,
)

NAME = "demo"
HELP = "replay the bundled Claude Code traces into a KV directory on a simulated cluster"
DESCRIPTION = """\
Replays real Claude Code sessions (the bundled traces, or --traces) into one KvDirectory on a
simulated cluster. All conversations start at t = 0 and run concurrently; each request goes to
the node holding the longest prefix of its prompt (ties: the one with the least recent load), hits
what that node holds in L1 (GPU) or L2 (host), and stores the rest in L1. When L1 is full the
directory's eviction order (blocks no live branch needs first, then least recently used) picks
what is demoted to L2; when L2 is full, what is dropped. Requests take no time.

Prints, per node, the prompt blocks served from L1 and from L2, and compares the cluster's hit
rate h with h*, the hit rate of one infinite cache shared by all nodes: lost KV reuse = 1 - h/h*.
Options may also come from a TOML file (--config); its keys are the option names
(e.g. `l1-blocks = 8192`), and flags given on the command line override it."""

LOAD_HALF_LIFE_S = 60.0
log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class DemoConfig:
    nodes: int = 4
    # 128k tokens of L1 and 3x that of L2 per node: small enough that 24 concurrent agents
    # evict (lost reuse ~4% on the bundled traces), large enough that most reuse survives.
    l1_blocks: int = 2048
    l2_blocks: int = 6144
    traces: tuple[Path, ...] = ()  # files or folders; empty: the bundled traces
    limit_files: int | None = None
    seed: int = 0


@dataclass(slots=True)
class NodeState:
    """One node's caches as the demo drives them, mirrored in the directory."""

    # NOTE: L1 is prefix-closed (whole chains are stored, leaves evicted first), so a match's
    # l1 figure is everything of that chain the node holds in L1 and a count suffices; L2 is
    # not (a demoted block's parent may still be in L1), so it needs the set.
    l1_held: int = 0
    l2: set[BlockHash] = field(default_factory=set)
    load: float = 0.0  # blocks prefilled recently, decayed with LOAD_HALF_LIFE_S
    load_t: float = 0.0
    requests: int = 0
    prompt_blocks: int = 0
    l1_hits: int = 0
    l2_hits: int = 0


class Cluster:
    """N nodes sharing one KvDirectory; `serve` replays one request."""

    def __init__(self, config: DemoConfig) -> None:
        self.config = config
        self.directory = KvDirectory()
        self.nodes = [NodeState() for _ in range(config.nodes)]
        self.rng = random.Random(config.seed)
        # Every block ever seen: the ideal cache (one infinite cache shared by all nodes).
        self.seen: set[BlockHash] = set()
        self.ideal_hits = 0
        self.evicted = {"L1": 0, "L2": 0}

    def serve(self, r: CcRequest) -> None:
        blocks = r.blocks
        self.ideal_hits += self._seen_before(blocks)
        held = self.directory.match(blocks).nodes
        node = self._route(held, r.t)
        l1, l12 = held.get(node, (0, 0))
        state = self.nodes[node]
        state.requests += 1
        state.prompt_blocks += len(blocks)
        state.l1_hits += l1
        state.l2_hits += l12 - l1
        state.load = self._load(state, r.t) + len(blocks) - l12
        state.load_t = r.t
        if blocks:
            # Store what L1 lacks; its parent, the last L1 hit, is held, hence known (with no L1
            # hit this is the whole chain from its first page). Blocks also in L2 keep that copy
            # (an inclusive hierarchy, like a write-through host cache). touch refreshes the rest.
            parent = blocks[l1 - 1] if l1 else None
            self.directory.store(node, "L1", blocks[l1:], parent=parent, now=r.t)
            self.directory.touch(node, blocks, now=r.t)
            self.directory.branch_set(r.branch, blocks)
            state.l1_held += len(blocks) - l1
        if r.last_in_branch:
            self.directory.branch_end(r.branch)
        self._enforce(node, r.t)

    def _seen_before(self, blocks: Sequence[BlockHash]) -> int:
        # NOTE: a hash determines its prefix, so the blocks seen before form a prefix of the
        # chain: binary search for its end, then record the new blocks.
        lo, hi = 0, len(blocks)
        while lo < hi:
            mid = (lo + hi) // 2
            if blocks[mid] in self.seen:
                lo = mid + 1
            else:
                hi = mid
        self.seen.update(blocks[lo:])
        return lo

    def _load(self, state: NodeState, now: float) -> float:
        return state.load * math.exp2((state.load_t - now) / LOAD_HALF_LIFE_S)

    def _route(self, held: dict[int, tuple[int, int]], now: float) -> int:
        # Longest cached prefix (L1 or L2) first: without a timing model a miss costs a full
        # prefill of a ~100k-token prompt, which dwarfs any queueing this demo could model.
        # Recent load only breaks ties, which is exactly where new conversations, sub-agents
        # with a fresh prefix and fully evicted ones land: it spreads them over the nodes
        # instead of piling them onto node 0. (Real TTFT-balancing routing is DESIGN §3.)
        def key(n: int) -> tuple[int, float, float]:
            return held.get(n, (0, 0))[1], -self._load(self.nodes[n], now), self.rng.random()

        return max(range(len(self.nodes)), key=key)

    def _enforce(self, node: int, now: float) -> None:
        state = self.nodes[node]
        over = state.l1_held - self.config.l1_blocks
        if over > 0:
            if self.config.l2_blocks > 0:
                # HiCache-style write-back: what leaves L1 is held in the node's L2.
                evicted = cast(list[BlockHash], self.directory.demote(node, over, now)[0])
                state.l2.update(evicted)
            else:
                evicted = cast(list[BlockHash], self.directory.evict(node, "L1", over))
            state.l1_held -= len(evicted)
            self.evicted["L1"] += len(evicted)
        over = len(state.l2) - self.config.l2_blocks
        if over > 0:
            dropped = self.directory.evict(node, "L2", over)
            state.l2.difference_update(dropped)
            self.evicted["L2"] += len(dropped)


def load(config: DemoConfig) -> list[Conversation]:
    paths = list(config.traces) or [bundled_trace_dir()]
    if not config.traces and not paths[0].is_dir():
        raise FileNotFoundError(f"no bundled traces at {paths[0]}; name them with --traces")
    files = find_trace_files(paths)[: config.limit_files]
    if not files:
        names = ", ".join(map(str, paths))
        raise FileNotFoundError(f"no trace files in {names}; name them with --traces")
    conversations: list[Conversation] = []
    first: dict[str, Path] = {}
    for path in files:
        c = load_conversation(path)
        if c.id in first:
            raise TraceFormatError(path, "id", f"conversation {c.id!r} is also in {first[c.id]}")
        first[c.id] = path
        conversations.append(c)
    return conversations


def replay(config: DemoConfig) -> dict[str, Any]:
    """Run the demo; returns its figures (what --json prints)."""
    conversations = load(config)
    total = sum(len(c.requests) for c in conversations)
    log.info("demo.loaded", conversations=len(conversations), requests=total)
    cluster = Cluster(config)
    started = time.perf_counter()
    console = Console(stderr=True)
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("replaying", total=total)
        for i, r in enumerate(merge_by_time(conversations)):
            cluster.serve(r)
            if i % 64 == 0:
                progress.update(task, completed=i + 1)
    elapsed = time.perf_counter() - started
    log.info("demo.replayed", seconds=round(elapsed, 2))

    nodes = [
        {"node": n} | _counts(s.requests, s.prompt_blocks, s.l1_hits, s.l2_hits)
        for n, s in enumerate(cluster.nodes)
    ]
    totals = _counts(*(sum(row[k] for row in nodes) for k in _COUNTS))
    h, h_star = totals["hit_rate"], _ratio(cluster.ideal_hits, totals["prompt_blocks"])
    stats = cluster.directory.stats()
    assert stats["locations_l1"] == sum(s.l1_held for s in cluster.nodes)
    assert stats["locations_l2"] == sum(len(s.l2) for s in cluster.nodes)
    stats["bytes_per_block"] = stats["memory_bytes"] // max(stats["blocks"], 1)
    return {
        "config": asdict(config) | {"traces": [str(p) for p in config.traces]},
        "conversations": len(conversations),
        "nodes": nodes,
        "total": totals,
        "ideal_hit_rate": h_star,
        "lost_kv_reuse": 1.0 - h / h_star if h_star > 0 else 0.0,
        "evicted_blocks": dict(cluster.evicted),
        "directory": stats,
        "replay_seconds": round(elapsed, 3),
    }


_COUNTS = ("requests", "prompt_blocks", "l1_hits", "l2_hits")


def _counts(requests: int, prompt_blocks: int, l1_hits: int, l2_hits: int) -> dict[str, Any]:
    counts = dict(zip(_COUNTS, (requests, prompt_blocks, l1_hits, l2_hits), strict=True))
    return counts | {"hit_rate": _ratio(l1_hits + l2_hits, prompt_blocks)}


def _ratio(a: int, b: int) -> float:
    return a / b if b else 0.0


def render(result: dict[str, Any], console: Console) -> None:
    t = result["total"]
    n = result["conversations"]
    title = f"KV hits per node ({n} conversation{'s' * (n != 1)}, 64-token blocks)"
    table = Table(title=title)
    for col in ("node", "requests", "prompt blocks", "L1 hits", "L2 hits", "hit rate"):
        table.add_column(col, justify="right")
    for row in [*result["nodes"], t | {"node": "all"}]:
        cells = [f"{row[k]:,}" for k in _COUNTS]
        last = row is result["nodes"][-1]
        rate = f"{row['hit_rate']:.1%}" if row["prompt_blocks"] else "-"
        table.add_row(str(row["node"]), *cells, rate, end_section=last)
    console.print(table)
    d, ev = result["directory"], result["evicted_blocks"]
    summary = Table(show_header=False, box=None)
    summary.add_column(justify="right", style="bold")
    summary.add_column()
    for value, text in [
        (f"{t['hit_rate']:.1%}", "h: KV hit rate (L1 + L2 hits / prompt blocks)"),
        (f"{result['ideal_hit_rate']:.1%}", "h*: one infinite cache shared by all nodes"),
        (f"{result['lost_kv_reuse']:.1%}", "lost KV reuse, 1 - h/h*"),
        (f"{d['blocks']:,}", f"directory blocks ({d['locations']:,} locations)"),
        (
            f"{d['memory_bytes'] / 2**20:.1f} MiB",
            f"directory memory ({d['bytes_per_block']} B/block)",
        ),
        (f"{ev['L1']:,} / {ev['L2']:,}", "blocks evicted from L1 / L2"),
        (f"{result['replay_seconds']:.1f} s", "replay time"),
    ]:
        summary.add_row(value, text)
    console.print(summary)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    numbers: list[tuple[str, Callable[[str], int], str]] = [
        ("--nodes", positive_int, "nodes in the cluster"),
        ("--l1-blocks", positive_int, "L1 (GPU) capacity per node, in 64-token blocks"),
        ("--l2-blocks", natural_int, "L2 (host) capacity per node, in blocks (0: no L2)"),
        ("--seed", int, "seed for routing ties"),
    ]
    for flag, kind, text in numbers:
        default = getattr(d, flag[2:].replace("-", "_"))
        parser.add_argument(
            flag, type=kind, default=default, metavar="N", help=f"{text} (default %(default)s)"
        )
    parser.add_argument(
        "--traces",
        type=Path,
        nargs="+",
        default=[],
        metavar="PATH",
        help="trace files or folders (default: the bundled data/traces/claude-code)",
    )
    parser.add_argument(
        "--limit-files",
        type=positive_int,
        metavar="N",
        help="replay only the first N trace files (sorted by name)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")


def run(args: argparse.Namespace) -> int:
    values = {f.name: getattr(args, f.name) for f in fields(DemoConfig)}
    result = replay(DemoConfig(**values | {"traces": tuple(args.traces)}))
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        render(result, Console())
    return 0
