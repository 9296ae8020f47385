"""The directory's per-block costs at cluster scale, where its tables no longer fit in cache.

What it models: the 3,072-GPU simulation's directory (768 nodes, each holding six 1,000-block
agent contexts in L1, the first 200 blocks of each also held by the next node: ~4.6 M blocks,
~5.5 M locations, ~0.5 GB), and the calls the simulator makes on every request, each over a whole
context:
- `match` of a context (routing), `touch` (a request done with its blocks), `branch_set` of a new
  branch over a context, `store` of a context the node holds already, and of 300 new blocks under
  one;
- `demote` of 300 blocks L1 → L2 per node, then `evict` of 300 from L2 (blocks whose last holder
  leaves are dropped from the index).
At this size every block look-up misses the CPU caches; these figures, not those of
`compare_dynamo.py` (whose ~170k blocks fit a 32 MiB L3), say what a walk costs there.

Run: `.venv/bin/python benches/directory_scale.py [--nodes 768] [--contexts 6] [--blocks 1000]
[--calls 2000] [--seed 0]`. Prints ns per block per operation, twice (the second pass after the
first has touched everything once). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from evolving_infra import KvDirectory

T = TypeVar("T")


def timed(label: str, call: Callable[[T], object], items: Sequence[T], blocks: int) -> None:
    t0 = time.perf_counter_ns()
    for it in items:
        call(it)
    dt = time.perf_counter_ns() - t0
    per_call = dt / len(items) / 1e3
    print(f"  {label:32s} {per_call:9.1f} µs/call {dt / (len(items) * blocks):7.1f} ns/block")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--nodes", type=int, default=768)
    ap.add_argument("--contexts", type=int, default=6, help="contexts held per node")
    ap.add_argument("--blocks", type=int, default=1000, help="blocks per context")
    ap.add_argument("--calls", type=int, default=2000, help="calls per operation and pass")
    ap.add_argument("--seed", type=int, default=0)
    opts = ap.parse_args(argv)
    rng = random.Random(opts.seed)
    d = KvDirectory()
    n, length, shared = opts.nodes, opts.blocks, opts.blocks // 5
    t0 = time.perf_counter()
    contexts: list[tuple[int, list[int]]] = []
    for node in range(n):
        for c in range(opts.contexts):
            chain = [rng.getrandbits(63) for _ in range(length)]
            d.store(node, "L1", chain, None, float(c))
            d.store((node + 1) % n, "L1", chain[:shared], None, float(c))
            contexts.append((node, chain))
    stats = d.stats()
    print(
        f"{stats['blocks']:,} blocks, {stats['locations']:,} locations over {n} nodes, "
        f"{stats['memory_bytes'] / 2**20:,.0f} MiB (built in {time.perf_counter() - t0:.1f} s)"
    )
    rng.shuffle(contexts)
    sample = contexts[: opts.calls]
    branch = 0

    def new_branch(ctx: tuple[int, list[int]]) -> None:
        nonlocal branch
        branch += 1
        d.branch_set(branch, ctx[1])

    clock = [0.0]  # the calls' `now`, per pass
    for rep in range(2):
        print(f"pass {rep + 1}")
        clock[0] = 100.0 + rep
        timed("match a context", lambda ctx: d.match(ctx[1]), sample, length)
        timed("touch a context", lambda ctx: d.touch(ctx[0], ctx[1], clock[0]), sample, length)
        timed("branch_set, new branch", new_branch, sample, length)
        timed(
            "store a context held already",
            lambda ctx: d.store(ctx[0], "L1", ctx[1], None, clock[0]),
            sample,
            length,
        )
        tails = [(node, [rng.getrandbits(63) for _ in range(300)], c[-1]) for node, c in sample]
        timed(
            "store 300 new blocks",
            lambda a: d.store(a[0], "L1", a[1], a[2], clock[0]),
            tails,
            300,
        )
    order = list(range(n))
    rng.shuffle(order)
    timed("demote 300 blocks (L1 → L2)", lambda node: d.demote(node, 300, 200.0), order, 300)
    timed("evict 300 blocks from L2", lambda node: d.evict(node, "L2", 300), order, 300)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
