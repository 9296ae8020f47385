"""The soak report: the replay's summary, the faults, router overhead and memory per process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from evolving_infra.replay.summary import Summary


@dataclass(slots=True)
class SoakReport:
    summary: Summary
    faults: list[dict[str, Any]] = field(default_factory=list)
    overhead_p50_s: float | None = None
    overhead_p99_s: float | None = None
    overhead_count: int = 0  # requests the router measured, over all its lifetimes
    # The quantile fell in the histogram's +Inf bucket: the figure is its top bound, a floor.
    overhead_p50_above_top: bool = False
    overhead_p99_above_top: bool = False
    memory: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Something completed and nothing was lost (a failure with an error is not a loss)."""
        return self.summary.completed > 0 and self.summary.lost == 0

    def to_dict(self) -> dict[str, Any]:
        s = self.summary
        return {
            "ok": self.ok,
            "completed": s.completed,
            "failed": s.failed,
            "shed_early": s.shed,
            "rejected": s.rejected,
            "unreachable": s.unreachable,
            "failed_late": s.failed_late,
            "lost": s.lost,
            "issued": s.issued,
            "unissued": s.unissued,
            "errors": s.errors,
            "requests_per_s": s.requests_per_s,
            "output_tokens_per_s": s.output_tokens_per_s,
            "hit_rate": s.hit_rate,
            "ideal_hit_rate": s.ideal_hit_rate,
            "p99_ttft_s": s.p99_ttft_s,
            "router_overhead_p50_s": self.overhead_p50_s,
            "router_overhead_p99_s": self.overhead_p99_s,
            "router_overhead_count": self.overhead_count,
            "router_overhead_p50_above_top_bucket": self.overhead_p50_above_top,
            "router_overhead_p99_above_top_bucket": self.overhead_p99_above_top,
            "faults": self.faults,
            "memory": self.memory,
            "replay": s.to_dict(),
        }


def _ms(x: float | None, above_top: bool = False) -> str:
    """Milliseconds; `>=` when the quantile lies beyond the histogram's top bound."""
    return "-" if x is None else f"{'>= ' if above_top else ''}{1e3 * x:.1f} ms"


def _share(n: int, of: int) -> str:
    return f"{n} ({100 * n / of:.1f}%)" if of else str(n)


def _mib(x: object) -> str:
    return "-" if x is None else str(x)


def _growth(m: dict[str, Any]) -> str:
    """`+12.3 MiB (+4.5%) since 150 s`, or `-` for a process that did not outlive warm-up."""
    mib, pct = m.get("growth_after_warmup_mib"), m.get("growth_after_warmup_pct")
    if mib is None:
        return "-"
    share = "" if pct is None else f" ({pct:+.1f}%)"
    return f"{mib:+.1f} MiB{share} since {m.get('warm_at_s')} s"


def render(report: SoakReport, console: Console) -> None:
    s = report.summary
    head = Table(title="soak: requests")
    heads = ("completed", "shed early (429)", "rejected (4xx)", "unreachable", "failed late",
             "lost", "unissued", "req/s")  # fmt: skip
    for col in (*heads, "overhead P50", "P99"):
        head.add_column(col, justify="right")
    head.add_row(
        str(s.completed),
        _share(s.shed, s.issued),
        _share(s.rejected, s.issued),
        _share(s.unreachable, s.issued),
        _share(s.failed_late, s.issued),
        str(s.lost),
        str(s.unissued),
        f"{s.requests_per_s:.2f}",
        _ms(report.overhead_p50_s, report.overhead_p50_above_top),
        _ms(report.overhead_p99_s, report.overhead_p99_above_top),
    )
    console.print(head)
    if s.errors:
        console.print("errors: " + ", ".join(f"{k} x{v}" for k, v in s.errors.items()))
    for f in report.faults:
        console.print("fault: " + ", ".join(f"{k}={v}" for k, v in f.items()))
    mem = Table(title="soak: resident memory (MiB) and CPU time per process")
    cols = ("process", "start", "warm", "end", "peak", "growth after warm-up", "CPU s")
    for i, col in enumerate(cols):
        mem.add_column(col, justify="left" if i == 0 else "right")
    for m in report.memory:
        mem.add_row(
            str(m["name"]),
            *(_mib(m.get(k)) for k in ("start_mib", "warm_mib", "end_mib", "peak_mib")),
            _growth(m),
            _mib(m.get("cpu_s")),
        )
    console.print(mem)
    verdict = "OK: nothing lost" if report.ok else "FAILED: requests lost or none completed"
    console.print(verdict, style="green" if report.ok else "red")
