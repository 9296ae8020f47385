"""The `evolving` planner: the split with the best predicted throughput, switched to only when
the gain is significant across the window's slices (DESIGN §3, "Phase split").

For a candidate split xPyD (x + y = N) and a slice s of the window, the predicted cluster
throughput Θ_s(x) is the request rate the split sustains (`throughput.split_rate`): the prefill
nodes keep up, and the decode KV holds every request it reserved for as long as it holds it,
under SGLang's early decode allocation through the prefill queue (the prefill nodes' wait as
one queue among the requests the decode KV holds, `throughput._queue_wait`, with the squared
coefficient of variation of the slice's sampled prefill times times `wait_spread`, 1 by
default), the prefill and the transfer as well as the decode (without it,
min(x·μ_P, y·μ_D) undercounted the decode KV's use by a half on long fresh prompts and
overcounted it on Claude Code). Rates come from the fitted iteration-time model:

- μ_P: a prefill node's requests/s of the slice's sampled arrivals (`SliceStats.arrivals`,
  their own uncached and cached tokens, not their mean's), batched as chunked prefill does
  (`common.packed_prefill_rate`, 8192 tokens an iteration, SGLang's default), the uncached
  ones as the placements estimated them times the loss the planner remembers for that
  candidate split (`hits.SplitMemory`: how much more the prefills computed than estimated
  while the split ran; 1 for a split not run recently);
- the decode side: the slice's mean request (`common.MeanRequest`), its decode steps at the
  batch the rate makes (`model.predict_decode`, capped at `max_decode_batch`), its tokens per
  step (`Deployment.mtp_accepted`).

Rule, every `interval` (60 s) over a `window_s` (600 s) window cut into `slices` (10) slices:
1. slices without arrivals are dropped (they say nothing about the mix); fewer than
   `min_slices` (5) left: keep the split. So the first decision is made at minute 5, and a move
   is undone (rule 5) or a shift read off the latest half (rule 7) on five slices at least. At
   3, while agents were still entering (a grid cell's first quarter hour, `sim/heldout.py`), the
   mix was their cold first prompts and the planner gave them prefill nodes it took back five
   to eight minutes later: Claude Code at 100 and 220 held-out agents on the paper's deployment
   moved 4P5D -> 7P2D -> 4P5D, 6 switches an hour, where at 5 it kept its split (0.989-1.000x
   the best static split), and no tuning cell lost more than 0.3% (docs/scenarios.md, issue
   25, 2026-12-07, fifth session);
2. the candidate with the best mean Θ over the slices, or any within `tie` (4%) of it, is the
   target: among them, the one the fewest nodes away; if it is the current split, keep. A
   difference smaller than the least gain the planner moves for (`min_gain`) is not one it
   can tell: on the H100s' Mooncake 120 (held out, seed 9) Θ put 7P2D 2% above 6P3D at
   minute 5, and the planner moved three nodes to 7P2D, which the static runs put 3.6% below
   6P3D, and came back at minute 50 (0.965x the best static split, 4 switches); taking the
   nearer of the two it served 0.991x with 2 (docs/scenarios.md, issue 25, 2026-12-07, sixth
   session);
3. per-slice relative gains g_s = Θ_s(target) / Θ_s(current) - 1 are tested with a one-sided
   paired t-test (H0: mean gain <= 0; `scipy.stats.t`); switch only if p < `alpha` AND the
   mean gain >= `min_gain` (4%: at 2% the paper's deployment moved on gains its capacity
   model could not tell from noise, Claude Code at 150 agents 7 times an hour, and OSWorld at
   500 held-out agents went 4-5 ways for 0.80-0.88x the best static split; 4% was the
   tuning grid's lead, neutral on the H100s, docs/scenarios.md, issue 25, 2026-12-07). One
   bursty slice among calm ones gives one large gain among
   small or negative ones: a large variance, so no switch (a burst of sub-agents must not flip
   nodes, DESIGN §3). The mean gain must also reach `min_gain` in what the agents would send
   (`Evaluation.loop_gain`), which differs from capacity where the cluster is mostly idle:
   agents wait for their answers, so a split serves what they ask, and a faster one brings
   them back only by as much as its answer is of their cycle. Where the window's arrival
   rate is at most 1/`headroom` (3) of the current split's mean capacity over its slices
   (`_idle`), in each slice whose agents' think times the driver counted
   (`SliceStats.think_s`: from a branch's answer to its next request), the candidates are
   priced by the rate those agents would send them
   (`throughput.closed_loop_rate`: as many agents as keep the slice's rate going with its
   think time and observed answers, `SliceStats.response_s`, each answer scaled from the
   model's by the observed over the modelled at the current split, its prefill queue wait
   M/G/1 with the sampled arrivals' spread of prefill times); elsewhere by capacity. On Claude
   Code at 150 agents on the paper's deployment (about 40 s of tool time to 2 s of answer,
   the cluster at a sixth of its capacity) capacities a third apart moved the planner 5 to 7
   times an hour for nothing (every split from 2P7D to 7P2D within 1% of the best); this
   keeps it to one or two moves. It is a test, not the target: pricing every slice by its
   agents instead moved OSWorld on the paper's deployment (400 and 600 agents) later and back
   and forth, 4-11 switches an hour and 3-9% below the best static split, since its load grows
   past its capacity minutes later and a split with headroom is what holds it then; and the
   test applies only with 3x headroom, since at 400 OSWorld agents the first minutes run at
   40% of capacity and the move then (to 5P4D, the best static split) is what the next half
   hour needs;
4. the gain must also persist: the gains' least-squares line over the slices, read one slice
   past the latest (`Evaluation.gain_now`: at the next decision, the earliest the planner could
   undo the move), must be >= `min_gain` too. A burst that is fading (the
   start-up, when every agent's first cold prompt arrives at once and the cache then warms:
   uncached tokens per request fall from ~18k to ~4k over the first five minutes of Claude
   Code) gives gains that fall slice after slice: their mean is large and all of them are
   positive, so the t-test passes, but the line says the gain is gone by now. A mix that
   shifts gives gains that rise: the line only confirms them;
5. a move back against the last one (within `window_s` of it) is decided on the slices since
   that move alone: the slices before it are the evidence that made the move, and undoing it
   needs evidence the move was wrong, not the same slices read again (an oscillation is a cost
   the test should have seen coming);
6. move at most `max_step` nodes. Default: the whole gap. The switch keeps the KV in place
   (6.2 s per node, docs/simulator.md) and the test already guards against noise, so stepping
   one node per minute would only hold a known-better split back; set `max_step=1` to creep;
7. when rules 1-5 keep the split on the whole window, they are applied again to its latest
   `recent` (half) alone. After a shift of the mix, the whole window mixes the two: the old
   slices pull the best mean Θ toward the old mix's split and their negative gains fail the
   t-test, so a 10-minute window alone moved 6-8 minutes after the mix had changed (Putnam to
   OSWorld on the paper's deployment: 1P8D held until 480 s after the step, then 2P7D and
   4P5D 5 minutes apart). The latest half is a test of its own on fewer slices, not a
   looser one: a burst within it is one slice among five (a large variance, no move), a
   fading one fails rule 4, and `min_slices` still holds. With `shift_factor` set (off by
   default) it applies only where the mix did shift (`mix_shifted`: mean prompt, mean output
   or the share no cache could hold differ by that factor between the two halves): a cache
   that lost the agents' contexts for a few minutes changes what the cluster makes of the same
   mix, not the mix. At 2x it helped OSWorld at 120 agents on 36 H100s (a tuning seed: 1,356
   to 1,423 tok/s) and cost OSWorld at 500 on the paper's deployment 8% and 4% with up to 10
   switches an hour, and Claude Code at 220 held-out agents there 5 to 9 switches
   (docs/scenarios.md, issue 25, 2026-12-05), so it stays off.

While a switch is in flight (until `switch_done()`), no decision is made.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from evolving_infra.planner.base import SliceStats, Split, SwitchMode
from evolving_infra.planner.common import (
    CHUNK_TOKENS,
    MAX_DECODE_BATCH,
    MeanRequest,
    PlannerGate,
    kv_capacity_tokens,
    packed_prefill_rate,
    prefill_rate,
    prefill_seconds,
    rebin,
)
from evolving_infra.planner.hits import SplitMemory
from evolving_infra.planner.reuse import DECODE_EXPONENT, SliceReuse
from evolving_infra.planner.throughput import (
    Answer,
    Loop,
    SliceDemand,
    answer,
    closed_loop_rate,
    split_rate,
)
from evolving_infra.timing.model import IterationModel

# Decode KV use by running requests at or above which the reuse model is not applied
# (`_reuse_model`): a modelling choice, the share at which a cache has no room left to speak of.
FULL_DECODE_KV = 0.95
# The least share of the prompts no cache could hold that `mix_shifted` tells apart: below a
# hundredth both halves hold next to no new context. A tenth (a few sessions more or less in 64
# sampled arrivals move Claude Code's share between 0.015 and 0.04) kept the start-up moves
# that help there out as well: 0.976x and 0.982x of the 0.01 floor at 126 agents, tuning draws.
FRESH_FLOOR = 0.01
# The fewest arrivals with a known think time for a slice to be priced as a closed loop
# (`EvolvingPlanner._close_loop`): below it the slice keeps the capacities.
MIN_THINK_REQUESTS = 5
# How far the observed answers may be from the model's (`_loop`): beyond these the
# observation says more about one slice's burst than about the model.
ANSWER_SCALE = (0.25, 20.0)


@dataclass(frozen=True, slots=True)
class Evaluation:
    """What the planner computed for one decision (for tests, logs and the simulator's plots)."""

    at: float  # when: the `now` it was evaluated at
    current: Split
    target: Split  # the candidate with the best mean Θ
    slices: int  # slices with arrivals that entered the test
    mean_theta: float  # the target's mean Θ, requests/s
    mean_gain: float  # mean relative per-slice gain of the target over the current split
    p_value: float  # one-sided paired t-test of the gains
    gain_now: float  # the gains' least-squares line one slice past the latest (rule 4)
    # Mean Θ of every candidate, requests/s, by prefill nodes 1..N-1 (for logs and plots).
    thetas: tuple[float, ...] = ()
    # Mean relative gain in what the slices' agents would send (rule 3; the capacity gain
    # where no slice prices a closed loop).
    loop_gain: float = 0.0

    def record(self, asked: Split | None) -> dict[str, Any]:
        """The decision as one flat, JSON-ready record (the simulator's `decision_log`, the
        live router's `planner_decision` log line): the split, the best candidate, the test's
        figures, what was asked for (None: kept) and Θ per candidate as {"xPyD": requests/s}."""
        n = len(self.thetas) + 1
        return {
            "t": self.at,
            "split": str(self.current),
            "best": str(self.target),
            "asked": None if asked is None else str(asked),
            "slices": self.slices,
            "mean_gain": self.mean_gain,
            "p_value": self.p_value,
            "gain_now": self.gain_now,
            "loop_gain": self.loop_gain,
            "theta": {str(Split(x, n - x)): t for x, t in enumerate(self.thetas, start=1)},
        }


class EvolvingPlanner(PlannerGate):
    """Θ = the rate each candidate split sustains, per slice; switch on a gain that is
    significant and persists."""

    name = "evolving"
    switch_mode: SwitchMode = "in-place-keep"
    reads_reuse = True  # the reuse model (`planner/reuse.py`)

    def __init__(
        self,
        nodes_total: int,
        *,
        interval: float = 60.0,
        window_s: float = 600.0,
        slices: int = 10,
        alpha: float = 0.05,
        min_gain: float = 0.04,
        max_step: int | None = None,
        min_slices: int = 5,
        chunk_tokens: int = CHUNK_TOKENS,
        kv_capacity_tokens: int | None = None,
        max_decode_batch: int = MAX_DECODE_BATCH,
        memory: SplitMemory | None = None,
        early_allocation: bool = True,
        recent: float | None = 0.5,
        shift_factor: float | None = None,
        headroom: float | None = 3.0,
        wait_spread: float = 1.0,
        decode_exponent: float = DECODE_EXPONENT,
        tie: float = 0.04,
    ) -> None:
        super().__init__()
        if nodes_total < 2 or slices < 2 or not 0 < alpha < 1 or min_slices < 2:
            raise ValueError("need nodes_total >= 2, slices >= 2, 0 < alpha < 1, min_slices >= 2")
        if max_step is not None and max_step < 1:
            raise ValueError("max_step must be >= 1 (None: the whole gap)")
        if recent is not None and not 0 < recent < 1:
            raise ValueError("recent must be in (0, 1) (None: the whole window only)")
        if headroom is not None and headroom < 1:
            raise ValueError("headroom must be >= 1 (None: rule 3 prices capacity only)")
        if not 0 <= wait_spread <= 1:
            raise ValueError("wait_spread must be in [0, 1] (1: M/G/1's wait, 0: M/D/1's)")
        if not 0 <= tie < 1:
            raise ValueError("tie must be in [0, 1) (0: the best mean Θ alone)")
        if not 0 <= decode_exponent <= 4:
            raise ValueError("decode_exponent must be in [0, 4] (0: no split keeps more)")
        self.nodes_total = nodes_total
        self.interval = float(interval)
        self.window_s = float(window_s)
        self.slices = slices
        self.alpha = alpha
        self.min_gain = min_gain
        self.max_step = max_step
        self.min_slices = min_slices
        self.chunk_tokens = chunk_tokens
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_decode_batch = max_decode_batch
        self.memory = SplitMemory() if memory is None else memory
        # The decode engines reserve a request's KV at dispatch (SGLang's default, "early"),
        # not once its prefill is done: decode KV is then held through the prefill.
        self.early_allocation = early_allocation
        self.recent = recent
        self.shift_factor = shift_factor
        self.headroom = headroom
        # How much of the prefill times' spread the prefill queue's wait in Θ counts (1: all
        # of it, M/G/1's; 0: none, M/D/1's, as before 2026-12-07). The wait holds decode KV
        # under early allocation: with the spread counted, OSWorld at 500 held-out agents on
        # the paper's deployment went from 12 and 8 switches an hour to 2 (1.055x and 1.054x
        # the best static split), the H100s' Mooncake 120 s7 from 7P2D (0.973x) to 6P3D
        # (0.997x) (docs/scenarios.md, issue 25, 2026-12-07, fifth session; one node's queue).
        self.wait_spread = wait_spread
        # How a candidate's decode nodes scale the cache's retention time in the reuse model
        # (`reuse.SliceReuse.on`: τ times the decode nodes' ratio to this power). Larger ones
        # (1.5, 2.0) were screened for the H100s' Claude Code 150, whose cache differs between
        # splits mostly by the time between turns, and not kept: they stand in for longer gaps
        # at one load only (docs/scenarios.md, issue 25, 2026-12-07, sixth session).
        self.decode_exponent = decode_exponent
        self.tie = tie
        self.last: Evaluation | None = None
        # The last move asked for: when, and +1 towards prefill or -1 towards decode (rule 5).
        self.moved: tuple[float, int] | None = None

    def evaluate(
        self, now: float, split: Split, window: Sequence[SliceStats], model: IterationModel
    ) -> Evaluation | None:
        """The best candidate and its significance; None when too few slices have arrivals."""
        n = self.nodes_total
        if split.prefill + split.decode != n or split.prefill < 1 or split.decode < 1:
            raise ValueError(f"split {split} is not a split of {n} nodes with both phases")
        binned = rebin(window, now, self.window_s, self.slices)
        kept = [(s, m) for s in binned if (m := MeanRequest.of(s)) is not None]
        if len(kept) < self.min_slices:
            return None
        mix = [m for _, m in kept]
        times = np.array([(s.start + s.end) / 2 for s, _ in kept])
        kv = self._kv_tokens(model)
        xs = np.arange(1, n)  # prefill nodes of each candidate
        # μ_P per slice at each candidate's loss of cached blocks (`hits`) and cache (`reuse`).
        losses = self.memory.losses([int(x) for x in xs])
        factors = [1.0 if f is None else f for f in losses]
        reuse = [_reuse_model(s) for s, _ in kept]
        mu_p = np.stack(
            [
                self._prefill_rates(model, kept, reuse, f, int(n - x))
                for f, x in zip(factors, xs, strict=True)
            ],
            axis=1,
        )  # (slices, candidates)
        theta = np.empty_like(mu_p)
        cur = split.prefill - 1
        demands = []
        # The spread of each slice's prefill times (for the queue wait, M/G/1).
        spreads = [self._spread(model, s) for s, _ in kept]
        for i, (s, m) in enumerate(kept):
            # The same for every candidate but its μ_P.
            demand = self._demand(model, m, self.wait_spread * spreads[i], s.arrivals)
            at = [dataclasses.replace(demand, mu_p=float(mu_p[i, k])) for k in range(len(xs))]
            for k, x in enumerate(xs):
                y = int(n - x)
                theta[i, k] = split_rate(model, at[k], int(x), y, kv, self.max_decode_batch)
            demands.append(at)
        served = theta.copy()  # what the slices' agents would send each (rule 3)
        if self.headroom is not None and self._idle([s for s, _ in kept], theta[:, cur]):
            for i, (s, _) in enumerate(kept):
                at = [dataclasses.replace(d, service_scv=spreads[i]) for d in demands[i]]
                self._close_loop(model, s, at, served[i], cur)
        mean_theta = theta.mean(axis=0)
        # The best mean Θ, and every candidate within `tie` of it: the one closest to the
        # current split among them is the target (rule 2).
        top = float(mean_theta.max())
        ties = [k for k in range(len(xs)) if mean_theta[k] >= top * (1 - max(self.tie, 1e-9))]
        best = min(ties, key=lambda k: abs(k - cur))
        gains = theta[:, best] / theta[:, cur] - 1.0
        loop_gain = float((served[:, best] / served[:, cur] - 1.0).mean())
        return Evaluation(
            at=now,
            current=split,
            target=Split(int(xs[best]), int(n - xs[best])),
            slices=len(mix),
            mean_theta=float(mean_theta[best]),
            mean_gain=float(gains.mean()),
            p_value=_one_sided_p(gains),
            gain_now=_line_at(times, gains, float(times.max()) + self.window_s / self.slices),
            thetas=tuple(float(t) for t in mean_theta),
            loop_gain=loop_gain,
        )

    def _close_loop(
        self,
        model: IterationModel,
        s: SliceStats,
        at: Sequence[SliceDemand],
        theta: npt.NDArray[np.float64],
        cur: int,
    ) -> None:
        """`theta` (one slice's capacities, by candidate) replaced in place by the rates the
        slice's agents would send each candidate (`throughput.closed_loop_rate`, rule 3): as
        many agents as keep the slice's arrival rate going at the current split, each thinking
        the slice's mean think time. Kept as capacities where the slice knows no think time."""
        assert self.headroom is not None, "rule 3's closed loop is on"
        if s.think_requests < MIN_THINK_REQUESTS:
            return
        rate = s.requests / max(s.end - s.start, 1e-9)
        x, n = cur + 1, self.nodes_total
        now = answer(model, at[cur], rate, x, n - x, self.max_decode_batch)
        if now is None:
            return
        loop = _loop(s, rate, now)
        for k in range(len(theta)):
            theta[k] = closed_loop_rate(
                model, at[k], k + 1, n - k - 1, float(theta[k]), loop, self.max_decode_batch
            )

    def _idle(self, slices: Sequence[SliceStats], capacity: npt.NDArray[np.float64]) -> bool:
        """Whether the window's arrivals ran at most 1/`headroom` of the current split's
        capacity (`capacity`: by slice), the regime where rule 3 prices every slice by its
        agents. Why the window's and not each slice's: one slice's rate near the line crossed
        it or not by a few percent, and a slice priced by capacity among slices priced by the
        loop carries the whole gain. On Claude Code at 300 agents on the paper's deployment
        (tuning grid, seed 0) the three slices after a move to 5P4D ran at 4.2-4.8 requests/s
        against capacities of 13.7-27.4: the one at 4.83 (x 3 > 13.69) priced 3P6D 48% better
        on its decode KV and the other two 0%, a mean gain of 34% that moved two nodes to a split
        8% below 5P4D, undone seven minutes later (Claude Code at 220 held-out agents did the
        same twice an hour)."""
        assert self.headroom is not None, "rule 3's closed loop is on"
        span = sum(max(s.end - s.start, 1e-9) for s in slices)
        rate = sum(s.requests for s in slices) / span
        return rate * self.headroom <= float(np.mean(capacity))

    def decision(self, now: float, asked: Split | None) -> dict[str, Any] | None:
        """The record of the decision made at `now` (`Evaluation.record`), None when none was
        evaluated then (a switch in flight, too few slices with arrivals)."""
        ev = self.last
        return ev.record(asked) if ev is not None and ev.at == now else None

    def _spread(self, model: IterationModel, s: SliceStats) -> float:
        """The squared coefficient of variation of the slice's sampled arrivals' prefill times
        (0 without two of them)."""
        return _scv([prefill_seconds(model, u, c, self.chunk_tokens) for u, c in s.arrivals])

    def _demand(
        self,
        model: IterationModel,
        m: MeanRequest,
        scv: float = 0.0,
        arrivals: Sequence[tuple[int, int]] = (),
    ) -> SliceDemand:
        """What a slice asks of a split (`throughput.SliceDemand.of`), at this planner's chunk
        and allocation; the candidate's μ_P is set by the caller."""
        return SliceDemand.of(
            model, m, self.chunk_tokens, early=self.early_allocation, scv=scv, arrivals=arrivals
        )

    def _prefill_rates(
        self,
        model: IterationModel,
        kept: Sequence[tuple[SliceStats, MeanRequest]],
        reuse: Sequence[SliceReuse | None],
        loss: float,
        decode_nodes: int,
    ) -> npt.NDArray[np.float64]:
        """μ_P of each slice at a candidate with `decode_nodes` decode nodes: its sampled
        arrivals with the cache that split would keep (`reuse.SliceReuse`, where the slice lost
        reuse) and `loss` times their uncached tokens, batched as a prefill node would
        (`common.packed_prefill_rate`); the mean request when the driver sampled none."""
        out = []
        for (s, m), r in zip(kept, reuse, strict=True):
            if s.arrivals:
                arrivals = s.arrivals if r is None else r.on(decode_nodes, self.decode_exponent)
                lost = [_lose(u, c, loss) for u, c in arrivals]
                out.append(packed_prefill_rate(model, lost, self.chunk_tokens))
                continue
            u, c = _lose(m.uncached, m.cached, loss)
            out.append(prefill_rate(model, u, c, self.chunk_tokens))
        return np.array(out)

    def decide(
        self, now: float, split: Split, window: Sequence[SliceStats], model: IterationModel
    ) -> Split | None:
        self.memory.note(now, split, window, switching=self.in_flight)
        if self.in_flight:
            return None
        self.last, ev = self._move(now, split, window, model)
        if ev is None and self.recent is not None:  # rule 7: the mix may have shifted
            cut = now - self.recent * self.window_s
            recent = [s for s in window if s.start >= cut]
            if self.shift_factor is not None:
                older = [s for s in window if s.start < cut]
                if not mix_shifted(older, recent, self.shift_factor):
                    return None
            _, ev = self._move(now, split, recent, model)
            if ev is not None:
                self.last = ev
        if ev is None:
            return None
        direction = 1 if ev.target.prefill > split.prefill else -1
        move = ev.target.prefill - split.prefill
        if self.max_step is not None:
            move = max(-self.max_step, min(self.max_step, move))
        self.moved = (now, direction)
        return self._propose(split, Split(split.prefill + move, split.decode - move))

    def _move(
        self, now: float, split: Split, window: Sequence[SliceStats], model: IterationModel
    ) -> tuple[Evaluation | None, Evaluation | None]:
        """Rules 1-5 on these slices: (the last evaluation made, the one to move on or None)."""
        ev = self.evaluate(now, split, window, model)
        if ev is None or ev.target == split:
            return ev, None
        direction = 1 if ev.target.prefill > split.prefill else -1
        if self.moved is not None:
            at, last = self.moved
            if direction != last and at > now - self.window_s:  # rule 5: since the move only
                since = [s for s in window if s.start >= at]
                ev = self.evaluate(now, split, since, model)
                if (
                    ev is None
                    or ev.target == split
                    or (ev.target.prefill > split.prefill) != (direction > 0)
                ):
                    return ev, None
        return ev, ev if self._significant(ev) else None

    def _significant(self, ev: Evaluation) -> bool:
        """Rules 3 and 4: a significant mean gain, large enough, that persists."""
        return (
            ev.p_value < self.alpha
            and ev.mean_gain >= self.min_gain
            and ev.gain_now >= self.min_gain
            and ev.loop_gain >= self.min_gain
        )

    def _kv_tokens(self, model: IterationModel) -> int:
        if self.kv_capacity_tokens is not None:
            return self.kv_capacity_tokens
        if model.deployment is None:
            raise ValueError("kv_capacity_tokens is needed when the model has no deployment")
        return kv_capacity_tokens(model.deployment)


def mix_signature(window: Sequence[SliceStats]) -> tuple[float, float, float] | None:
    """What a mix is, whatever the cluster made of it: mean prompt tokens, mean output tokens
    and the share of the prompts no cache could have held (from the sampled arrivals' reusable
    prefixes, `reuse.Reuse.tokens`; 1 when untracked). None without arrivals."""
    requests = sum(s.requests for s in window)
    if requests == 0:
        return None
    prompt = sum(s.prompt_tokens for s in window) / requests
    output = max(sum(s.output_tokens for s in window) / requests, 1.0)
    sampled = [
        (u + c, r.tokens)
        for s in window
        if len(s.arrival_reuse) == len(s.arrivals)
        for (u, c), r in zip(s.arrivals, s.arrival_reuse, strict=True)
    ]
    total = sum(p for p, _ in sampled)
    fresh = 1.0 - sum(min(t, p) for p, t in sampled) / total if total > 0 else 1.0
    return prompt, output, fresh


def mix_shifted(older: Sequence[SliceStats], recent: Sequence[SliceStats], factor: float) -> bool:
    """Whether the mix of `recent` differs from that of `older` by `factor` or more in one of
    its signature's figures (`mix_signature`). Rule 7 reads the latest half alone when the mix
    shifted; a change in what the cluster did with the same mix is not one: on OSWorld at 120
    agents (36 H100s, seed 3, a tuning draw) the cache lost the sessions' contexts for a few
    minutes (uncached tokens per request 2.7k -> 12k, prompts 1.4x), the latest half priced
    3P6D above 2P7D, and the move made the loss last ten minutes instead of two."""
    a, b = mix_signature(older), mix_signature(recent)
    if a is None or b is None:
        return b is not None  # arrivals only lately: the mix is new
    # Shares under FRESH_FLOOR count as FRESH_FLOOR: a ratio of two near-zero shares is noise.
    fresh_a, fresh_b = max(a[2], FRESH_FLOOR), max(b[2], FRESH_FLOOR)
    ratios = (b[0] / max(a[0], 1.0), b[1] / a[1], fresh_b / fresh_a)
    return any(r >= factor or r <= 1.0 / factor for r in ratios)


def _reuse_model(s: SliceStats) -> SliceReuse | None:
    """The slice's reuse model; None when it tracked no reuse, lost none, or ran with its
    decode KV full of running requests (every candidate then keeps the estimate).

    The model's premise is that decode nodes keep the last turns between them, so that more
    decode nodes keep more. Where running requests fill their KV (`FULL_DECODE_KV`), they keep
    nothing between turns: what is reused lives on the prefill nodes and in the pool, and the
    losses come from there. OSWorld at 500 agents on the paper's deployment ran at 98.6% and
    the model priced 6P3D (the best split by 34%) below 5P4D, where the planner then stayed.
    """
    if not s.arrival_reuse or s.mean_decode_nodes <= 0 or s.kv_utilization >= FULL_DECODE_KV:
        return None
    return SliceReuse.of(s.arrivals, s.arrival_reuse, s.mean_decode_nodes)


def _loop(s: SliceStats, rate: float, model: Answer) -> Loop:
    """The slice's agents (`throughput.Loop`): as many as keep `rate` going at the current
    split with the slice's think time and observed answers, whose time over the model's
    (`model`) scales every candidate's; the model's answers where too few were observed."""
    modelled = model.total()
    if s.answered < MIN_THINK_REQUESTS or s.response_s <= 0.0 or modelled <= 0.0:
        return Loop(rate * (s.think_s + modelled), s.think_s)
    scale = min(max(s.response_s / modelled, ANSWER_SCALE[0]), ANSWER_SCALE[1])
    return Loop(rate * (s.think_s + s.response_s), s.think_s, scale)


def _scv(values: Sequence[float]) -> float:
    """The squared coefficient of variation of `values` (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    a = np.asarray(values, dtype=np.float64)
    mean = float(a.mean())
    return float(a.var()) / (mean * mean) if mean > 0 else 0.0


def _lose(uncached: float, cached: float, loss: float) -> tuple[float, float]:
    """(uncached, cached) with `loss` times the uncached tokens, within the prompt."""
    prompt = uncached + cached
    u = min(max(uncached * loss, 1.0), prompt)
    return u, prompt - u


def _line_at(times: npt.NDArray[np.float64], gains: npt.NDArray[np.float64], t: float) -> float:
    """The least-squares line through (time, gain), read at `t` (the mean when every slice has
    the same time)."""
    dt = times - times.mean()
    sxx = float(dt @ dt)
    mean = float(gains.mean())
    if sxx <= 0.0:
        return mean
    slope = float(dt @ (gains - mean)) / sxx
    return mean + slope * (t - float(times.mean()))


def _one_sided_p(gains: npt.NDArray[np.float64]) -> float:
    """P-value of a one-sided paired t-test that the mean gain is > 0."""
    mean = float(gains.mean())
    sd = float(gains.std(ddof=1))
    if sd == 0.0 or not math.isfinite(sd):
        return 0.0 if mean > 0 else 1.0  # every slice agrees exactly
    t = mean / (sd / math.sqrt(len(gains)))
    # Imported here: scipy.stats takes ~1 s to import, which a router restart should not wait
    # for (the router imports it in the background once it serves, see router/daemon.py).
    from scipy import stats

    return float(stats.t.sf(t, len(gains) - 1))
