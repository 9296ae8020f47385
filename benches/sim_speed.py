"""How fast the simulator runs: events/s, simulated seconds per wall second, and where time goes.

Issue 5's targets: one simulated hour of 36 GPUs in <= 60 s, of 3,072 GPUs in <= 20 min, on the
2-core development machine. Run: `.venv/bin/python benches/sim_speed.py [--gpus 36] [--agents 50]
[--duration 3600] [--policy evolving] [--profile 15] [--directory-calls] [--trace-cache DIR]` —
one policy on the Claude-Code-like generator.

- `--profile N`: the time per part (the native directory's calls by method, prompt hashing,
  routing, the nodes, ...; cProfile's own time) and the N functions with the most own time;
- `--directory-calls`: the directory's calls by method, the blocks each takes, their time;
- `--trace-cache DIR`: keeps generated traces as pickles (the 3,072-GPU scenario's 8,533 agents
  for 120 s: ~1.5 minutes to generate, 0.8 GB on disk, ~1 minute to load).

Nothing is asserted: it prints figures. The scale scenarios' agents: `sim/scenarios.py`
(`MID_AGENTS_PER_GPU`, 2.78 per GPU: 100 on 36 GPUs, 711 on 256, 8,533 on 3,072).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pickle
import pstats
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Imported here so that the profile shows the run, not the first use's imports (the fit and
# the planner's test import scipy lazily, ~2 s).
import scipy.optimize
import scipy.stats  # noqa: F401

from evolving_infra import KvDirectory
from evolving_infra.sim import cluster as cluster_module
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.policies import policy
from evolving_infra.sim.run import simulate
from evolving_infra.workloads.generators import SlotPlan, generate
from evolving_infra.workloads.model import Trace

# Where a function's own time is counted, by the first matching part of its file name.
PARTS = (
    ("workloads/blocks.py", "prompt hashing"),
    ("/routing/", "routing"),
    ("/timing/", "timing (truth, fitted model)"),
    ("/planner/", "planner"),
    ("nodemodel/node.py", "sim: nodes"),
    ("nodemodel/kv.py", "sim: KV bookkeeping"),
    ("sim/cluster.py", "sim: event loop, cluster"),
    ("/sim/", "sim: other"),
)


def trace_for(agents: int, duration: float, seed: int, cache: Path | None) -> Trace:
    plan = SlotPlan(agents=agents, duration=duration, seed=seed)
    if cache is None:
        return generate("cc", plan)
    path = cache / f"cc-{agents}-{duration:g}-{seed}.pickle"
    if path.exists():
        with path.open("rb") as f:
            trace: Trace = pickle.load(f)
        return trace
    trace = generate("cc", plan)
    cache.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        pickle.dump(trace, f, protocol=pickle.HIGHEST_PROTOCOL)
    return trace


def parts(stats: pstats.Stats) -> list[tuple[str, float, int]]:
    """(part, own seconds, calls) by part, most time first; directory calls by method."""
    own: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    table = stats.stats  # type: ignore[attr-defined]
    for (file, _, name), (_, ncalls, tottime, _, _) in table.items():
        if "evolving_infra._core" in name:
            # "<method 'store' of '...KvDirectory' objects>", "<built-in method ..._core.f>"
            method = name.split("'")[1] if "'" in name else name.strip("<>").rsplit(".", 1)[-1]
            part = "directory: " + method
        else:
            part = next((p for key, p in PARTS if key in file), "other (python, numpy)")
        own[part] += tottime
        calls[part] += ncalls
    return sorted(((p, s, calls[p]) for p, s in own.items()), key=lambda x: -x[1])


class RecordingDirectory:
    """A `KvDirectory` that records, per method, the calls, the blocks passed (the chain
    argument's length; for `evict` and `demote`, the blocks returned) and the seconds spent."""

    def __init__(self) -> None:
        self._d = KvDirectory()
        self.calls: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0, 0.0])

    def __getattr__(self, name: str) -> Any:
        f = getattr(self._d, name)
        if not callable(f):
            return f
        row = self.calls[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = f(*args, **kwargs)
            row[3] += time.perf_counter() - t
            if name in ("evict", "demote"):
                chain = out if name == "evict" else out[0]
            else:
                chain = next((a for a in args if isinstance(a, list)), ())
            row[0] += 1
            row[1] += len(chain)
            row[2] = max(row[2], len(chain))
            return out

        return call

    def __contains__(self, h: int) -> bool:
        return h in self._d

    def __len__(self) -> int:
        return len(self._d)

    def table(self) -> str:
        lines = ["  directory calls:   calls   mean blocks   max blocks   total s   µs per call"]
        for name, (n, blocks, top, s) in sorted(self.calls.items(), key=lambda x: -x[1][3]):
            lines.append(
                f"    {name:<14} {n:>10,.0f} {blocks / max(n, 1):>13,.0f} {top:>12,.0f} "
                f"{s:>9.1f} {1e6 * s / max(n, 1):>13,.1f}"
            )
        return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gpus", type=int, default=36)
    p.add_argument("--agents", type=int, default=50)
    p.add_argument("--duration", type=float, default=3600.0)
    p.add_argument("--policy", default="evolving")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="N")
    p.add_argument("--trace-cache", type=Path, default=None, metavar="DIR")
    p.add_argument(
        "--directory-calls",
        action="store_true",
        help="time every directory call and print calls, blocks per call and seconds by method",
    )
    args = p.parse_args(argv)
    recording: RecordingDirectory | None = None
    if args.directory_calls:
        recording = RecordingDirectory()
        # The cluster builds its directory through the name it imported: swap that name.
        setattr(cluster_module, "KvDirectory", lambda: recording)  # noqa: B010

    t0 = time.perf_counter()
    trace = trace_for(args.agents, args.duration, args.seed, args.trace_cache)
    gen_s = time.perf_counter() - t0
    config = SimConfig(gpus=args.gpus, duration=args.duration, seed=args.seed)
    spec = policy(args.policy, args.gpus // config.deployment.tp)
    profiler = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    if profiler is not None:
        profiler.enable()
    result = simulate(trace, config, spec)
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    rt = result.runtime()
    s = result.summary
    print(
        f"{args.policy}, {args.gpus} GPUs, {len(trace.agents)} agents "
        f"({trace.request_count:,} requests in the trace), {args.duration:,.0f} simulated s: "
        f"{s['issued']:,} requests issued, {s['completed']:,} completed"
    )
    print(
        f"  wall {wall:.1f} s, CPU {cpu:.1f} s (trace {gen_s:.1f} s more); {rt['events']:,} "
        f"events, {rt['events_per_s']:,.0f} events/s; {args.duration / wall:,.2f} simulated s "
        f"per wall s; one simulated hour: {3600 * wall / args.duration:,.0f} s "
        f"({3600 * cpu / args.duration:,.0f} s of CPU)"
    )
    if recording is not None:
        print(recording.table())
    if profiler is not None:
        stats = pstats.Stats(profiler)
        total = sum(x[1] for x in parts(stats))
        print(f"\n  where the time goes (own time under cProfile, {total:.1f} s):")
        for part, own, n in parts(stats):
            print(f"    {part:<32} {own:8.1f} s {100 * own / total:5.1f}%  {n:>12,} calls")
        out = io.StringIO()
        stats.stream = out  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(args.profile)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
