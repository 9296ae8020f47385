"""The `evolving` planner: the split with the best predicted throughput, switched to only when
the gain is significant across the window's slices (DESIGN §3, "Phase split").

For a candidate split xPyD (x + y = N) and a slice s of the window, the predicted cluster
throughput is Θ_s(x) = min(x·μ_P(s), y·μ_D(s)) requests/s, with per-node service rates from the
fitted iteration-time model and the slice's mean request (`common.MeanRequest`):

- μ_P: a prefill node's requests/s for a request of the slice's mean uncached and cached tokens,
  the uncached ones as the placements estimated them times the loss the planner remembers for
  that candidate split (`hits.SplitMemory`: how much more the prefills computed than estimated
  while the split ran; 1 for a split not run recently),
  iterations batching as many whole requests as fit the chunk budget (8192 tokens, SGLang's
  default; a longer request runs in chunks), `model.predict_prefill`;
- μ_D: a decode node's tokens/s at the batch that fits its KV at the slice's mean context
  (capped at `max_decode_batch`), `model.predict_decode`, over the mean output tokens.

Rule, every `interval` (60 s) over a `window_s` (600 s) window cut into `slices` (10) slices:
1. slices without arrivals are dropped (they say nothing about the mix); fewer than
   `min_slices` left: keep the split;
2. the candidate with the best mean Θ over the slices is the target (ties: the fewest nodes
   moved); if it is the current split, keep;
3. per-slice relative gains g_s = Θ_s(target) / Θ_s(current) - 1 are tested with a one-sided
   paired t-test (H0: mean gain <= 0; `scipy.stats.t`); switch only if p < `alpha` AND the
   mean gain >= `min_gain`. One bursty slice among calm ones gives one large gain among
   small or negative ones: a large variance, so no switch (a burst of sub-agents must not flip
   nodes, DESIGN §3);
4. move at most `max_step` nodes. Default: the whole gap. The switch keeps the KV in place
   (6.2 s per node, docs/simulator.md) and the test already guards against noise, so stepping
   one node per minute would only hold a known-better split back; set `max_step=1` to creep.

While a switch is in flight (until `switch_done()`), no decision is made.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from evolving_infra.planner.base import SliceStats, Split, SwitchMode
from evolving_infra.planner.common import (
    CHUNK_TOKENS,
    MAX_DECODE_BATCH,
    MeanRequest,
    PlannerGate,
    decode_rate,
    kv_capacity_tokens,
    prefill_rate,
    rebin,
)
from evolving_infra.planner.hits import SplitMemory
from evolving_infra.timing.model import IterationModel


@dataclass(frozen=True, slots=True)
class Evaluation:
    """What the planner computed for one decision (for tests, logs and the simulator's plots)."""

    current: Split
    target: Split  # the candidate with the best mean Θ
    slices: int  # slices with arrivals that entered the test
    mean_theta: float  # the target's mean Θ, requests/s
    mean_gain: float  # mean relative per-slice gain of the target over the current split
    p_value: float  # one-sided paired t-test of the gains


class EvolvingPlanner(PlannerGate):
    """Θ = min(Σμ_P, Σμ_D) per candidate split per slice; switch on a significant gain."""

    name = "evolving"
    switch_mode: SwitchMode = "in-place-keep"

    def __init__(
        self,
        nodes_total: int,
        *,
        interval: float = 60.0,
        window_s: float = 600.0,
        slices: int = 10,
        alpha: float = 0.05,
        min_gain: float = 0.02,
        max_step: int | None = None,
        min_slices: int = 3,
        chunk_tokens: int = CHUNK_TOKENS,
        kv_capacity_tokens: int | None = None,
        max_decode_batch: int = MAX_DECODE_BATCH,
        memory: SplitMemory | None = None,
    ) -> None:
        super().__init__()
        if nodes_total < 2 or slices < 2 or not 0 < alpha < 1 or min_slices < 2:
            raise ValueError("need nodes_total >= 2, slices >= 2, 0 < alpha < 1, min_slices >= 2")
        if max_step is not None and max_step < 1:
            raise ValueError("max_step must be >= 1 (None: the whole gap)")
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
        self.last: Evaluation | None = None

    def evaluate(
        self, now: float, split: Split, window: Sequence[SliceStats], model: IterationModel
    ) -> Evaluation | None:
        """The best candidate and its significance; None when too few slices have arrivals."""
        n = self.nodes_total
        if split.prefill + split.decode != n or split.prefill < 1 or split.decode < 1:
            raise ValueError(f"split {split} is not a split of {n} nodes with both phases")
        means = [MeanRequest.of(s) for s in rebin(window, now, self.window_s, self.slices)]
        mix = [m for m in means if m is not None]
        if len(mix) < self.min_slices:
            return None
        kv = self._kv_tokens(model)
        mu_d = np.array([decode_rate(model, m, kv, self.max_decode_batch) for m in mix])
        xs = np.arange(1, n)  # prefill nodes of each candidate
        # μ_P per slice at each candidate's loss of cached blocks (`hits`); one row per distinct
        # loss: untried candidates share one.
        losses = self.memory.losses([int(x) for x in xs])
        factors = [1.0 if f is None else f for f in losses]
        rows = {f: self._prefill_rates(model, mix, f) for f in set(factors)}
        mu_p = np.stack([rows[f] for f in factors], axis=1)  # (slices, candidates)
        theta = np.minimum(mu_p * xs, np.outer(mu_d, n - xs))
        mean_theta = theta.mean(axis=0)
        cur = split.prefill - 1
        # Best mean Θ; among ties (within a relative 1e-9) the one closest to the current split.
        top = float(mean_theta.max())
        ties = [k for k in range(len(xs)) if mean_theta[k] >= top * (1 - 1e-9)]
        best = min(ties, key=lambda k: abs(k - cur))
        gains = theta[:, best] / theta[:, cur] - 1.0
        return Evaluation(
            current=split,
            target=Split(int(xs[best]), int(n - xs[best])),
            slices=len(mix),
            mean_theta=float(mean_theta[best]),
            mean_gain=float(gains.mean()),
            p_value=_one_sided_p(gains),
        )

    def _prefill_rates(
        self, model: IterationModel, mix: Sequence[MeanRequest], loss: float
    ) -> npt.NDArray[np.float64]:
        """μ_P of each slice's mean request with `loss` times its estimated uncached tokens."""
        out = []
        for m in mix:
            prompt = m.uncached + m.cached
            u = min(max(m.uncached * loss, 1.0), prompt)
            out.append(prefill_rate(model, u, prompt - u, self.chunk_tokens))
        return np.array(out)

    def decide(
        self, now: float, split: Split, window: Sequence[SliceStats], model: IterationModel
    ) -> Split | None:
        self.memory.note(now, split, window, switching=self.in_flight)
        if self.in_flight:
            return None
        ev = self.last = self.evaluate(now, split, window, model)
        if ev is None or ev.target == split:
            return None
        if not (ev.p_value < self.alpha and ev.mean_gain >= self.min_gain):
            return None
        move = ev.target.prefill - split.prefill
        if self.max_step is not None:
            move = max(-self.max_step, min(self.max_step, move))
        return self._propose(split, Split(split.prefill + move, split.decode - move))

    def _kv_tokens(self, model: IterationModel) -> int:
        if self.kv_capacity_tokens is not None:
            return self.kv_capacity_tokens
        if model.deployment is None:
            raise ValueError("kv_capacity_tokens is needed when the model has no deployment")
        return kv_capacity_tokens(model.deployment)


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
