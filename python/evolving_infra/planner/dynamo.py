"""The Dynamo planners: NVIDIA Dynamo 1.6.1's planner, ±1 node per 5 s tick, restart switch.

Sources: the `ai-dynamo==1.6.1` wheel's `dynamo/planner/` (docs/baselines.md §1a, §2, each
threshold with its file and line).

`mode="throughput"` (`dynamo`): Dynamo's default `optimization_target`, static thresholds on
the busiest engine (`core/load_scaling.py:25-35`), no SLA and no performance model:
- prefill: queued prefill tokens / context length; +1 when any engine is >= 1.0, -1 when all are
  < 0.1 (the busiest one decides both: `SliceStats.max_queued_prefill_tokens`);
- decode: (scheduled + queued) KV tokens / the engine's KV capacity, "queued" being requests
  preempted back to the waiting queue; +1 when any is > 1.0, -1 when all are < 0.6
  (`SliceStats.max_decode_kv_demand`). SGLang admits a decode request only once its KV is
  allocated, and the simulated node never preempts, so in the simulator decode never asks for
  a node: it can only give one (as upstream does when nothing is preempted);
- a scale-down is refused when the busiest engine's load spread over the survivors would reach
  the scale-up threshold (`load_scaling.py:800-809`: `max * ready / desired >= up`).

`mode="load"` (`dynamo-load`): the SLA loop (`optimization_target: sla` with
`enable_load_scaling`, not a default, but the one NVIDIA's planner example configures), every
5 s: estimated TTFT = the prefill nodes' queue drain time + a predicted (chunked) prefill of the
mean request; estimated ITL = `predict_decode` at the mean decode batch and its context; a phase
is short when its estimate exceeds its SLA (TTFT 500 ms, ITL 50 ms), has nodes to spare when
below SLA x 0.8 (`load_scaling_down_sensitivity`). NOTE: upstream's guards are not modelled yet
(docs/baselines.md §2b, §6): it decides on all engines, not the mean one, counts queued decode
KV in its ITL and refuses a decode scale-down whose survivors' KV would not fit.

The GPU budget. The simulated cluster is Dynamo's `max_gpu_budget`: every node serves, so each
decision is taken at the ceiling, where Dynamo never takes a node from a phase whose own signal
did not say shrink (`core/budget.py:481-502`): a phase grows only when the other shrinks in the
same tick, and both move together (`throughput`; `rebalance`). A lone scale-down would leave
Dynamo's GPU idle until a scale-up takes it; here that node keeps serving its phase, which can
only favour the baseline. (`load` still trades a node whenever one phase is short or spare,
`common.pressure_step`, as before upstream's guards were read.) As in Dynamo ("no new action
until the previous completes"), nothing is decided while a switch is in flight.
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
from evolving_infra.timing.specs import LLAMA3_70B

DynamoMode = Literal["throughput", "load"]
INTERVAL = 5.0  # `load_adjustment_interval_seconds` (config/defaults.py:94-96)

# The `throughput` target's thresholds (core/load_scaling.py:25-27, 31-33).
PREFILL_UP = 1.0  # queued prefill tokens per context length, any engine
PREFILL_DOWN = 0.1  # ... all engines
DECODE_UP = 1.0  # (scheduled + queued) KV over KV capacity, any engine (strictly above)
DECODE_DOWN = 0.6  # ... all engines


def may_shrink(busiest: float, ready: int, up: float, min_nodes: int) -> bool:
    """Dynamo's consolidation guard on a scale-down (`load_scaling.py:800-809`): the busiest
    engine's load spread over one engine fewer must stay below the scale-up threshold, and the
    phase keeps `min_nodes` (`min_endpoint`, 1)."""
    desired = max(ready - 1, min_nodes)
    if desired >= ready:
        return False
    return not busiest * ready / desired >= up


def rebalance(split: Split, prefill: int, decode: int, min_nodes: int) -> Split | None:
    """A ±1 decision per phase (`prefill`, `decode` in {-1, 0, +1}) at the GPU ceiling: one
    node moves only when one phase grows and the other shrinks (`core/budget.py:481-502`,
    the opposing rebalance); otherwise the split holds."""
    if prefill > 0 > decode and split.decode > min_nodes:
        return Split(split.prefill + 1, split.decode - 1)
    if decode > 0 > prefill and split.prefill > min_nodes:
        return Split(split.prefill - 1, split.decode + 1)
    return None


class DynamoPlanner(PlannerGate):
    """Dynamo 1.6.1's planner: its default `throughput` target, or the SLA `load` loop."""

    switch_mode: SwitchMode = "restart"

    def __init__(
        self,
        *,
        mode: DynamoMode = "throughput",
        context_length: int = LLAMA3_70B.context_length,
        interval: float = INTERVAL,
        ttft_sla: float = 0.5,
        itl_sla: float = 0.05,
        down_sensitivity: float = 0.8,
        min_nodes: int = 1,
        chunk_tokens: int = CHUNK_TOKENS,
    ) -> None:
        super().__init__()
        if mode not in ("throughput", "load"):
            raise ValueError(f"unknown mode {mode!r} (throughput or load)")
        if ttft_sla <= 0 or itl_sla <= 0 or not 0 < down_sensitivity <= 1 or min_nodes < 1:
            raise ValueError("need SLAs > 0, 0 < down_sensitivity <= 1 and min_nodes >= 1")
        if context_length < 1 or interval <= 0:
            raise ValueError("need context_length >= 1 and interval > 0")
        self.mode: DynamoMode = mode
        self.name = "dynamo" if mode == "throughput" else "dynamo-load"
        self.context_length = context_length
        self.interval = float(interval)
        self.ttft_sla, self.itl_sla, self.down_sensitivity = ttft_sla, itl_sla, down_sensitivity
        self.min_nodes = min_nodes
        self.chunk_tokens = chunk_tokens

    def signals(self, s: SliceStats, split: Split) -> tuple[int, int]:
        """The `throughput` target's ±1 per phase (prefill, decode) from the busiest engines."""
        queued = s.max_queued_prefill_tokens / self.context_length
        kv = s.max_decode_kv_demand
        return (
            self._direction(queued >= PREFILL_UP, queued, PREFILL_DOWN, PREFILL_UP, split.prefill),
            self._direction(kv > DECODE_UP, kv, DECODE_DOWN, DECODE_UP, split.decode),
        )

    def _direction(self, up: bool, value: float, down: float, up_at: float, ready: int) -> int:
        """+1 when the phase's threshold says grow, -1 when it says shrink and the consolidation
        guard lets it, else 0."""
        if up:
            return 1
        return -1 if value < down and may_shrink(value, ready, up_at, self.min_nodes) else 0

    def estimates(self, s: SliceStats, model: IterationModel) -> tuple[float, float]:
        """(estimated TTFT, estimated ITL) in seconds for the slice's mean engine (`load`)."""
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
        if self.mode == "throughput":
            return self._propose(split, rebalance(split, *self.signals(s, split), self.min_nodes))
        ttft, itl = self.estimates(s, model)
        k = self.down_sensitivity
        p_up, p_down = ttft > self.ttft_sla, ttft < self.ttft_sla * k
        d_up, d_down = itl > self.itl_sla, itl < self.itl_sla * k
        target = pressure_step(split, p_up, d_up, p_down, d_down, self.min_nodes)
        return self._propose(split, target)

    def one_prefill(self, s: SliceStats, model: IterationModel) -> float:
        """Predicted prefill seconds of the slice's mean request alone (chunked); a slice
        without arrivals falls back to its mean prompt, uncached."""
        mean = MeanRequest.of(s)
        if mean is None:
            return prefill_seconds(model, max(s.mean_input_tokens, 1.0), 0.0, self.chunk_tokens)
        return prefill_seconds(model, mean.uncached, mean.cached, self.chunk_tokens)
