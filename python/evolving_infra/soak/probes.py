"""What a soak run measures from outside the processes: resident memory and the router's
overhead histogram.

- Memory is each process's resident set (`VmRSS` in `/proc/PID/status`), sampled through the
  run; a restarted process is a new series under the same name.
- The router's overhead (arrival → requests leave for the engines,
  `evolving_router_overhead_seconds`) is a Prometheus histogram inside the router. A restart
  starts it from zero, so the soak scrapes it before each restart and at the end and adds the
  bucket counts; the P99 is read from the merged buckets the way Prometheus'
  `histogram_quantile` does (linear within the bucket that holds it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

OVERHEAD = "evolving_router_overhead_seconds"


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a live process, None when it is gone (Linux `/proc`)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # reported in kB
    return None


@dataclass(slots=True)
class MemorySeries:
    """RSS samples of one process (one PID) as (seconds into the run, bytes)."""

    name: str
    pid: int
    samples: list[tuple[float, int]] = field(default_factory=list)

    def add(self, t: float) -> None:
        rss = rss_bytes(self.pid)
        if rss is not None:
            self.samples.append((t, rss))

    def summary(self, warm_after: float) -> dict[str, object]:
        """First, after-warm-up, last and peak RSS in MiB; growth from warm-up to the end."""
        if not self.samples:
            return {"name": self.name, "pid": self.pid, "samples": 0}
        first, last = self.samples[0][1], self.samples[-1][1]
        warm = next((b for t, b in self.samples if t >= warm_after), last)
        mib = 2.0**20
        return {
            "name": self.name,
            "pid": self.pid,
            "samples": len(self.samples),
            "start_mib": round(first / mib, 1),
            "warm_mib": round(warm / mib, 1),
            "end_mib": round(last / mib, 1),
            "peak_mib": round(max(b for _, b in self.samples) / mib, 1),
            "growth_after_warmup_pct": round(100.0 * (last - warm) / warm, 1) if warm else None,
        }


Buckets = dict[float, float]  # upper bound -> cumulative count (Prometheus `le` buckets)


def histogram_buckets(metrics_text: str, name: str = OVERHEAD) -> Buckets:
    """The cumulative bucket counts of histogram `name` in a Prometheus text page."""
    out: Buckets = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != name:
            continue
        for s in family.samples:
            if s.name == f"{name}_bucket":
                out[float(s.labels["le"])] = float(s.value)
    return out


def merge(parts: Iterable[Mapping[float, float]]) -> Buckets:
    """Bucket-wise sum of histograms with the same bounds (one per router lifetime)."""
    total: Buckets = {}
    for part in parts:
        for le, count in part.items():
            total[le] = total.get(le, 0.0) + count
    return total


def quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """Prometheus' `histogram_quantile(q, ...)`: None without observations; the largest finite
    bound when the quantile falls in the +Inf bucket."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower
