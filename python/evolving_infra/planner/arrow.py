"""The `arrow` planner: flip one instance between prefill and decode on coarse load signals.

Arrow (Wu et al. 2025, "Arrow: Adaptive Scheduling Mechanisms for Disaggregated LLM Inference
Architecture", arXiv 2505.11916) keeps instances stateless and moves them between the prefill
and decode pools "based on real-time cluster performance metrics" (its abstract); an instance
changes role in place, without a restart, and its KV does not survive the change
(docs/simulator.md: `in-place-drop`). The paper's exact triggers are not reproduced here; what
is assumed, as the baseline DESIGN §3 describes ("coarse planner"):

- signals over the last `interval`: the prefill nodes' mean predicted queue drain time (how
  far prefill lags) and the decode nodes' mean KV utilisation (how full decode is);
- prefill is short above `queue_up_s` (1 s: twice Dynamo's 500 ms TTFT SLA spent waiting),
  has a node to spare below `queue_down_s` (0.1 s); decode is short above `kv_up` (0.9) and
  has one to spare below `kv_down` (0.5) — the KV thresholds of Dynamo's older planner, the
  other coarse-signal planner in the field (notes/dynamo-kv-router.md §6);
- ±1 node per decision with the fixed-total rule of `common.pressure_step`, a decision every
  `interval` (10 s), none while a switch is in flight, and none within `cooldown` (30 s) of the
  previous one, so a node's KV refills before the signals are read again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from evolving_infra.planner.base import SliceStats, Split, SwitchMode
from evolving_infra.planner.common import PlannerGate, pressure_step, recent
from evolving_infra.timing.model import IterationModel


class ArrowPlanner(PlannerGate):
    """Queue-drain and KV-utilisation thresholds, ±1 node per decision, with a cool-down."""

    name = "arrow"
    switch_mode: SwitchMode = "in-place-drop"

    def __init__(
        self,
        *,
        interval: float = 10.0,
        cooldown: float = 30.0,
        queue_up_s: float = 1.0,
        queue_down_s: float = 0.1,
        kv_up: float = 0.9,
        kv_down: float = 0.5,
        min_nodes: int = 1,
    ) -> None:
        super().__init__()
        if not (0 <= queue_down_s < queue_up_s and 0 <= kv_down < kv_up) or min_nodes < 1:
            raise ValueError("need down thresholds below up thresholds and min_nodes >= 1")
        self.interval = float(interval)
        self.cooldown = float(cooldown)
        self.queue_up_s, self.queue_down_s = queue_up_s, queue_down_s
        self.kv_up, self.kv_down = kv_up, kv_down
        self.min_nodes = min_nodes
        self.last_decision = -math.inf

    def decide(
        self, now: float, split: Split, window: Sequence[SliceStats], model: IterationModel
    ) -> Split | None:
        if self.in_flight or now - self.last_decision < self.cooldown:
            return None
        s = recent(window, now, self.interval)
        if s is None:
            return None
        q, kv = s.prefill_queue_s, s.kv_utilization
        target = pressure_step(
            split,
            p_up=q > self.queue_up_s,
            d_up=kv > self.kv_up,
            p_down=q < self.queue_down_s,
            d_down=kv < self.kv_down,
            min_nodes=self.min_nodes,
        )
        out = self._propose(split, target)
        if out is not None:
            self.last_decision = now
        return out
