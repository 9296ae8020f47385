"""A split's throughput with decode KV held through the prefill queue (the evolving planner's Θ).

`min(x·μ_P, y·μ_D)` treats the two phases as independent servers. Under SGLang's default early
decode allocation they are not: a decode node reserves a request's prompt and output at
dispatch, and holds that KV while the request waits in a prefill queue, is prefilled and moves
over, before it decodes a token. The busier the prefill nodes, the longer the wait, and the
fewer of the decode nodes' resident requests are decoding. Both failure directions came out of
the held-out grid (docs/scenarios.md, "held-out grid"): on Mooncake's long fresh prompts the
planner gave eight nodes to prefill, whose one decode node then spent most of its KV on requests
waiting for a prefill (a batch of 11 in 26 resident); on Claude Code at 150 agents it gave too
few to prefill, whose queues held the decode KV the planner counted as free.

`split_rate` is the largest arrival rate X (requests/s) the split (x prefill, y decode nodes)
sustains, found by bisection, such that

- the prefill nodes keep up: u = X / (x·μ_P) < 1, and a request waits
  W = (1 + c²)·S·u / (2(1 - u)) in a prefill queue (M/G/1's mean wait by Pollaczek-Khinchine,
  with the node's time per request S = 1/μ_P and c² the squared coefficient of variation of
  the slice's prefill times, `SliceDemand.service_scv`: an agent's cold first prompt or a long
  fresh one holds up the turns behind it; the router spreads requests over the x nodes, so this
  is the wait of one node at the mean load);
- the decode KV holds everyone it reserved (Little's law): X·R·(W + L_P + L_X + T) <= y·K, with
  R the request's reserved tokens (prompt and output), L_P its prefill latency, L_X its
  transfer, T its decode time and K a node's KV tokens; without early allocation the KV is held
  for the decode alone (L_X + T);
- the decode batch that X makes, B = X·T / y (T = output x step(B) / tokens per step, a fixed
  point), stays within `max_batch`.

It is monotone in X (a larger X waits longer, decodes in larger, slower batches), so bisection
finds it; the old Θ is its limit with no holding and no queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from evolving_infra.planner.common import MeanRequest
from evolving_infra.timing.model import IterationModel

_BISECTIONS = 24
_FIXED_POINT = 4


@dataclass(frozen=True, slots=True)
class SliceDemand:
    """What one slice's mean request asks of the cluster, as the planner prices it."""

    mean: MeanRequest
    mu_p: float  # requests/s one prefill node serves of the slice's requests
    prefill_s: float  # the mean request's own prefill latency
    transfer_s: float  # its KV's move to the decode node
    early: bool  # decode KV reserved at dispatch (held through the prefill queue)
    tokens_per_step: float = 1.0  # tokens a request gains per decode iteration (MTP)
    # The squared coefficient of variation of the requests' prefill times (0: all alike), for
    # the queue wait (Pollaczek-Khinchine: M/D/1's wait times 1 + scv, `_queue_wait`).
    service_scv: float = 0.0


def _queue_wait(d: SliceDemand, rho: float) -> float:
    """The mean wait in a prefill queue at utilization `rho` (< 1): M/G/1 by
    Pollaczek-Khinchine, M/D/1's S·u / (2(1 - u)) times 1 + the prefill times' squared
    coefficient of variation."""
    return (1.0 + d.service_scv) * rho / (2.0 * (1.0 - rho)) / d.mu_p


def _decode_time(
    model: IterationModel, d: SliceDemand, rate: float, y: int, max_batch: int
) -> tuple[float, float]:
    """(decode seconds per request, decode batch per node) at `rate` requests/s over `y` nodes."""
    m = d.mean
    batch = 1.0
    seconds = 0.0
    for _ in range(_FIXED_POINT):
        b = max(min(round(batch), max_batch), 1)
        step = model.predict_decode(b, round(b * m.context))
        seconds = m.output * step / d.tokens_per_step
        batch = max(rate * seconds / y, 1.0)
    return seconds, batch


