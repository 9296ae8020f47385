"""What each split's prefills found cached: the `evolving` planner's memory of the splits it ran.

A request's cached/uncached split is estimated when it is placed, counting every block held
anywhere in the cluster as cached. That assumes the blocks survive until the request runs, and
whether they do depends on the split itself: with too few prefill nodes requests queue and their
cached blocks are evicted while they wait; with too few decode nodes prefilled KV waits pinned
for a decode slot and crowds the cache out. In the cc-high scenario (250 Claude Code agents on
9 nodes) placements estimated ~0.9 of the prompt cached at every split, while the prefills found
0.7 at 3P6D, 0.1-0.3 at 2P7D and 0.2-0.4 at 6P3D. A planner that believes the estimate moved
from 3P6D to 2P7D and stayed there (36% below the best static split); one that believes the
current split's prefills sees every split as bad as the one it is at, and stays at 6P3D.

So the planner remembers, per split it has run (settled: a full planner window after the switch
that brought it, whose transient, a backlog draining, lasted up to 8 minutes in cc-high), how
the prefills' uncached share compared with the placements' estimate (the split's *loss*), and
sizes a candidate's prefill work by it. A split not run recently gets the loss of the splits
that did, as a function of the number of prefill nodes: between two tried splits, the straight
line between their losses; beyond them, the nearest one's. (Uncalibrated, with the bare
estimate, every untried split looked several times better than the best tried one, and the
planner toured them all. Assuming an untried split as good as the best tried one still toured:
in cc-high the losses were 4.1 at 3P6D, 7.2 at 4P5D and 16.3 at 5P4D, growing with the prefill
nodes, and the best tried loss made each untried neighbour look better than the split it had.)
The running split's figure does not expire while the split runs, until its own newer slices
replace it: when it came back to 3P6D, the planner forgot 3P6D's figure while that split was
settling again and left it for an untried split. A bad move is seen and not repeated while it
is remembered; with no evidence at all (a fresh start, or a mix whose placements are right)
the estimate stands.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from evolving_infra.planner.base import SliceStats, Split


class SplitMemory:
    """Per number of prefill nodes: the settled slices run at that split (the last `memory_s`
    seconds), as sums of the arrivals' estimated and the prefills' found uncached tokens."""

    def __init__(
        self, *, settle_s: float = 600.0, memory_s: float = 1800.0, min_prefills: int = 10
    ) -> None:
        if settle_s < 0 or memory_s <= 0 or min_prefills < 1:
            raise ValueError("need settle_s >= 0, memory_s > 0 and min_prefills >= 1")
        self.settle_s = settle_s  # a switch's transient: caches move to where the work went
        self.memory_s = memory_s  # the mix may change: old evidence expires
        self.min_prefills = min_prefills  # fewer prefills than this say nothing about a split
        # prefill nodes -> (slice end, est. prompt, est. uncached, prefills, ran prompt,
        # ran uncached) per settled slice
        self._seen: dict[int, deque[tuple[float, int, int, int, int, int]]] = {}
        self._split: Split | None = None
        self._since = 0.0

    def note(self, now: float, split: Split, window: Sequence[SliceStats], switching: bool) -> None:
        """Called at every decision with the split that ran since the last one: remembers the
        newest slice if the split was settled for all of it."""
        if switching or split != self._split:
            self._split, self._since = split, now
        elif window and window[-1].start >= self._since + self.settle_s:
            s = window[-1]
            self._seen.setdefault(split.prefill, deque()).append(
                (
                    s.end,
                    s.prompt_tokens,
                    s.uncached_tokens,
                    s.prefills,
                    s.prefilled_prompt_tokens,
                    s.prefilled_uncached_tokens,
                )
            )
        running = self._split.prefill if self._split is not None else None
        for x, seen in self._seen.items():
            while seen and seen[0][0] <= now - self.memory_s:
                # The running split keeps old evidence until newer slices suffice on their own.
                if x == running and sum(e[3] for e in list(seen)[1:]) < self.min_prefills:
                    break
                seen.popleft()

    def loss(self, prefill_nodes: int) -> float | None:
        """The loss to size this split by: its own if it ran, settled, within memory; else the
        tried splits' losses interpolated (between two of them) or the nearest one's (beyond);
        None when none ran."""
        return self.losses([prefill_nodes])[0]

    def losses(self, candidates: Sequence[int]) -> list[float | None]:
        """`loss` of each candidate (prefill nodes), the tried splits' figures computed once."""
        tried = self.tried()
        if not tried:
            return [None] * len(candidates)
        xs = sorted(tried)
        # np.interp holds the end values beyond the tried range: the nearest tried split's loss.
        ys = np.interp(candidates, xs, [tried[x] for x in xs])
        return [tried.get(x, float(y)) for x, y in zip(candidates, ys, strict=True)]

    def measured(self, prefill_nodes: int) -> float | None:
        """How many times the estimated uncached share the prefills computed at this split
        (1: the estimate held; > 1: cached blocks were lost before their requests ran); None
        when the split has not run, settled, within memory."""
        seen = self._seen.get(prefill_nodes)
        if not seen or sum(x[3] for x in seen) < self.min_prefills:
            return None
        est_prompt, est_uncached = sum(x[1] for x in seen), sum(x[2] for x in seen)
        ran_prompt, ran_uncached = sum(x[4] for x in seen), sum(x[5] for x in seen)
        if est_prompt <= 0 or ran_prompt <= 0 or est_uncached <= 0:
            return None
        return (ran_uncached / ran_prompt) / (est_uncached / est_prompt)

    def tried(self) -> dict[int, float]:
        """{prefill nodes: loss} for every split with a figure (for logs and plots)."""
        out = {}
        for x in sorted(self._seen):
            f = self.measured(x)
            if f is not None:
                out[x] = f
        return out
