"""How fast the simulator runs: events/s, simulated seconds per wall second, and where time goes.

Issue 5's targets: one simulated hour of 36 GPUs in <= 60 s, of 3,072 GPUs in <= 20 min, on the
2-core development machine. Run: `.venv/bin/python benches/sim_speed.py [--gpus 36] [--agents 50]
[--duration 3600] [--policy evolving] [--profile 15]` — one policy on the Claude-Code-like
generator; `--profile N` also prints the N functions with the most own time (cProfile).
Nothing is asserted: it prints figures.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Sequence

from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.policies import policy
from evolving_infra.sim.run import simulate
from evolving_infra.workloads.generators import SlotPlan, generate


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
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    trace = generate("cc", SlotPlan(agents=args.agents, duration=args.duration, seed=args.seed))
    gen_s = time.perf_counter() - t0
    config = SimConfig(gpus=args.gpus, duration=args.duration, seed=args.seed)
    spec = policy(args.policy, args.gpus // config.deployment.tp)
    profiler = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    result = simulate(trace, config, spec)
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - t0
    rt = result.runtime()
    print(
        f"{args.policy}, {args.gpus} GPUs, {len(trace.agents)} agents "
        f"({trace.request_count:,} requests in the trace), {args.duration:,.0f} simulated s:"
    )
    print(
        f"  wall {wall:.1f} s (trace generation {gen_s:.1f} s more); {rt['events']:,} events, "
        f"{rt['events_per_s']:,.0f} events/s; {args.duration / wall:,.0f} simulated s per wall s; "
        f"one simulated hour: {3600 * wall / args.duration:.1f} s"
    )
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.profile)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
