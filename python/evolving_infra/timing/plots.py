"""Predicted against measured iteration times, one panel per model (matplotlib, PNG)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI

import matplotlib.pyplot as plt

from evolving_infra.timing.evaluation import ModelReport
from evolving_infra.timing.samples import Sample


def predicted_vs_measured(
    reports: Sequence[ModelReport], test: Sequence[Sample], path: Path, title: str = ""
) -> None:
    """Log-log scatter of held-out samples, prefill and decode in two colours, y = x dashed."""
    n = len(reports)
    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 5 * rows), squeeze=False)
    measured = [s.seconds for s in test]
    lo, hi = min(measured) / 1.5, max(measured) * 1.5
    for ax, r in zip(axes.flat, reports, strict=False):
        for phase, colour in (("prefill", "tab:blue"), ("decode", "tab:orange")):
            xs = [s.seconds for s in test if s.phase == phase]
            ys = [
                max(p, lo) if math.isfinite(p) else hi
                for p, s in zip(r.predicted, test, strict=True)
                if s.phase == phase
            ]
            ax.scatter(xs, ys, s=6, alpha=0.5, color=colour, label=phase)
        ax.plot([lo, hi], [lo, hi], "k--", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        mean = r.single.mean_ape, r.batch.mean_ape
        ax.set_title(
            f"{r.name}: single {_pct(mean[0])}, batch {_pct(mean[1])} mean abs. error",
            fontsize=10,
        )
        ax.set_xlabel("measured iteration time (s)")
        ax.set_ylabel("predicted (s)")
        ax.legend(loc="upper left", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(f"Held-out iterations: {title}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"
