"""The simulator's figures and the live system's, side by side, with the bounds they must keep.

Both sides measure with one set of definitions (`sim/metrics.py`; the replay's summary follows
them: `replay/summary.py`): h and h* in trace blocks over the requests served, lost KV reuse
1 - h/h*, TTFT from the moment a request is ready (sent) to its first token. Throughput is the
one figure whose windows differ by construction: the simulator counts the output tokens produced
in [0, duration]; a replay drains what is in flight after the duration, so its tokens are placed
in time (the first at the first token, the rest evenly until the end of the stream) and only
those inside [0, duration] count.

The bounds are issue 27's: lost reuse within 0.03 (absolute) and P50 TTFT within 25% of the
simulator's. The other rows are shown for the reader, not judged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from evolving_infra.replay.summary import Outcome, Summary

LOST_REUSE_BOUND = 0.03  # |live - sim|, absolute
P50_TTFT_BOUND = 0.25  # |live - sim| / sim


@dataclass(frozen=True, slots=True)
class Side:
    """One side's figures (None: nothing was measured, e.g. no request completed)."""

    issued: int
    completed: int
    rejected: int  # answered at once as too long for the model / any engine
    hit_rate: float | None
    ideal_hit_rate: float | None
    lost_kv_reuse: float | None
    p50_ttft_s: float | None
    p95_ttft_s: float | None
    mean_e2e_s: float | None
    output_tokens_per_s: float

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def sim_side(figures: Mapping[str, Any]) -> Side:
    """The simulator's side, from one policy's figures in `sim.run.compare`'s results."""
    return Side(
        issued=int(figures["issued"]),
        completed=int(figures["completed"]),
        rejected=int(figures["rejected"]),
        hit_rate=figures["hit_rate"],
        ideal_hit_rate=figures["ideal_hit_rate"],
        lost_kv_reuse=figures["lost_kv_reuse"],
        p50_ttft_s=figures["p50_ttft_s"],
        p95_ttft_s=figures["p95_ttft_s"],
        mean_e2e_s=figures["mean_e2e_s"],
        output_tokens_per_s=float(figures["throughput_tokens_per_s"]),
    )


def tokens_in_window(outcomes: Sequence[Outcome], window: float) -> float:
    """Output tokens of the completed requests produced in [0, window] (see the docstring)."""
    total = 0.0
    for o in outcomes:
        if not o.ok or o.output_tokens < 1 or o.ttft is None or o.e2e is None:
            continue
        first, end = o.sent + o.ttft, o.sent + o.e2e
        if first <= window:
            total += 1
        rest = o.output_tokens - 1
        if rest and end > first:
            total += rest * min(max((window - first) / (end - first), 0.0), 1.0)
        elif rest and end <= window:
            total += rest
    return total


def live_side(summary: Summary, outcomes: Sequence[Outcome], rejected_reason: str) -> Side:
    """The live side: the replay's summary and outcomes; `rejected_reason` is the failure
    reason of a request refused as too long (the simulator's `rejected`)."""
    window = summary.duration_s
    return Side(
        issued=summary.issued,
        completed=summary.completed,
        rejected=summary.errors.get(rejected_reason, 0),
        hit_rate=summary.hit_rate,
        ideal_hit_rate=summary.ideal_hit_rate,
        lost_kv_reuse=summary.lost_kv_reuse,
        p50_ttft_s=summary.p50_ttft_s,
        p95_ttft_s=summary.p95_ttft_s,
        mean_e2e_s=summary.mean_e2e_s,
        output_tokens_per_s=tokens_in_window(outcomes, window) / window,
    )


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    sim: float | None
    live: float | None
    gap: float | None  # absolute for lost reuse, relative for TTFT
    bound: float
    ok: bool


def checks(sim: Side, live: Side) -> list[Check]:
    """The two judged rows: lost reuse (absolute gap) and P50 TTFT (relative gap)."""
    out = []
    s, v = sim.lost_kv_reuse, live.lost_kv_reuse
    gap = None if s is None or v is None else abs(v - s)
    out.append(
        Check(
            "lost KV reuse",
            s,
            v,
            gap,
            LOST_REUSE_BOUND,
            gap is not None and gap <= LOST_REUSE_BOUND,
        )
    )
    s, v = sim.p50_ttft_s, live.p50_ttft_s
    rel = None if s is None or v is None or s <= 0 else abs(v - s) / s
    out.append(
        Check("P50 TTFT", s, v, rel, P50_TTFT_BOUND, rel is not None and rel <= P50_TTFT_BOUND)
    )
    return out


def report(sim: Side, live: Side, setting: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON report: the setting, both sides, the judged checks and the verdict."""
    judged = checks(sim, live)
    return {
        "setting": dict(setting),
        "sim": sim.to_dict(),
        "live": live.to_dict(),
        "checks": [
            {
                "name": c.name,
                "sim": c.sim,
                "live": c.live,
                "gap": c.gap,
                "bound": c.bound,
                "ok": c.ok,
            }
            for c in judged
        ],
        "ok": all(c.ok for c in judged),
    }


def _fmt(x: object, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        return f"{x:.3f}{unit}" if unit else f"{x:.3f}"
    return str(x)


ROWS = (
    ("issued", "issued", ""),
    ("completed", "completed", ""),
    ("rejected (too long)", "rejected", ""),
    ("h", "hit_rate", ""),
    ("h*", "ideal_hit_rate", ""),
    ("lost KV reuse (1 - h/h*)", "lost_kv_reuse", ""),
    ("P50 TTFT", "p50_ttft_s", " s"),
    ("P95 TTFT", "p95_ttft_s", " s"),
    ("mean E2E", "mean_e2e_s", " s"),
    ("output tok/s in [0, duration]", "output_tokens_per_s", ""),
)


def render(rep: Mapping[str, Any], console: Console) -> None:
    table = Table(title="parity: the simulator and the live system on one workload")
    for col in ("figure", "sim", "live"):
        table.add_column(col, justify="left" if col == "figure" else "right")
    for label, key, unit in ROWS:
        table.add_row(label, _fmt(rep["sim"][key], unit), _fmt(rep["live"][key], unit))
    console.print(table)
    for c in rep["checks"]:
        gap = "-" if c["gap"] is None else f"{c['gap']:.3f}"
        bound = f"{c['bound']:.0%}" if c["name"] == "P50 TTFT" else f"{c['bound']:.2f}"
        word = "within" if c["ok"] else "OUTSIDE"
        console.print(
            f"{c['name']}: gap {gap} {word} the bound {bound}", style="green" if c["ok"] else "red"
        )
