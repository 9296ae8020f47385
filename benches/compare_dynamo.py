"""Side-by-side: our `KvDirectory` against NVIDIA Dynamo's `RadixTree` (ai-dynamo-runtime 1.6.1).

What it models: a KV-aware router's index under the shared workload of `workload.py` (notes
`dynamo-kv-router.md` §4.1): 64 workers, 2,000 store events of ≈84 blocks (100-block sequences
sharing random prefixes), 10,000 100-block prefix queries, 20,000 single-block appends, then
leaf-first removal of everything. Both systems see the same blocks: Dynamo gets JSON `KvCacheEvent`s
(`block_hash` = the sequence hash, `tokens_hash` = the block's content id) and is queried with the
content ids; we get the signed view of the same sequence hashes, as Python lists, with parents.

Per operation it times one call as a user makes it, in the same process, on one pinned core:
- floor: an empty query (`d.match([]).l12` vs `t.find_matches([]).scores`);
- insert: `d.store(w, "L1", hashes, parent)` vs `t.apply_event(w, json_bytes)` (JSON is encoded
  before the timed region), into an index growing from empty (each new page of memory a page
  fault, ~4 µs on a VM);
- insert, warm: the same stores again once everything was removed, into memory both systems
  have already used (what a router's index sees in steady state, where engines evict as fast
  as they store);
- match: `d.match(hashes).l12` (the per-node prefix lengths as numpy arrays) vs
  `t.find_matches(tokens).scores`; every query's per-worker counts are checked to be equal;
- append (1 block) and remove (one call per original store/append event, leaf first; also split
  into the 1-block undos of the appends and the ≈84-block chains);
- match vs sharing width (notes §4.2): W = 1..1,024 workers hold one 100-block chain, full hit.
The index is checked to be empty in both systems after the removals. Figures are per-call
medians and p99 in µs over all calls of a phase, with the cyclic GC off during timed loops.
Memory per block is the RSS delta of a fresh subprocess per system and case: A = 1M blocks as
10k disjoint 100-block chains on 1 worker, B = 100k blocks held by 16 workers each.

Run: `make bench-dynamo` (= `OPENBLAS_NUM_THREADS=1 .venv/bin/python benches/compare_dynamo.py`:
numpy's BLAS threads, pinned to the same core, would otherwise spin beside the timed loops).
Options: --seed, --queries, --quick (smaller sizes, a smoke run), --json OUT (all figures),
--no-pin (do not pin the process, Dynamo's tree thread included, to one core; unpinned, Dynamo
pays a thread wake-up per call).

Dynamo's binding comes with the project's `bench` extra (`pip install -e '.[bench]'`; `make
venv` installs it): ai-dynamo-runtime 1.6.1, whose own requirements are only pydantic and uvloop.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from workload import (
    Chain,
    FreshBlocks,
    StoreEvent,
    Workload,
    dynamo_remove_json,
    dynamo_store_json,
    generate,
    reference_match,
)

INSTALL_DYNAMO = (
    "Dynamo's Python binding is not importable\n"
    "(`from dynamo.llm import RadixTree` failed: {err}).\n"
    "Install the project's `bench` extra (ai-dynamo-runtime 1.6.1) into its virtualenv:\n"
    "  .venv/bin/pip install -e '.[bench]'\n"
    "(the wheel is manylinux x86-64, CPython >= 3.10; it needs no GPU, NATS or etcd)."
)
BUILD_OURS = (
    "The native module is not importable\n"
    "(`from evolving_infra import KvDirectory` failed: {err}).\n"
    "Build it first: `cd {root} && .venv/bin/maturin develop --release`."
)
ROOT = Path(__file__).resolve().parent.parent

#: The workloads' shapes (`workload.generate`'s arguments). `shared` is notes §4.1's; `forks` has
#: other chain lengths, fan-out and sharing: agents forking long shared histories over more workers.
WORKLOADS: dict[str, dict[str, Any]] = {
    "shared": {
        "n_workers": 64,
        "n_sequences": 2_000,
        "seq_len": 100,
        "n_queries": 10_000,
        "n_appends": 20_000,
    },
    "forks": {
        "n_workers": 256,
        "n_sequences": 800,
        "seq_len": 300,
        "n_queries": 5_000,
        "n_appends": 10_000,
        "share": (0.6, 1.0),
    },
}


def load_radix_tree() -> Any:
    """Dynamo's `RadixTree` class, or exit with install instructions."""
    try:
        from dynamo.llm import RadixTree
    except ImportError as err:
        print(INSTALL_DYNAMO.format(err=err), file=sys.stderr)
        raise SystemExit(2) from err
    return RadixTree