def _feasible(
    model: IterationModel,
    d: SliceDemand,
    rate: float,
    x: int,
    y: int,
    kv_tokens: int,
    max_batch: int,
) -> bool:
    rho = rate / (x * d.mu_p)
    if rho >= 1.0:
        return False
    decode_s, batch = _decode_time(model, d, rate, y, max_batch)
    if batch > max_batch:
        return False
    hold = d.transfer_s + decode_s
    if d.early:
        hold += d.prefill_s + _queue_wait(d, rho)
    reserve = d.mean.uncached + d.mean.cached + d.mean.output
    return rate * reserve * hold <= y * kv_tokens


def split_rate(
    model: IterationModel, d: SliceDemand, x: int, y: int, kv_tokens: int, max_batch: int
) -> float:
    """Requests/s the split of `x` prefill and `y` decode nodes sustains (module docstring)."""
    if x < 1 or y < 1 or d.mu_p <= 0:
        return 0.0
    lo, hi = 0.0, x * d.mu_p
    if not _feasible(model, d, hi * 1e-6, x, y, kv_tokens, max_batch):
        return hi * 1e-6  # not even a trickle fits: the smallest rate, not zero
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        if _feasible(model, d, mid, x, y, kv_tokens, max_batch):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True, slots=True)
class Answer:
    """The mean request's time in a split, in its parts: the wait in a prefill queue, its
    prefill and transfer, its decode."""

    wait_s: float
    prefill_s: float
    decode_s: float

    def total(self) -> float:
        return self.wait_s + self.prefill_s + self.decode_s


def answer(
    model: IterationModel, d: SliceDemand, rate: float, x: int, y: int, max_batch: int
) -> Answer | None:
    """The mean request's time in the split at `rate` requests/s (`Answer`): its wait in a
    prefill queue (`_queue_wait`: an agent's cold first prompt takes ten times a warm turn's
    prefill and the turns behind it wait for it), its prefill, its
    transfer and its decode at the batch the rate makes; None where the prefill nodes do not
    keep up."""
    rho = rate / (x * d.mu_p)
    if rho >= 1.0:
        return None
    wait = _queue_wait(d, rho)
    decode = _decode_time(model, d, rate, y, max_batch)[0]
    return Answer(wait, d.prefill_s + d.transfer_s, decode)


@dataclass(frozen=True, slots=True)
class Loop:
    """A closed loop of agents as one slice showed it: how many, how long each thinks between
    an answer and its next request, and how much longer than the model's the observed answers
    took (the model's error, taken to be the same factor at every split: it is the model's
    shape, not its scale, that picks the split; calibrating the queue wait and the decode
    apart, from the observed TTFT, moved Claude Code to more prefill nodes at the start-up
    burst and cost 5-7% at 126 agents on the tuning grid)."""

    agents: float
    think_s: float
    scale: float = 1.0  # observed answers over the model's at the current split


def closed_loop_rate(
    model: IterationModel,
    d: SliceDemand,
    x: int,
    y: int,
    capacity: float,
    loop: Loop,
    max_batch: int,
) -> float:
    """Requests/s the agents of `loop` send to the split of `x` prefill and `y` decode nodes
    (`capacity`: its `split_rate`): the rate X with X·(think + answer(X)) = agents (Little's
    law over the agents' cycle), at most the capacity.

    Why not the capacity alone: agents wait for their answers, so a split that would serve
    more than they ask serves what they ask, and a faster answer brings them back only by as
    much as the answer is of their cycle. On Claude Code at 150 agents on the paper's
    deployment the cluster ran at a sixth of its capacity (about 40 s of tool time to 2 s of
    answer): every split from 2P7D to 7P2D served within 1% of the best, while their
    capacities differ by a third, which the planner moved on 5 to 7 times an hour.
    """
    if capacity <= 0.0 or loop.agents <= 0.0:
        return capacity

    def cycle(rate: float) -> float:
        a = answer(model, d, rate, x, y, max_batch)
        return math.inf if a is None else loop.think_s + loop.scale * a.total()

    if capacity * cycle(capacity) <= loop.agents:
        return capacity  # they would ask for more than it serves: it serves its capacity
    lo, hi = 0.0, capacity
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        if mid * cycle(mid) <= loop.agents:
            lo = mid
        else:
            hi = mid
    return lo
