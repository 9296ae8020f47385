"""What a split does to the cache: each static split of one workload, with the planner's view of
every slice recorded, and Che's approximation of an LRU cache read off it.

Issue 25's held-out failures are a split-dependent hit rate the planner misprices. This prints,
per split (`--splits`, prefill nodes), over the settled part of the run (from `--settle` s):

- tok/s: output tokens per second over the whole run (the truth the planner should rank by);
- found: the share of the sampled arrivals' reusable prefix the placements found cached;
- tau: the median retention time the reuse model fits per slice (`planner.reuse.SliceReuse`),
  seconds: a token reused after a gap g was still cached with probability exp(-(g/tau)^2);
- insert/s: tokens the cache takes in per second: the prefills' uncached tokens and the decoded
  ones (what is new to the cluster);
- C = tau x insert/s: Che's characteristic size (an LRU cache holds its contents for the time
  it takes to insert C new tokens). Where C is the same for every split, the cache's size does not
  depend on the split, and the hit rates differ only by how much each split inserts per request;
- X, gap, gap x X: arrivals per second, the token-weighted mean reuse gap, and their product (a
  closed loop of N agents whose turns are a cycle apart has gap x X = N at every rate);
- loss: what the prefills computed over what the placements estimated uncached
  (`planner.hits.SplitMemory`'s figure).

On the 2026-12-07 tuning runs (docs/scenarios.md, "Issue 25 (2026-12-07)") C was within ~10% across
splits of one cell while `found` differed by up to 0.3. Nothing is asserted: it prints figures.

Run: `.venv/bin/python benches/cache_equilibrium.py --workload claude-code-tune --agents 150
--seed 0 --splits 2,3,4,5` (~30 s on 2 cores with `--jobs 2`; `--workload` is a `sim/scenarios`
workload kind: a generator such as osworld, or claude-code-tune / claude-code-held / mooncake).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import statistics
from collections.abc import Sequence
from typing import Any

from evolving_infra.planner.base import SliceStats, Split
from evolving_infra.planner.evolving import EvolvingPlanner
from evolving_infra.planner.reuse import SliceReuse
from evolving_infra.sim import policies
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.run import simulate
from evolving_infra.sim.scenarios import Workload
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.specs import DEPLOYMENTS


class _Recorder(EvolvingPlanner):
    """The evolving planner's inputs (it tracks reuse), never moving: the slices it was handed."""

    def __init__(self, nodes: int, **kw: Any) -> None:
        super().__init__(nodes, **kw)
        self.seen: dict[float, SliceStats] = {}

    def decide(
        self, now: float, split: Split, window: Sequence[SliceStats], model: IterationModel
    ) -> Split | None:
        self.seen.update((s.start, s) for s in window)
        return None


def _run(args: argparse.Namespace, prefill: int) -> dict[str, float]:
    config = SimConfig(
        gpus=36, duration=args.duration, seed=args.seed, deployment=DEPLOYMENTS[args.deployment]
    )
    trace = Workload(args.workload, args.agents, args.duration).trace(args.seed)
    split = Split(prefill, config.nodes - prefill)
    recorders: list[_Recorder] = []

    def planner(ctx: policies.PolicyContext) -> _Recorder:
        r = _Recorder(ctx.nodes, chunk_tokens=ctx.config.chunk_tokens)
        recorders.append(r)
        return r

    spec = dataclasses.replace(policies.static(split), planner=planner, name=f"record:{split}")
    summary = simulate(trace, config, spec).summary
    settled = [s for t, s in sorted(recorders[0].seen.items()) if t >= args.settle]
    return {"tok/s": summary["throughput_tokens_per_s"], **_figures(settled)}


def _figures(slices: Sequence[SliceStats]) -> dict[str, float]:
    taus, inserts, rates, gaps, found, ideal = [], [], [], [], 0.0, 0.0
    for s in slices:
        seconds = s.end - s.start
        if seconds <= 0 or len(s.arrival_reuse) != len(s.arrivals) or not s.arrivals:
            continue
        r = SliceReuse.of(s.arrivals, s.arrival_reuse, max(s.mean_decode_nodes, 1.0))
        reusable = sum(x.tokens for x in s.arrival_reuse)
        found += sum(
            min(c, x.tokens) for (_, c), x in zip(s.arrivals, s.arrival_reuse, strict=True)
        )
        ideal += reusable
        rates.append(s.requests / seconds)
        runs = [(n, g) for x in s.arrival_reuse for n, g in x.runs]
        if runs:
            gaps.append(sum(n * g for n, g in runs) / sum(n for n, _ in runs))
        if r is not None:  # a slice that lost nothing says only that tau is large
            taus.append(r.tau)
            inserts.append((s.prefilled_uncached_tokens + s.output_tokens) / seconds)
    tau = statistics.median(taus) if taus else float("nan")
    insert = statistics.mean(inserts) if inserts else float("nan")
    rate = statistics.mean(rates) if rates else float("nan")
    gap = statistics.mean(gaps) if gaps else float("nan")
    # SplitMemory's figure over these slices: the prefills' uncached share over the estimate's.
    est_prompt = sum(s.prompt_tokens for s in slices)
    est_uncached = sum(s.uncached_tokens for s in slices)
    ran_prompt = sum(s.prefilled_prompt_tokens for s in slices)
    ran_uncached = sum(s.prefilled_uncached_tokens for s in slices)
    ok = min(est_prompt, est_uncached, ran_prompt, ran_uncached) > 0
    loss = (ran_uncached / ran_prompt) / (est_uncached / est_prompt) if ok else float("nan")
    return {
        "found": found / ideal if ideal > 0 else float("nan"),
        "tau": tau,
        "insert/s": insert,
        "C (M tokens)": statistics.median(t * i for t, i in zip(taus, inserts, strict=True)) / 1e6
        if taus
        else float("nan"),
        "X": rate,
        "gap": gap,
        "gap x X": gap * rate,
        "loss": loss,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="claude-code-tune", help="a sim/scenarios workload kind")
    p.add_argument("--agents", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--splits", default="2,3,4,5", help="prefill nodes of each static split")
    p.add_argument("--duration", type=float, default=3600.0)
    p.add_argument("--settle", type=float, default=900.0, help="slices from here on (s)")
    p.add_argument("--deployment", default="h100-llama", choices=sorted(DEPLOYMENTS))
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args()
    xs = [int(x) for x in args.splits.split(",")]
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        rows = pool.starmap(_run, [(args, x) for x in xs])
    print(f"{args.workload}, {args.agents} agents, seed {args.seed}, {args.deployment}")
    names = list(rows[0])
    nodes = 36 // DEPLOYMENTS[args.deployment].tp
    print("split  " + " ".join(f"{n:>12s}" for n in names))
    for x, row in zip(xs, rows, strict=True):
        cells = " ".join(
            f"{row[n]:>12.3f}" if abs(row[n]) < 10 else f"{row[n]:>12,.0f}" for n in names
        )
        print(f"{x}P{nodes - x}D  {cells}")


if __name__ == "__main__":
    main()
