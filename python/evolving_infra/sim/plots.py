"""Per-minute timelines of a comparison (matplotlib, PNG): throughput, hit rate, split, and
what a pricing planner saw at each decision."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI

import matplotlib.pyplot as plt
import numpy as np


def timelines(results: dict[str, Any], out: Path) -> list[Path]:
    """Writes `timeline_throughput.png`, `timeline_hit_rate.png` and `timeline_split.png`
    (prefill nodes over time) into `out`, and `decisions_POLICY.png` for each policy with a
    `decision_log` (`decisions`); returns their paths."""
    policies: dict[str, Any] = results["policies"]
    panels = (
        ("throughput", "output tokens/s", "tokens_per_s"),
        ("hit_rate", "KV hit rate (per minute)", "hit_rate"),
        ("split", "prefill nodes (down: dotted)", "prefill"),
    )
    paths: list[Path] = []
    for name, ylabel, key in panels:
        fig, ax = plt.subplots(figsize=(8, 4))
        for label, fig_data in policies.items():
            points = fig_data.get("timeline", [])
            xs = [p["t"] / 60 for p in points if p[key] is not None]
            ys = [p[key] for p in points if p[key] is not None]
            (line,) = ax.plot(
                xs, ys, label=label, drawstyle="steps-post" if name == "split" else "default"
            )
            if name == "split":
                down = [p["down"] for p in points]
                ax.plot([p["t"] / 60 for p in points], down, ":", color=line.get_color())
        ax.set_xlabel("simulated minutes")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if policies:
            ax.legend(fontsize="small")
        fig.tight_layout()
        path = out / f"timeline_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    for label, fig_data in policies.items():
        if fig_data.get("decision_log"):
            paths.append(decisions(label, fig_data["decision_log"], out))
    return paths


def decisions(label: str, log: list[dict[str, Any]], out: Path) -> Path:
    """`decisions_LABEL.png`: at each decision, every candidate's mean Θ relative to that
    decision's best (a column per decision, a row per split), the split held (line) and the
    moves asked for (markers). Where the planner went wrong, this shows whether it priced the
    better split lower or priced it higher and waited on the test."""
    splits = list(log[0]["theta"])  # 1P..D first; every record lists the same candidates
    times = [d["t"] / 60 for d in log]
    grid = np.full((len(splits), len(log)), np.nan)
    for j, d in enumerate(log):
        top = max(d["theta"].values())
        if top > 0:
            grid[:, j] = [d["theta"][s] / top for s in splits]
    row = {s: i for i, s in enumerate(splits)}
    fig, ax = plt.subplots(figsize=(9, 4))
    half = (times[1] - times[0]) / 2 if len(times) > 1 else 0.5
    image = ax.imshow(
        grid,
        aspect="auto",
        origin="lower",
        cmap="viridis",
        vmin=0.8,
        vmax=1.0,
        extent=(times[0] - half, times[-1] + half, -0.5, len(splits) - 0.5),
    )
    ax.step(times, [row[d["split"]] for d in log], where="post", color="white", label="held")
    asked = [(t, row[d["asked"]]) for t, d in zip(times, log, strict=True) if d["asked"]]
    if asked:
        ax.plot(*zip(*asked, strict=True), "r^", label="asked for")
    ax.set_yticks(range(len(splits)), splits)
    ax.set_xlabel("simulated minutes")
    ax.set_title(f"{label}: mean Θ per candidate / the decision's best (below 0.8: dark)")
    fig.colorbar(image, ax=ax, fraction=0.04)
    ax.legend(fontsize="small", loc="upper right")
    fig.tight_layout()
    path = out / f"decisions_{re.sub(r'[^A-Za-z0-9_.-]', '_', label)}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
