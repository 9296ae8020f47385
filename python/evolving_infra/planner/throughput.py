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

- the prefill nodes keep up: u = X·S / x < 1, with S = 1/μ_P a node's time per request;
- the decode KV holds everyone it reserved (Little's law): X·(W + L_P + L_X + T) <= n, with
  n = y·K / R the requests the decode KV holds at once (R a request's reserved tokens, prompt
  and output, K a node's KV tokens), W its wait in a prefill queue, L_P its prefill latency,
  L_X its transfer and T its decode time; without early allocation the KV is held for the
  decode alone: X·(L_X + T) <= n;
- the decode batch that X makes, B = X·T / y (T = output x step(B) / tokens per step, a fixed
  point), stays within `max_batch`.

The wait W (`_queue_wait`) is that of a closed network's queue, not an open one's. Behind the
router's decode-KV gate (`router.admission`, the simulator's `PolicySpec.admission`) a request
reserves its decode KV before it is sent to a prefill node, and one that finds no room waits at
the router holding nothing: the prefill queues hold at most the n requests the decode KV
admitted, so the wait cannot grow without bound as u nears 1, as an open M/G/1 queue's does.
And the router sends each request to the prefill node that answers it first, so the x nodes
work as one queue of x servers, not x queues a request is dealt into at random. W is the mean
value analysis's (Schweitzer's approximation) of a queue of service S/x and x servers'
latency (Seidmann's), among n customers:

    W = (S/x)·u·((c² - 1)/2 + (n - 1)/n) / (1 - u·(n - 1)/n)

with c² the squared coefficient of variation of the slice's prefill times
(`SliceDemand.service_scv`: an agent's cold first prompt or a long fresh one holds up the
turns behind it). For large n it is Pollaczek-Khinchine's M/G/1 wait of that one queue. The
planner priced the wait as one node's open M/G/1 queue at the mean load until 2026-12-08: x
times as long, and without bound near u = 1. On Mooncake's long fresh prompts at 300 agents on
the paper's deployment, whose static splits serve in proportion to their prefill nodes (one
decode node keeps up: 8P1D 1.12x 7P2D), it priced 8P1D level with 7P2D, its one decode node's
KV full of requests waiting for a prefill, and the planner reached 8P1D half an hour late
(0.95x the best static split); the Little's-law count of requests holding decode KV it implied
(80-160 on the H100s' Claude Code at 150 agents) was three to five times the simulator's
(docs/scenarios.md, issue 25, 2026-12-08).

Little's law counts the decode KV's tokens, not its requests: a request holds its R_i reserved
tokens for its own time, so the tokens held are X·E[R_i·hold_i], more than X·E[R]·E[hold] where
the larger requests hold longer. The wait and the decode are about the same for every request
(a queue served in turn, a batch decoding together); its own prefill and transfer grow with
its prompt. So the hold counts them weighted by the tokens each request reserves, over the
slice's sampled arrivals (`SliceDemand.kv_prefill_s`): Σ R_i·(L_P,i + L_X,i) / Σ R_i. On
Mooncake's fresh prompts (mean 13k tokens, the token-weighted mean 34k) at 120 agents on the
H100s, 7P2D's two decode nodes held 48 requests at a time with requests waiting for room, where
the mean request counted 60: priced by it, 7P2D came out 4-6% above 6P3D and the planner moved
there (0.963x the best static split, 6P3D, on seed 11); counted by the tokens, level
(docs/scenarios.md, issue 25, 2026-12-08).

It is monotone in X (a larger X waits longer, decodes in larger, slower batches), so bisection
finds it; the old Θ is its limit with no holding and no queue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from evolving_infra.planner.common import MeanRequest, prefill_seconds
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.ttft import DEFAULT_POOL_BANDWIDTH

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
    # The requests' own prefill and transfer seconds, each weighted by the tokens it reserves:
    # the part of the decode KV's hold that grows with the request (module docstring); None:
    # the mean request's, `prefill_s + transfer_s`.
    kv_prefill_s: float | None = None

    @classmethod
    def of(
        cls,
        model: IterationModel,
        m: MeanRequest,
        chunk_tokens: int,
        *,
        early: bool,
        scv: float = 0.0,
        arrivals: Sequence[tuple[int, int]] = (),
    ) -> SliceDemand:
        """What a slice's mean request `m` asks of a split, with its prefill times' spread `scv`
        (the queue wait's) and its sampled `arrivals` ((uncached, cached) each: their own
        prefill and transfer weighted by the tokens each reserves, `kv_prefill_s`); μ_P is 0,
        the candidate's to set."""
        d = model.deployment
        kv_prefill = None
        if arrivals:
            reserved = [u + c + m.output for u, c in arrivals]
            own = [
                prefill_seconds(model, u, c, chunk_tokens) + transfer_seconds(model, u + c)
                for u, c in arrivals
            ]
            kv_prefill = sum(r * t for r, t in zip(reserved, own, strict=True)) / sum(reserved)
        return cls(
            mean=m,
            mu_p=0.0,
            prefill_s=prefill_seconds(model, m.uncached, m.cached, chunk_tokens),
            transfer_s=transfer_seconds(model, m.uncached + m.cached),
            early=early,
            tokens_per_step=d.mtp_accepted if d is not None else 1.0,
            service_scv=scv,
            kv_prefill_s=kv_prefill,
        )


def transfer_seconds(model: IterationModel, tokens: float) -> float:
    """Seconds a prompt's KV of `tokens` takes to move to its decode node (0 without a
    deployment to size it)."""
    d = model.deployment
    if d is None:
        return 0.0
    return tokens * d.kv_bytes_per_token / (DEFAULT_POOL_BANDWIDTH * d.tp)


def _queue_wait(d: SliceDemand, rho: float, x: int = 1, held: float = math.inf) -> float:
    """The mean wait in the prefill queue of `x` nodes at utilization `rho` (< 1) among `held`
    requests (those the decode KV holds; inf: an open queue), module docstring."""
    f = 1.0 if math.isinf(held) else max(held - 1.0, 0.0) / max(held, 1.0)
    wait = rho * ((d.service_scv - 1.0) / 2.0 + f) / (1.0 - rho * f) / (x * d.mu_p)
    return max(wait, 0.0)


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
    held = y * kv_tokens / (d.mean.uncached + d.mean.cached + d.mean.output)
    if not d.early:
        return rate * (d.transfer_s + decode_s) <= held
    own = d.prefill_s + d.transfer_s if d.kv_prefill_s is None else d.kv_prefill_s
    return rate * (_queue_wait(d, rho, x, held) + own + decode_s) <= held


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
    keep up.

    The wait here is still one node's open queue (the capacity's became the nodes' one closed
    queue on 2026-12-08): it prices the answers of slices far below capacity (rule 3's
    `headroom`), and that change was screened for the capacity alone. NOTE: one model of the
    wait for both is the cleaner form; it needs its own screen on the grids' idle cells."""
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
