"""The `arrow` planner: Arrow's instance flipping between its prefill and decode pools.

Arrow (Wu et al. 2025, "Arrow: Adaptive Scheduling Mechanisms for Disaggregated LLM Inference
Architecture", arXiv 2505.11916) keeps instances stateless and "dynamically adjusts the number
of instances handling prefill and decode tasks based on real-time cluster performance metrics"
(abstract, v1 and v2). An instance changes role in place, without a restart, and its KV does
not survive the change (docs/simulator.md: `in-place-drop`).

Sources. The abstract is read from arxiv.org/abs/2505.11916 (v1 and v2). The body (§5.3's
Algorithm 1, §5.5's loads and Algorithms 2 and 3) could not be read here; what follows is §5.3
and §5.5 as Narwhal, the one public implementation, reads and quotes them
(github.com/athrael-soju/Narwhal at cb74e110: `src/narwhal/scheduler.py`, `monitor.py`,
`tests/test_scheduler.py`). The quotes below are Narwhal's quotes of the paper, not checked
against it.

What Arrow reads, and what stands for it here (loads are "ratios against the SLO target", §5.5):
- prefill load: an instance's resident prefill work, as estimated prefill seconds, over the
  TTFT SLO; the pool's is the mean over its instances. Here `SliceStats.prefill_queue_s /
  ttft_slo`: each prefill node's queued and running work, not its bootstrap queue's (requests
  waiting for decode KV are a decode shortage, not prefill demand: `Node.prefill_demand_s`).
- decode load: "the average latency of tokens generated between the update interval" over the
  TPOT SLO, the pool's mean. Here the fitted model's decode step at the interval's mean decode
  batch and context (`predict_decode`), over `tpot_slo`: a predicted, not an observed, latency.
- Algorithm 1 (§5.3), on every request: the instance of least cost that meets the SLO takes it
  (prefill: resident prefill seconds + its own <= the TTFT SLO; decode: resident decode tokens
  + its length <= MT(i), the tokens instance i holds within the TPOT SLO). When none meets it,
  an instance flips (Algorithm 3): decode -> prefill "when the scheduler predicts that the
  current prefill instances cannot meet the TTFT SLO", unless decode load is high, "to avoid
  scenarios where a large number of requests occupy memory resources without progressing
  beyond the prefill phase"; prefill -> decode for a decode request no decode instance can
  hold. Here, once per update interval, on the interval's mean request: decode -> prefill when
  the least loaded prefill node's drain (`min_prefill_queue_s`, bootstrap queue excluded) plus
  the mean arrival's own prefill is over `ttft_slo` and decode load is below `shrink`;
  prefill -> decode when the least loaded decode node's KV tokens (`min_decode_kv_tokens`)
  plus the mean prefilled prompt exceed the model's TPOT-bound MT, or when the emptiest decode
  node's cache (`min_decode_kv_demand`, `decode_kv_capacity_tokens`) has no room for the
  request's whole KV, prompt and output, which a simulated (SGLang) decode node reserves at
  admission (the memory bound is ours: MT in the paper is TPOT's).
- Algorithm 2 (§5.5), the monitoring loop every update interval: prefill -> decode when decode
  load is at least `expand`, or prefill load is at most `shrink` while decode load is at
  least `shrink` (prefill idle, decode not), the trigger held "over a period of time"
  (`sustain` consecutive intervals).
- Algorithm 3 (§5.5): one instance moves, and the pool it leaves keeps one (`|S| > 1`,
  `min_nodes`); the instance is the one with the least resident work (the driver's choice).
  Arrow first takes an instance whose last flip "is not yet complete" (it still holds the other
  type's requests); a simulated node drains before it flips, so there is none.
- The cooldown applies to prefill -> decode only, "to prevent oscillation in instance
  assignment"; decode -> prefill never waits: "TTFT, due to its strong predictability and
  sensitivity to traffic spikes, requires rapid instance scheduling".

The two directions have their own triggers, so the symmetric fixed-total rule this planner
used before (`pressure_step`: a short phase takes a node unless the other is short too, a
spare one gives one) is not Arrow's: a flip is one instance from one pool to the other (the
total is fixed), each direction on its own trigger, and decode load alone can take a prefill
instance while prefill is loaded too.
When both directions fire in one interval, decode -> prefill goes (Algorithm 1's prefill side
is ungated; the other waits for the next interval). As everywhere, nothing is decided while a
switch is in flight.

Assumed, not read from the paper: the SLOs. TPOT 50 ms is Dynamo's default ITL SLA; TTFT is
5 s, not Dynamo's 500 ms: a request's own prefill is 1-2 s for cc's fresh 16-20k-token prompts
on the default 70B deployment (0.2-0.7 s for osworld's), so under 500 ms no instance can ever
meet the SLO, Algorithm 1 flips on nearly every arrival, and on cc-like traffic (100 agents,
36 GPUs, 20 min) it drove the split to 7P2D and served under half the requests it serves at
5 s, a few times the longest mean prefill alone (the figure is sensitive to it). Also assumed:
`expand` 1.0, `shrink` 0.5, a 10 s cooldown, `sustain` 3 and a 1 s update interval (Narwhal's
defaults; it says the paper names no count for `sustain`); "decode load is high" read as at
least `shrink` (Narwhal's reading: at `expand`, Algorithms 1 and 2 could both flip at one
decode load and trade an instance back and forth); the mean request standing for each request
of the interval, its output length the window's tokens decoded per arrival.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from evolving_infra.planner.base import SliceStats, Split, SwitchMode
from evolving_infra.planner.common import (
    CHUNK_TOKENS,
    MAX_DECODE_BATCH,
    MeanRequest,
    PlannerGate,
    prefill_seconds,
    recent,
)
from evolving_infra.timing.model import IterationModel

Flip = Literal["to-prefill", "to-decode"]


class ArrowPlanner(PlannerGate):
    """Arrow's Algorithms 1-3 on SLO-relative loads, one instance per flip."""

    name = "arrow"
    switch_mode: SwitchMode = "in-place-drop"

    def __init__(
        self,
        *,
        interval: float = 1.0,
        cooldown: float = 10.0,
        sustain: int = 3,
        ttft_slo: float = 5.0,
        tpot_slo: float = 0.05,
        expand: float = 1.0,
        shrink: float = 0.5,
        min_nodes: int = 1,
        chunk_tokens: int = CHUNK_TOKENS,
        max_batch: int = MAX_DECODE_BATCH,
    ) -> None:
        super().__init__()
        if not 0 <= shrink < expand or ttft_slo <= 0 or tpot_slo <= 0:
            raise ValueError("need SLOs > 0 and 0 <= shrink < expand")
        if interval <= 0 or cooldown < 0 or sustain < 1 or min_nodes < 1 or max_batch < 1:
            raise ValueError("need interval > 0, cooldown >= 0, sustain, min_nodes, max_batch >= 1")
        self.interval = float(interval)
        self.cooldown = float(cooldown)
        self.sustain = sustain
        self.ttft_slo, self.tpot_slo = ttft_slo, tpot_slo
        self.expand, self.shrink = expand, shrink
        self.min_nodes = min_nodes
        self.chunk_tokens = chunk_tokens
        self.max_batch = max_batch
        self.sustained = 0  # consecutive intervals Algorithm 2's trigger has held
        self.last_to_decode = -math.inf  # the last prefill -> decode flip (the cooldown's)
        self.last: Flip | None = None  # the last flip asked for, and by what
        self.last_by = ""

    # -- §5.5 loads ---------------------------------------------------------------------------

    def prefill_load(self, s: SliceStats) -> float:
        """The prefill pool's mean resident prefill seconds (bootstrap queue excluded) over the
        TTFT SLO."""
        return s.prefill_queue_s / self.ttft_slo

    def decode_load(self, s: SliceStats, model: IterationModel) -> float:
        """The decode step at the interval's mean decode batch and context over the TPOT SLO
        (0 for a pool that decoded nothing)."""
        if s.mean_decode_batch <= 0:
            return 0.0
        batch = max(round(s.mean_decode_batch), 1)
        return model.predict_decode(batch, round(batch * s.mean_context_tokens)) / self.tpot_slo

    # -- §5.3 Algorithm 1's "no instance meets the SLO" ---------------------------------------

    def prefill_short(self, s: SliceStats, model: IterationModel) -> bool:
        """No prefill instance meets the TTFT SLO for the interval's mean arrival: the least
        loaded one's drain plus its own (chunked) prefill is over it. No arrivals, no check."""
        mean = MeanRequest.of(s)
        if mean is None:
            return False
        own = prefill_seconds(model, mean.uncached, mean.cached, self.chunk_tokens)
        return s.min_prefill_queue_s + own > self.ttft_slo

    def max_tokens(self, model: IterationModel, context: float) -> float:
        """MT(i): the KV tokens a decode instance holds within the TPOT SLO at `context` tokens a
        request (the largest batch whose predicted step meets it, up to `max_batch`)."""
        ctx = max(context, 1.0)

        def meets(b: int) -> bool:
            return model.predict_decode(b, round(b * ctx)) <= self.tpot_slo

        if not meets(1):
            return 0.0
        lo, hi = 1, self.max_batch
        if meets(hi):
            lo = hi
        while hi - lo > 1:  # meets(lo), not meets(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if meets(mid) else (lo, mid)
        return lo * ctx

    def decode_short(self, s: SliceStats, model: IterationModel, output: float) -> bool:
        """No decode instance holds the interval's mean prefilled request (its prompt, and
        `output` tokens a request): the least loaded one's tokens plus the prompt are over MT,
        or the emptiest one's cache has no room for the request's whole KV (prompt and
        output, which a simulated decode node reserves at admission). No prefills, no check."""
        if s.prefills <= 0:
            return False
        prompt = s.prefilled_prompt_tokens / s.prefills
        context = s.mean_context_tokens if s.mean_context_tokens > 0 else prompt
        if s.min_decode_kv_tokens + prompt > self.max_tokens(model, context):
            return True
        cap = s.decode_kv_capacity_tokens
        return cap > 0 and (1.0 - s.min_decode_kv_demand) * cap < prompt + output

    # -- the decision -------------------------------------------------------------------------

    def flips(
        self, now: float, s: SliceStats, window: Sequence[SliceStats], model: IterationModel
    ) -> tuple[Flip | None, str]:
        """This interval's flip, if any, and what asked for it (advances Algorithm 2's count).
        `window`: the slices the output tokens a request are estimated over (arrivals against
        tokens decoded: over one interval the two do not match)."""
        lp, ld = self.prefill_load(s), self.decode_load(s, model)
        triggered = ld >= self.expand or lp <= self.shrink <= ld
        self.sustained = self.sustained + 1 if triggered else 0
        if self.prefill_short(s, model) and ld < self.shrink:
            return "to-prefill", "algorithm1"
        if now - self.last_to_decode < self.cooldown:
            return None, ""
        if self.decode_short(s, model, output_per_request(window)):
            return "to-decode", "algorithm1"
        if self.sustained >= self.sustain:
            return "to-decode", "algorithm2"
        return None, ""

    def decide(
        self, now: float, split: Split, window: Sequence[SliceStats], model: IterationModel
    ) -> Split | None:
        if self.in_flight:
            return None
        s = recent(window, now, self.interval)
        if s is None:
            return None
        flip, by = self.flips(now, s, window, model)
        if flip == "to-prefill" and split.decode > self.min_nodes:
            target = Split(split.prefill + 1, split.decode - 1)
        elif flip == "to-decode" and split.prefill > self.min_nodes:
            target = Split(split.prefill - 1, split.decode + 1)
        else:
            return None
        out = self._propose(split, target)
        if out is not None:
            self.last, self.last_by = flip, by
            if flip == "to-decode":
                self.last_to_decode = now
                self.sustained = 0
        return out


def output_per_request(window: Sequence[SliceStats]) -> float:
    """Tokens decoded per arrival over `window` (0 without arrivals)."""
    requests = sum(s.requests for s in window)
    return sum(s.output_tokens for s in window) / requests if requests else 0.0
