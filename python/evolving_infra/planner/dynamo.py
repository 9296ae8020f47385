"""The `dynamo` planner: NVIDIA Dynamo's reactive planner, ±1 node per interval, restart switch.

Source: ai-dynamo/dynamo `docs/components/planner/planner-guide.md` (commit 092029ef…) and
`docs/design-docs/planner-design.md` (commit 320e674b…) (the project's notes on Dynamo, §6).

`mode="load"` (the default): Dynamo's load-based scaling (PRs #6145, #7351), every 5 s:
- estimated TTFT = the prefill nodes' queue drain time + a predicted (chunked) prefill of the
  mean request (Dynamo simulates chunked-prefill TTFT from its prefill regression);
- estimated ITL = `predict_decode` at the mean decode batch and its context;
- a phase is short when its estimate exceeds its SLA (Dynamo defaults: TTFT 500 ms, ITL
  50 ms), has nodes to spare when below SLA x `down_sensitivity` (0.8, Dynamo's
  `load_scaling_down_sensitivity` 80 %).
Dynamo decides per engine ("all engines exceed"); the slices carry cluster means, so the
estimate here is of the mean engine — with a balancing router the engines are close to it.

`mode="utilization"`: the older load planner (≤ v0.3/0.4, PR #528; `examples/llm/components/
planner.py`), every 30 s: decode short at mean KV utilisation > 0.9, spare < 0.5; prefill on
the prefill queue "utilisation" — the requests waiting in the prefill queue — short > 0.5,
spare < 0.2 (its documented defaults; later releases raised the up threshold to 5.0). Queued
requests are estimated as prefill nodes x queue drain time / one mean request's prefill.

Load mode is the default: it is the current planner (the queue/KV planner was deprecated as
"inoperable" once engines stopped using a global prefill queue), it is what docs/simulator.md
specifies for the `dynamo` policy, and it reacts to latency, which is what its SLAs state.
(Dynamo's default-on throughput mode needs an offline profile and a traffic predictor over
180 s intervals; it is not modelled.)

Dynamo scales replicas within a GPU budget; here the node total is fixed, so one phase scaling
up takes a node from the other and one scaling down gives its node to the other
(`common.pressure_step`). ±1 per decision, and, as in Dynamo ("no new action until the previous
completes"), nothing while a switch is in flight: the driver calls `switch_done()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from evolving_infra.planner.base import SliceStats, Split, SwitchMode
from evolving_infra.planner.common import (
    CHUNK_TOKENS,
    MeanRequest,
    PlannerGate,
    prefill_seconds,
    pressure_step,
    recent,
)
from evolving_infra.timing.model import IterationModel

DynamoMode = Literal["load", "utilization"]
INTERVAL: dict[DynamoMode, float] = {"load": 5.0, "utilization": 30.0}


class DynamoPlanner(PlannerGate):
    """Dynamo's SLA load planner (default) or its older KV/queue-threshold planner."""

    name = "dynamo"
    switch_mode: SwitchMode = "restart"

    def __init__(
        self,
        *,
        mode: DynamoMode = "load",
        interval: float | None = None,
        ttft_sla: float = 0.5,
        itl_sla: float = 0.05,
        down_sensitivity: float = 0.8,
        kv_up: float = 0.9,
        kv_down: float = 0.5,
        queue_up: float = 0.5,
        queue_down: float = 0.2,
        min_nodes: int = 1,
        chunk_tokens: int = CHUNK_TOKENS,
    ) -> None:
        super().__init__()
        if mode not in INTERVAL:
            raise ValueError(f"unknown mode {mode!r} (load or utilization)")
        if ttft_sla <= 0 or itl_sla <= 0 or not 0 < down_sensitivity <= 1 or min_nodes < 1:
            raise ValueError("need SLAs > 0, 0 < down_sensitivity <= 1 and min_nodes >= 1")
        self.mode: DynamoMode = mode
        self.interval = float(interval if interval is not None else INTERVAL[mode])
        self.ttft_sla, self.itl_sla, self.down_sensitivity = ttft_sla, itl_sla, down_sensitivity
        self.kv_up, self.kv_down, self.queue_up, self.queue_down = (
            kv_up,
            kv_down,
            queue_up,
            queue_down,
        )
        self.min_nodes = min_nodes
        self.chunk_tokens = chunk_tokens

    def estimates(self, s: SliceStats, model: IterationModel) -> tuple[float, float]:
        """(estimated TTFT, estimated ITL) in seconds for the slice's mean engine."""
        ttft = s.prefill_queue_s + self.one_prefill(s, model)
        itl = 0.0
        if s.mean_decode_batch > 0:
            batch = max(round(s.mean_decode_batch), 1)
            itl = model.predict_decode(batch, round(batch * s.mean_context_tokens))
        return ttft, itl

    def decide(
        self, now: float, split: Split, window: Sequence[SliceStats], model: IterationModel
    ) -> Split | None:
        if self.in_flight:
            return None
        s = recent(window, now, self.interval)
        if s is None:
            return None
        if self.mode == "load":
            ttft, itl = self.estimates(s, model)
            k = self.down_sensitivity
            p_up, p_down = ttft > self.ttft_sla, ttft < self.ttft_sla * k
            d_up, d_down = itl > self.itl_sla, itl < self.itl_sla * k
        else:
            queued = self.queued_requests(s, split, model)
            p_up, p_down = queued > self.queue_up, queued < self.queue_down
            d_up, d_down = s.kv_utilization > self.kv_up, s.kv_utilization < self.kv_down
        target = pressure_step(split, p_up, d_up, p_down, d_down, self.min_nodes)
        return self._propose(split, target)

    def queued_requests(self, s: SliceStats, split: Split, model: IterationModel) -> float:
        """Requests waiting in the prefill queues: nodes x drain time / one request's prefill."""
        if s.prefill_queue_s <= 0:
            return 0.0
        return split.prefill * s.prefill_queue_s / self.one_prefill(s, model)

    def one_prefill(self, s: SliceStats, model: IterationModel) -> float:
        """Predicted prefill seconds of the slice's mean request alone (chunked); a slice
        without arrivals falls back to its mean prompt, uncached."""
        mean = MeanRequest.of(s)
        if mean is None:
            return prefill_seconds(model, max(s.mean_input_tokens, 1.0), 0.0, self.chunk_tokens)
        return prefill_seconds(model, mean.uncached, mean.cached, self.chunk_tokens)
