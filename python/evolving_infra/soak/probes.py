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
import os
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


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a live process has used, None when it is gone (`/proc/PID/stat`;
    on a shared machine, what each part of the cluster costs, unlike wall-clock figures)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the command name, which is in parentheses and may hold spaces.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


@dataclass(slots=True)
class MemorySeries:
    """RSS samples of one process (one PID) as (seconds into the run, bytes), and its CPU
    time at the last sample."""

    name: str
    pid: int
    samples: list[tuple[float, int]] = field(default_factory=list)
    cpu_s: float | None = None

    def add(self, t: float) -> None:
        rss = rss_bytes(self.pid)
        if rss is not None:
            self.samples.append((t, rss))
            cpu = cpu_seconds(self.pid)
            if cpu is not None:
                self.cpu_s = cpu

    def summary(self, warm_after: float) -> dict[str, object]:
        """First, after-warm-up, last and peak RSS in MiB, and the growth from warm-up to the end.

        Warm-up is `warm_after` seconds of this series' own life (a process restarted late in
        the run warms up from its start, not from the run's): the first sample that old is the
        warm figure. A series that ended before has no warm figure and no growth (None), rather
        than a growth measured from its start."""
        if not self.samples:
            return {"name": self.name, "pid": self.pid, "samples": 0}
        t0, first = self.samples[0]
        last = self.samples[-1][1]
        warm_at, warm = next(
            ((t, b) for t, b in self.samples if t >= t0 + warm_after), (None, None)
        )
        mib = 2.0**20
        growth = None if warm is None else last - warm
        return {
            "name": self.name,
            "pid": self.pid,
            "samples": len(self.samples),
            "start_mib": round(first / mib, 1),
            "warm_at_s": None if warm_at is None else round(warm_at, 1),
            "warm_mib": None if warm is None else round(warm / mib, 1),
            "end_mib": round(last / mib, 1),
            "peak_mib": round(max(b for _, b in self.samples) / mib, 1),
            "cpu_s": None if self.cpu_s is None else round(self.cpu_s, 1),
            "growth_after_warmup_mib": None if growth is None else round(growth / mib, 1),
            "growth_after_warmup_pct": (
                None if growth is None or not warm else round(100.0 * growth / warm, 1)
            ),
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
    bound when the quantile falls in the +Inf bucket (then `above_top` is True: the figure is
    only a lower bound)."""
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


def above_top(buckets: Mapping[float, float], q: float) -> bool:
    """Whether the q-quantile falls beyond the largest finite bucket bound (in +Inf), where
    `quantile` can only give that bound."""
    finite = [le for le in buckets if not math.isinf(le)]
    total = max(buckets.values(), default=0.0)
    if not finite or total <= 0:
        return False
    return buckets[max(finite)] < q * total
