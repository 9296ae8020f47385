"""What a run measured: throughput, latencies, KV reuse against the ideal, switches, timelines.

Definitions:
- throughput: output tokens produced in [0, end] (a request's first token when its KV reaches
  the decode node, the rest as decode spans end) over `end`; requests/s: completed over `end`;
- e2e latency: response time - ready time; TTFT: first token - ready time; inter-token latency
  per request: (response - first token) / (output tokens - 1), averaged over requests with two
  tokens or more;
- h*: the requests whose prefill completed, on one infinite cache shared by all nodes:
  `workloads.stats`'s definition (a request hits its leading blocks that appeared in an earlier
  prompt). With chain hashes a block's hash fixes its prefix, so a request's misses are exactly
  its blocks never seen before and h* = 1 - distinct blocks / prompt blocks, whatever the
  order: once every request ran it equals `trace_stats(trace).ideal_hit_rate`;
- KV hit rate h: prompt blocks served from cache (the node's L1, its L2, other nodes' L1/L2 for
  policies with a shared pool) over prompt blocks, counting only blocks h* counts (a request's
  cached prefix capped at its ideal hits). Decode nodes also cache responses, which the next
  prompt reads but h* never counts (prompt blocks only); `hit_rate_all` counts them too. For
  reasoning-heavy workloads (putnam) responses are most of the next prompt, so the two differ
  a lot there. In blocks, as h* is: a partial last page is never cached by either;
- lost KV reuse: 1 - h/h* (in [0, 1]);
- conservation: issued = completed + rejected + unfinished; a request is rejected (answered at
  once, no tokens) when its prompt and output cannot fit one node's KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from evolving_infra.nodemodel.request import SimRequest
from evolving_infra.sim.planning import SwitchLog
from evolving_infra.workloads.stats import IdealCache


@dataclass(slots=True)
class Point:
    """One timeline point: the minute ending at `t`."""

    t: float
    prefill: int
    decode: int
    down: int  # nodes draining or down for a switch
    tokens_per_s: float
    hit_rate: float | None  # over prefills completed in the minute
    completed: int


@dataclass(slots=True)
class Recorder:
    """Collects a run's figures as the cluster reports events."""

    block_size: int
    issued: int = 0
    completed: int = 0
    rejected: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    prompt_blocks: int = 0
    cached_blocks: int = 0  # capped at each request's ideal hits (what h* could count)
    cached_all: int = 0  # every cached block, responses included
    prefills: int = 0
    ideal: IdealCache = field(default_factory=IdealCache)
    timeline: list[Point] = field(default_factory=list)
    done_ids: set[int] = field(default_factory=set)
    # the current minute
    _tokens: int = 0
    _prompt: int = 0
    _cached: int = 0
    _completed: int = 0

    def prefilled(self, req: SimRequest) -> None:
        n = len(req.hashes)
        c = min(req.cached_blocks, n)
        ideal = self.ideal.add(req.hashes)
        self.prefills += 1
        self.prompt_blocks += n
        self.cached_all += c
        # Both are prefixes of the prompt: the cached blocks an ideal prompt cache also had.
        c = min(c, ideal)
        self.cached_blocks += c
        self._prompt += n
        self._cached += c

    def produced(self, n: int) -> None:
        self.tokens += n
        self._tokens += n

    def done(self, req: SimRequest, rejected: bool = False) -> None:
        if req.id in self.done_ids:
            raise AssertionError(f"{req} completed twice")
        self.done_ids.add(req.id)
        if rejected:
            self.rejected += 1
            return
        self.completed += 1
        self._completed += 1
        self.e2e.append(req.done - req.issued)
        self.ttft.append(req.first_token - req.issued)
        if req.output_tokens >= 2:
            self.itl.append((req.done - req.first_token) / (req.output_tokens - 1))

    def point(self, t: float, span: float, prefill: int, decode: int, down: int) -> None:
        hit = self._cached / self._prompt if self._prompt else None
        self.timeline.append(
            Point(t, prefill, decode, down, self._tokens / span, hit, self._completed)
        )
        self._tokens = self._prompt = self._cached = self._completed = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def ideal_hit_rate(self) -> float:
        i = self.ideal
        return i.hits / i.blocks if i.blocks else 0.0

    def summary(self, end: float, switches: list[SwitchLog]) -> dict[str, Any]:
        """The per-policy figures of `compare`'s JSON (times in seconds)."""
        h, hs = self.hit_rate, self.ideal_hit_rate
        ttft = np.array(self.ttft) if self.ttft else None

        def pct(q: float) -> float | None:
            return float(np.percentile(ttft, q)) if ttft is not None else None

        drain = sum((s.drained if s.drained >= 0 else end) - s.requested for s in switches)
        down = sum(((s.up if s.up >= 0 else end) - s.drained) for s in switches if s.drained >= 0)
        return {
            "throughput_tokens_per_s": self.tokens / end if end > 0 else 0.0,
            "requests_per_s": self.completed / end if end > 0 else 0.0,
            "mean_e2e_s": _mean(self.e2e),
            "p50_ttft_s": pct(50),
            "p95_ttft_s": pct(95),
            "p99_ttft_s": pct(99),
            "mean_ttft_s": _mean(self.ttft),
            "mean_itl_s": _mean(self.itl),
            "hit_rate": h,
            "hit_rate_all": self.cached_all / self.prompt_blocks if self.prompt_blocks else 0.0,
            "ideal_hit_rate": hs,
            "lost_kv_reuse": 1.0 - h / hs if hs > 0 else None,
            "switches": len(switches),
            "switch_drain_s": drain,
            "switch_down_s": down,
            "output_tokens": self.tokens,
            "prefills": self.prefills,
            "issued": self.issued,
            "completed": self.completed,
            "rejected": self.rejected,
            "unfinished": self.issued - self.completed - self.rejected,
            "duration_s": end,
        }


def _mean(xs: list[float]) -> float | None:
    return math.fsum(xs) / len(xs) if xs else None
