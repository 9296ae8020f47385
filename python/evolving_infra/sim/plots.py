"""Per-minute timelines of a comparison (matplotlib, PNG): throughput, hit rate, split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI

import matplotlib.pyplot as plt


def timelines(results: dict[str, Any], out: Path) -> list[Path]:
    """Writes `timeline_throughput.png`, `timeline_hit_rate.png` and `timeline_split.png`
    (prefill nodes over time) into `out`; returns their paths."""
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
    return paths
