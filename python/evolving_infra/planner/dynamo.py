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
5 s, per engine (`core/load_scaling.py:459-554` prefill, `:556-634` decode; TTFT 500 ms, ITL
50 ms, `load_scaling_down_sensitivity` 0.8, `config/defaults.py:73-74, 101`):
- estimated TTFT of a prefill engine = its queue drain (queued and running work, not the
  bootstrap queue's) + the predicted chunked prefill of the next request, the slice's mean one
  (`perf_model/ais_adapter.py:632-669`: queued tokens + `avg_isl`, KV hits discounted);
- estimated ITL of a decode engine = `predict_decode` at its scheduled + queued requests and KV
  tokens plus one next request of the mean decoding context (`ais_adapter.py:671-716`,
  `include_queued_decode=True`; `avg_decode_length` is the mean KV per decoding request,
  `:343-354`). "Queued" is preempted decode work: a simulated decode node never preempts, so
  the term is 0 here, but it is counted (`SliceStats.min/max_decode_kv_*`);
- a phase grows only when every engine's estimate is over its SLA (`load_scaling.py:1124-1128`):
  the least loaded engine decides (`SliceStats.min_prefill_queue_s`, `min_decode_kv_*`; the
  engine with the fewest KV tokens stands for the one with the lowest ITL);
- prefill shrinks (`:486-539`) when, with N engines and `c = N/(N-1)`, the queue budget
  `(ttft_sla - t_own) x 0.8` is positive (`t_own`: the next request's prefill alone) and the
  busiest engine's queue drain x c stays below it (`SliceStats.max_prefill_queue_s`);
- decode shrinks (`:585-622`) unless the busiest engine's KV x c would not fit its cache
  (`max_decode_kv_demand x c >= 1`, a fraction of the cache) or its ITL at its requests and KV
  x c reaches `itl_sla x 0.8`; the last engine never goes (`:492, :585`; `min_endpoint` 1,
  `:1130-1136`).
Upstream's warm-up (`load_min_observations`, 5 FPM samples) and speculative decoding's accept
length (1 here) are not modelled.

The GPU budget, both modes. The simulated cluster is Dynamo's `max_gpu_budget`: every node
serves, so each decision is taken at the ceiling, where Dynamo never takes a node from a phase
whose own signal did not say shrink (`core/budget.py:481-502`): a phase grows only when the
other shrinks in the same tick, and both move together (`rebalance`). A lone scale-down would
leave Dynamo's GPU idle until a scale-up takes it; here that node keeps serving its phase,
which can only favour the baseline. As in Dynamo ("no new action until the previous
completes"), nothing is decided while a switch is in flight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from evolving_infra.planner.base import SliceStats, Split, SwitchMode
from evolving_infra.planner.common import (
    CHUNK_TOKENS,
    MeanRequest,
    PlannerGate,
    prefill_seconds,
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

    def estimates(
        self, s: SliceStats, model: IterationModel, own: float | None = None
    ) -> tuple[float, float]:
        """(estimated TTFT, estimated ITL) in seconds of the least loaded prefill and decode
        engines (`load`): a phase is short only when these are over the SLA. `own`: the next
        request's prefill alone, when the caller has it (`one_prefill`)."""
        if own is None:
            own = self.one_prefill(s, model)
        ttft = s.min_prefill_queue_s + own
        return ttft, self.itl(s, model, s.min_decode_kv_requests, s.min_decode_kv_tokens)

    def itl(self, s: SliceStats, model: IterationModel, requests: float, tokens: float) -> float:
        """Predicted ITL of a decode engine running `requests` (scheduled + queued) over
        `tokens` of KV, plus the next request at the mean decoding context (upstream's
        `add_next_request`, `perf_model/ais_adapter.py:703-705`)."""
        context = s.mean_context_tokens
        if context <= 0:
            mean = MeanRequest.of(s)
            context = mean.context if mean is not None else max(s.mean_input_tokens, 0.0)
        return model.predict_decode(math.ceil(requests) + 1, math.ceil(tokens + context))

    def load_signals(self, s: SliceStats, split: Split, model: IterationModel) -> tuple[int, int]:
        """The SLA loop's ±1 per phase (prefill, decode): +1 when every engine is over the SLA,
        -1 when the consolidation guards let one go, else 0."""
        k = self.down_sensitivity
        own = self.one_prefill(s, model)  # t_own, in the estimate and in the prefill budget
        ttft, itl = self.estimates(s, model, own)
        prefill = decode = 0
        if ttft > self.ttft_sla:
            prefill = 1
        elif split.prefill > self.min_nodes:
            c = split.prefill / (split.prefill - 1)
            budget = (self.ttft_sla - own) * k
            if budget > 0 and s.max_prefill_queue_s * c < budget:
                prefill = -1
        if itl > self.itl_sla:
            decode = 1
        elif split.decode > self.min_nodes:
            c = split.decode / (split.decode - 1)
            fits = s.max_decode_kv_demand * c < 1.0
            post = self.itl(s, model, s.max_decode_kv_requests * c, s.max_decode_kv_tokens * c)
            if fits and post < self.itl_sla * k:
                decode = -1
        return prefill, decode

    def decide(
        self, now: float, split: Split, window: Sequence[SliceStats], model: IterationModel
    ) -> Split | None:
        if self.in_flight:
            return None
        s = recent(window, now, self.interval)
        if s is None:
            return None
        if self.mode == "throughput":
            signals = self.signals(s, split)
        else:
            signals = self.load_signals(s, split, model)
        return self._propose(split, rebalance(split, *signals, self.min_nodes))

    def one_prefill(self, s: SliceStats, model: IterationModel) -> float:
        """Predicted prefill seconds of the slice's mean request alone (chunked); a slice
        without arrivals falls back to its mean prompt, uncached."""
        mean = MeanRequest.of(s)
        if mean is None:
            return prefill_seconds(model, max(s.mean_input_tokens, 1.0), 0.0, self.chunk_tokens)
        return prefill_seconds(model, mean.uncached, mean.cached, self.chunk_tokens)