def load_kv_directory() -> Any:
    """Our `KvDirectory` class, or exit with build instructions."""
    try:
        from evolving_infra import KvDirectory
    except ImportError as err:
        print(BUILD_OURS.format(err=err, root=ROOT), file=sys.stderr)
        raise SystemExit(2) from err
    return KvDirectory


def dynamo_version() -> str:
    try:
        from importlib.metadata import version

        return version("ai-dynamo-runtime")
    except Exception:  # pragma: no cover - metadata missing
        return "?"


# --- pinning and measuring -----------------------------------------------------------------------


def pin_all_threads(cpu: int) -> int:
    """Pin every thread of this process (Dynamo's tree thread included) to `cpu`; return count."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
            n += 1
        except OSError:  # thread exited meanwhile
            pass
    return n


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@dataclass(frozen=True)
class Stat:
    calls: int
    blocks: int
    median_us: float
    p99_us: float
    mean_us: float
    calls_per_s: float
    blocks_per_s: float


def stat(ns: Sequence[int], blocks: int) -> Stat:
    a = np.asarray(ns, dtype=np.float64) / 1e3
    total_s = float(a.sum()) / 1e6
    return Stat(
        calls=len(a),
        blocks=blocks,
        median_us=float(np.median(a)),
        p99_us=float(np.percentile(a, 99)),
        mean_us=float(a.mean()),
        calls_per_s=len(a) / total_s if total_s else 0.0,
        blocks_per_s=blocks / total_s if total_s else 0.0,
    )


# --- the two systems -----------------------------------------------------------------------------


@dataclass
class Inputs:
    """Everything both systems are fed, prepared outside the timed regions."""

    # ours: (node, hashes as a list of signed ints, parent)
    ours_stores: list[tuple[int, list[int], int | None]]
    ours_queries: list[list[int]]
    ours_appends: list[tuple[int, list[int], int | None]]
    ours_removes: list[tuple[int, list[int]]]
    # Dynamo: (worker, JSON bytes) and queries as content-id lists
    dyn_stores: list[tuple[int, bytes]]
    dyn_queries: list[list[int]]
    dyn_appends: list[tuple[int, bytes]]
    dyn_removes: list[tuple[int, bytes]]


def ours_store_args(e: StoreEvent) -> tuple[int, list[int], int | None]:
    return (e.worker, e.blocks.signed_hashes(), e.signed_parent)


def prepare(w: Workload) -> Inputs:
    event_id = 0

    def dyn_store(e: StoreEvent) -> tuple[int, bytes]:
        nonlocal event_id
        event_id += 1
        return (e.worker, dynamo_store_json(event_id, e))

    stores = [dyn_store(e) for e in w.stores]
    appends = [dyn_store(e) for e in w.appends]
    removes: list[tuple[int, bytes]] = []
    for r in w.removals:
        event_id += 1
        removes.append((r.worker, dynamo_remove_json(event_id, r)))
    return Inputs(
        ours_stores=[ours_store_args(e) for e in w.stores],
        ours_queries=[q.signed_hashes() for q in w.queries],
        ours_appends=[ours_store_args(e) for e in w.appends],
        ours_removes=[(r.worker, Chain(r.hashes, r.hashes).signed_hashes()) for r in w.removals],
        dyn_stores=stores,
        dyn_queries=[list(q.tokens) for q in w.queries],
        dyn_appends=appends,
        dyn_removes=removes,
    )


class DynamoRunner:
    def __init__(self, radix_tree_cls: Any) -> None:
        self.t = radix_tree_cls()

    def warmup(self, n: int) -> None:
        fm = self.t.find_matches
        empty: list[int] = []
        for _ in range(n):
            fm(empty).scores  # noqa: B018

    def apply(self, events: list[tuple[int, bytes]]) -> list[int]:
        ap = self.t.apply_event
        pc = time.perf_counter_ns
        out = [0] * len(events)
        for i, (w, b) in enumerate(events):
            t0 = pc()
            ap(w, b)
            out[i] = pc() - t0
        return out

    def floor(self, n: int) -> list[int]:
        fm = self.t.find_matches
        pc = time.perf_counter_ns
        empty: list[int] = []
        out = [0] * n
        for i in range(n):
            t0 = pc()
            fm(empty).scores  # noqa: B018
            out[i] = pc() - t0
        return out

    def match(self, queries: list[list[int]]) -> tuple[list[int], list[dict[int, int]]]:
        fm = self.t.find_matches
        pc = time.perf_counter_ns
        out = [0] * len(queries)
        res: list[Any] = [None] * len(queries)
        for i, q in enumerate(queries):
            t0 = pc()
            s = fm(q).scores
            out[i] = pc() - t0
            res[i] = s
        return out, [{w: c for (w, _dp), c in s.items()} for s in res]

    def is_empty(self) -> bool:
        return len(self.t.dump_tree_as_events()) == 0


class OursRunner:
    def __init__(self, kv_directory_cls: Any) -> None:
        self.d = kv_directory_cls()

    def warmup(self, n: int) -> None:
        m = self.d.match
        empty: list[int] = []
        for _ in range(n):
            m(empty).l12  # noqa: B018

    def store(self, events: list[tuple[int, list[int], int | None]]) -> list[int]:
        st = self.d.store
        pc = time.perf_counter_ns
        out = [0] * len(events)
        for i, (w, hs, p) in enumerate(events):
            t0 = pc()
            st(w, "L1", hs, p)
            out[i] = pc() - t0
        return out

    def remove(self, events: list[tuple[int, list[int]]]) -> list[int]:
        rm = self.d.remove
        pc = time.perf_counter_ns
        out = [0] * len(events)
        for i, (w, hs) in enumerate(events):
            t0 = pc()
            rm(w, "L1", hs)
            out[i] = pc() - t0
        return out

    def floor(self, n: int) -> list[int]:
        m = self.d.match
        pc = time.perf_counter_ns
        empty: list[int] = []
        out = [0] * n
        for i in range(n):
            t0 = pc()
            m(empty).l12  # noqa: B018
            out[i] = pc() - t0
        return out

    def match(self, queries: list[list[int]]) -> tuple[list[int], list[dict[int, int]]]:
        m = self.d.match
        pc = time.perf_counter_ns
        out = [0] * len(queries)
        res: list[Any] = [None] * len(queries)
        for i, q in enumerate(queries):
            t0 = pc()
            r = m(q)
            r.l12  # noqa: B018
            out[i] = pc() - t0
            res[i] = r
        return out, [dict(zip(r.node_ids.tolist(), r.l12.tolist(), strict=True)) for r in res]

    def is_empty(self) -> bool:
        return len(self.d) == 0


def width_sweep(
    radix_tree_cls: Any, kv_directory_cls: Any, widths: list[int], calls: int
) -> list[dict[str, Any]]:
    """Full-hit 100-block query against W workers holding the same chain (notes §4.2)."""
    import random

    out: list[dict[str, Any]] = []
    fresh = FreshBlocks(random.Random(7))
    chain = Chain(*fresh.chain(None, 100))
    ours_q = chain.signed_hashes()
    dyn_q = list(chain.tokens)
    for n_workers in widths:
        dyn = DynamoRunner(radix_tree_cls)
        ours = OursRunner(kv_directory_cls)
        events = [StoreEvent(wk, None, chain) for wk in range(n_workers)]
        dyn.apply([(e.worker, dynamo_store_json(i + 1, e)) for i, e in enumerate(events)])
        ours.store([ours_store_args(e) for e in events])
        d_ns, d_res = timed(dyn.match, [dyn_q] * calls)
        o_ns, o_res = timed(ours.match, [ours_q] * calls)
        want = dict.fromkeys(range(n_workers), 100)
        out.append(
            {
                "workers": n_workers,
                "ours": stat(o_ns, calls * 100),
                "dynamo": stat(d_ns, calls * 100),
                "equal": d_res[0] == want and o_res[0] == want,
            }
        )
        del dyn, ours
    return out


# --- memory cases (one subprocess per system and case) -------------------------------------------


def memory_case_shape(case: str, quick: bool) -> tuple[int, int, int]:
    """(chains, blocks per chain, workers holding each chain)."""
    scale = 10 if quick else 1
    if case == "A":
        return (10_000 // scale, 100, 1)
    if case == "B":
        return (1_000 // scale, 100, 16)
    raise ValueError(case)


def memory_child(system: str, case: str, quick: bool, seed: int) -> dict[str, Any]:
    """Build case `case` in `system` in this (fresh) process; return the RSS delta figures."""
    import random

    n_chains, length, n_workers = memory_case_shape(case, quick)
    fresh = FreshBlocks(random.Random(seed))
    chains = [Chain(*fresh.chain(None, length)) for _ in range(n_chains)]
    events = [StoreEvent(w, None, c) for c in chains for w in range(n_workers)]
    reported: int | None = None
    if system == "dynamo":
        tree = load_radix_tree()()
        payloads = [(e.worker, dynamo_store_json(i + 1, e)) for i, e in enumerate(events)]
        first = chains[0].tokens[:1]
        del events, chains
        gc.collect()
        before = rss_bytes()
        for w, b in payloads:
            tree.apply_event(w, b)
        gc.collect()
        after = rss_bytes()
        ok = len(tree.find_matches(first).scores) == n_workers
    else:
        d = load_kv_directory()()
        args = [ours_store_args(e) for e in events]
        first = args[0][1][:1]
        del events, chains
        gc.collect()
        before = rss_bytes()
        for w, hs, p in args:
            d.store(w, "L1", hs, p)
        gc.collect()
        after = rss_bytes()
        reported = int(d.stats()["memory_bytes"])
        ok = len(d.match(first).node_ids) == n_workers and len(d) == n_chains * length
    blocks = n_chains * length
    delta = after - before
    return {
        "system": system,
        "case": case,
        "blocks": blocks,
        "locations": blocks * n_workers,
        "rss_delta_bytes": delta,
        "bytes_per_block": delta / blocks,
        "bytes_per_location": delta / (blocks * n_workers),
        "reported_memory_bytes": reported,
        "reported_bytes_per_block": None if reported is None else reported / blocks,
        "check_ok": ok,
    }


def run_memory_case(system: str, case: str, quick: bool, seed: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--memory-child",
        f"{system}:{case}",
        "--seed",
        str(seed),
        *(["--quick"] if quick else []),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"system": system, "case": case, "error": proc.stderr.strip()[-2000:]}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# --- main ----------------------------------------------------------------------------------------


@dataclass
class PhaseResult:
    name: str
    label: str
    ours: Stat
    dynamo: Stat

    def ratios(self) -> tuple[float, float]:
        return (self.ours.median_us / self.dynamo.median_us, self.ours.p99_us / self.dynamo.p99_us)


def timed(fn: Any, *args: Any) -> Any:
    """Run `fn(*args)` with the cyclic GC off."""
    gc.collect()
    gc.disable()
    try:
        return fn(*args)
    finally:
        gc.enable()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--queries", type=int, default=None, help="queries (default 10,000)")
    ap.add_argument("--json", dest="json_out", type=Path, default=None, help="write figures here")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    ap.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="shared",
        help="shared: 64 workers, 100-block chains, random sharing (notes §4.1); "
        "forks: 256 workers, 300-block chains, each forking an earlier one at 60-100%% of it",
    )
    ap.add_argument("--no-pin", action="store_true", help="do not pin to one core")
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)

    if opts.memory_child:
        system, case = opts.memory_child.split(":")
        print(json.dumps(memory_child(system, case, opts.quick, opts.seed)))
        return 0

    # Rich falls back to 80 columns when piped; the table needs about 150.
    wide = sys.stdout.isatty() or "COLUMNS" in os.environ
    console = Console(width=None if wide else 150)
    cpu: int | None = None
    if not opts.no_pin:
        # Pin before Dynamo's tree thread exists so that it inherits the mask; re-pin below.
        cpu = 0 if 0 in os.sched_getaffinity(0) else min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
    radix_tree_cls = load_radix_tree()
    kv_directory_cls = load_kv_directory()

    shape = dict(WORKLOADS[opts.workload])
    if opts.quick:
        for k in ("n_sequences", "n_queries", "n_appends"):
            shape[k] = max(1, int(shape[k]) // 5)
    if opts.queries is not None:
        shape["n_queries"] = opts.queries
    t_gen = time.perf_counter()
    w = generate(opts.seed, **shape)
    inp = prepare(w)
    t_gen = time.perf_counter() - t_gen
    n_floor = len(w.queries)
    console.print(
        f"[bold]workload[/] seed {w.seed}: {w.n_workers} workers, {len(w.stores):,} store events "
        f"({w.stored_blocks:,} blocks, {w.stored_blocks / len(w.stores):.1f}/event; "
        f"{w.unique_blocks:,} distinct), {len(w.queries):,} queries of {w.seq_len} blocks, "
        f"{len(w.appends):,} appends, {len(w.removals):,} removes (generated in {t_gen:.1f} s)"
    )

    dyn = DynamoRunner(radix_tree_cls)
    ours = OursRunner(kv_directory_cls)
    pinned = pin_all_threads(cpu) if cpu is not None else 0
    console.print(
        f"python {platform.python_version()}, ai-dynamo-runtime {dynamo_version()}, "
        + (f"pinned to CPU {cpu} ({pinned} threads)" if cpu is not None else "not pinned")
    )
    dyn.warmup(2_000)
    ours.warmup(2_000)

    phases: list[PhaseResult] = []

    def phase(name: str, label: str, o: list[int], d: list[int], blocks: int) -> None:
        phases.append(PhaseResult(name, label, stat(o, blocks), stat(d, blocks)))

    def insert(name: str, how: str, dyn: DynamoRunner, ours: OursRunner) -> None:
        d_ns = timed(dyn.apply, inp.dyn_stores)
        o_ns = timed(ours.store, inp.ours_stores)
        label = f"store ≈{w.stored_blocks / len(w.stores):.0f}-block chain{how}"
        phase(name, label, o_ns, d_ns, w.stored_blocks)

    insert("insert", "", dyn, ours)
    # floor (on the full index)
    d_ns = timed(dyn.floor, n_floor)
    o_ns = timed(ours.floor, n_floor)
    phase("floor", "empty call (floor)", o_ns, d_ns, 0)
    # match
    d_ns, d_res = timed(dyn.match, inp.dyn_queries)
    o_ns, o_res = timed(ours.match, inp.ours_queries)
    phase("match", f"match {w.seq_len}-block query", o_ns, d_ns, len(w.queries) * w.seq_len)
    equal = sum(1 for a, b in zip(o_res, d_res, strict=True) if a == b)
    non_empty = sum(1 for a in o_res if a)
    mismatches: list[dict[str, Any]] = []
    for i, (a, b) in enumerate(zip(o_res, d_res, strict=True)):
        if a != b and len(mismatches) < 5:
            mismatches.append(
                {"query": i, "ours": a, "dynamo": b, "reference": reference_match(w, w.queries[i])}
            )
    # append
    d_ns = timed(dyn.apply, inp.dyn_appends)
    o_ns = timed(ours.store, inp.ours_appends)
    phase("append", "append 1 block", o_ns, d_ns, len(w.appends))
    # remove
    removed_blocks = sum(len(r.hashes) for r in w.removals)
    d_ns = timed(dyn.apply, inp.dyn_removes)
    o_ns = timed(ours.remove, inp.ours_removes)
    phase("remove", "remove, all (per store/append event)", o_ns, d_ns, removed_blocks)
    # Removals undo the appends first (1 block each), then the store events (leaf first).
    n_app = len(w.appends)
    phase("remove_1", "  of which 1 block (undo append)", o_ns[:n_app], d_ns[:n_app], n_app)
    phase(
        "remove_chain",
        f"  of which ≈{w.stored_blocks / len(w.stores):.0f}-block chain",
        o_ns[n_app:],
        d_ns[n_app:],
        removed_blocks - n_app,
    )
    empty_after = {"ours": ours.is_empty(), "dynamo": dyn.is_empty()}
    insert("insert_warm", ", warm", dyn, ours)  # the same stores into memory both have used
    del dyn, ours

    where = "one pinned core" if cpu is not None else "unpinned"
    table = Table(title=f"KvDirectory vs Dynamo RadixTree: µs per call, {where}")
    for col in (
        "operation",
        "calls",
        "ours med",
        "ours p99",
        "Dynamo med",
        "Dynamo p99",
        "ours/Dyn med",
        "ours/Dyn p99",
        "ours blk/s",
        "Dyn blk/s",
    ):
        table.add_column(col, justify="left" if col == "operation" else "right")
    order = [
        "floor",
        "insert",
        "insert_warm",
        "match",
        "append",
        "remove",
        "remove_1",
        "remove_chain",
    ]
    for p in sorted(phases, key=lambda p: order.index(p.name)):
        rm, rp = p.ratios()
        table.add_row(
            p.label,
            f"{p.ours.calls:,}",
            f"{p.ours.median_us:.2f}",
            f"{p.ours.p99_us:.2f}",
            f"{p.dynamo.median_us:.2f}",
            f"{p.dynamo.p99_us:.2f}",
            f"{rm:.2f}x",
            f"{rp:.2f}x",
            f"{p.ours.blocks_per_s / 1e6:.2f} M" if p.ours.blocks else "-",
            f"{p.dynamo.blocks_per_s / 1e6:.2f} M" if p.dynamo.blocks else "-",
        )
    console.print(table)
    ok = equal == len(o_res)
    widths = [1, 8, 64, 256] if opts.quick else [1, 8, 64, 256, 1024]
    sweep = width_sweep(radix_tree_cls, kv_directory_cls, widths, 500 if opts.quick else 2_000)
    wt = Table(title="match vs sharing width: W workers hold one 100-block chain, full-hit query")
    for col in ("W", "ours med", "ours p99", "Dynamo med", "Dynamo p99", "ours/Dyn med", "equal"):
        wt.add_column(col, justify="right")
    for r in sweep:
        wt.add_row(
            f"{r['workers']:,}",
            f"{r['ours'].median_us:.2f}",
            f"{r['ours'].p99_us:.2f}",
            f"{r['dynamo'].median_us:.2f}",
            f"{r['dynamo'].p99_us:.2f}",
            f"{r['ours'].median_us / r['dynamo'].median_us:.2f}x",
            "yes" if r["equal"] else "NO",
        )
    console.print(wt)
    ok = ok and all(r["equal"] for r in sweep)
    console.print(
        f"match results equal on {equal:,}/{len(o_res):,} queries "
        f"({non_empty:,} non-empty): [{'green' if ok else 'red'}]{'OK' if ok else 'MISMATCH'}[/]; "
        f"index empty after removal: ours {empty_after['ours']}, Dynamo {empty_after['dynamo']}"
    )
    for m in mismatches:
        console.print(f"  mismatch {m}")

    mem: list[dict[str, Any]] = []
    t_mem = time.perf_counter()
    for case in ("A", "B"):
        for system in ("ours", "dynamo"):
            mem.append(run_memory_case(system, case, opts.quick, opts.seed))
    t_mem = time.perf_counter() - t_mem
    mt = Table(title="memory: RSS delta of a fresh process per system and case")
    for col in (
        "case",
        "system",
        "blocks",
        "locations",
        "RSS delta MiB",
        "B/block",
        "B/location",
        "reported B/block",
    ):
        mt.add_column(col, justify="left" if col in ("case", "system") else "right")
    shapes = {
        "A": "A: disjoint 100-block chains, 1 worker",
        "B": "B: 100-block chains on 16 workers each",
    }
    for r in mem:
        if "error" in r:
            mt.add_row(shapes[r["case"]], r["system"], "error", r["error"][-60:], "", "", "", "")
            continue
        rep = r["reported_bytes_per_block"]
        mt.add_row(
            shapes[r["case"]],
            r["system"] + ("" if r["check_ok"] else " (CHECK FAILED)"),
            f"{r['blocks']:,}",
            f"{r['locations']:,}",
            f"{r['rss_delta_bytes'] / 2**20:.1f}",
            f"{r['bytes_per_block']:.0f}",
            f"{r['bytes_per_location']:.0f}",
            "-" if rep is None else f"{rep:.0f}",
        )
    console.print(mt)
    console.print(f"(memory cases took {t_mem:.1f} s; 'reported' is our stats()['memory_bytes'])")

    if opts.json_out is not None:
        doc = {
            "seed": w.seed,
            "quick": opts.quick,
            "pinned_cpu": cpu,
            "pinned_threads": pinned,
            "python": platform.python_version(),
            "dynamo_version": dynamo_version(),
            "workload": {
                "name": opts.workload,
                "workers": w.n_workers,
                "store_events": len(w.stores),
                "stored_blocks": w.stored_blocks,
                "distinct_blocks": w.unique_blocks,
                "queries": len(w.queries),
                "appends": len(w.appends),
                "remove_events": len(w.removals),
                "removed_blocks": removed_blocks,
            },
            "ops": {
                p.name: {
                    "label": p.label,
                    "ours": asdict(p.ours),
                    "dynamo": asdict(p.dynamo),
                    "ratio_median": p.ratios()[0],
                    "ratio_p99": p.ratios()[1],
                }
                for p in phases
            },
            "match_equal": equal,
            "match_total": len(o_res),
            "match_non_empty": non_empty,
            "mismatches": mismatches,
            "width_sweep": [
                {
                    "workers": r["workers"],
                    "ours": asdict(r["ours"]),
                    "dynamo": asdict(r["dynamo"]),
                    "equal": r["equal"],
                }
                for r in sweep
            ],
            "empty_after_removal": empty_after,
            "memory": mem,
        }
        opts.json_out.parent.mkdir(parents=True, exist_ok=True)
        opts.json_out.write_text(json.dumps(doc, indent=2))
        console.print(f"figures written to {opts.json_out}")
    return 0 if ok and all(empty_after.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
