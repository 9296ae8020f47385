"""Markdown tables of a folder of scenario results, for docs/scenarios.md.

    .venv/bin/python scripts/scenario-tables.py docs/scenario-results/DATE [--baselines A,B,..]
        [--against docs/scenario-results/EARLIER]

Reads every `NAME/results.json` that `evolving-infra scenario run NAME --out DIR` wrote and
prints: output tokens/s and P95 TTFT per policy (a sweep with its best split), evolving's
throughput over each baseline, the ablations (what each mechanism is worth), the held-out and
tuning grids (evolving over the best static split and switches per hour, per cell; cells under
issue 25's bar, `claims.meets_bar`, in bold; with
`--against`, the same figures of an earlier folder's run of the cell beside them: what a planner
change moved), and every claim's
verdict. A run whose label differs from its scenario's name (e.g. the shift at a 180 s restart)
gets a row of its own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from evolving_infra.sim.claims import grid_cell, meets_bar
from evolving_infra.sim.scenarios import GRIDS

DEFAULT = (
    "evolving,dynamo,dynamo-load,dynamo-hicache,arrow,"
    "best-dynamo-static,best-dynamo-hicache-static,best-arrow-static,best-static"
)
ORDER = (
    "cc-low", "cc-mid", "cc-high", "putnam-low", "putnam-mid", "putnam-high",
    "osworld-low", "osworld-mid", "osworld-high", "shift", "scale-36", "scale-256", "scale-3072",
)  # fmt: skip
ABLATIONS = (
    "evolving-lru", "evolving-dynamo-cost", "evolving-no-pool", "evolving-drop", "evolving-fixed"
)  # fmt: skip


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.2f}" if x < 10 else f"{x:.0f}"


def _rows(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    out = []
    names = sorted(p.name for p in folder.iterdir() if (p / "results.json").exists())
    for name in sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else 99, n)):
        results = json.loads((folder / name / "results.json").read_text())
        for label, run in results["runs"].items():
            single = len(results["runs"]) == 1 and name not in GRIDS  # a grid's rows are cells
            row = name if single or label == name else f"{name}: {label}"
            out.append((row, run["policies"]))
    return out


def _grid_row(row: str) -> bool:
    return any(row.startswith(f"{g}: ") for g in GRIDS)


def _figures(p: dict[str, Any]) -> str:
    """A grid cell's figures (`claims.grid_cell`), in bold when under the bar."""
    ratio, per_hour = grid_cell(p)
    text = f"{ratio:.3f}, {per_hour:.1f}"
    return text if meets_bar(ratio, per_hour) else f"**{text}**"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--baselines", default=DEFAULT, help="policies, in column order")
    parser.add_argument(
        "--against",
        type=Path,
        help="an earlier folder of results: its grid cells' figures beside these",
    )
    args = parser.parse_args()
    cols = args.baselines.split(",")
    rows = [(r, p) for r, p in _rows(args.folder) if "evolving" in p]
    # One policy alone (initial-splits) has nothing to compare.
    # The held-out grid has a table of its own (below).
    level = [
        (r, p)
        for r, p in rows
        if len(p) > 1 and not any(a in p for a in ABLATIONS) and not _grid_row(r)
    ]

    print("| scenario | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for row, p in level:
        tps, ttft = [], []
        for c in cols:
            f = p.get(c)
            if f is None:
                tps.append("-")
                ttft.append("-")
                continue
            split = f" ({f['split']})" if "split" in f else ""
            tps.append(f"{f['throughput_tokens_per_s']:,.0f}{split}")
            ttft.append(_num(f["p95_ttft_s"]) if f["p95_ttft_s"] is not None else "-")
        print(f"| {row} | " + " | ".join(tps) + " |")
        print("|  | P95 " + " | ".join(ttft) + " |")

    print()
    others = [c for c in cols if c != "evolving"]
    print("| scenario | " + " | ".join(f"x{c}" for c in others) + " |")
    print("|---" * (len(others) + 1) + "|")
    for row, p in level:
        evo = p["evolving"]["throughput_tokens_per_s"]
        cells = []
        for c in others:
            f = p.get(c)
            t = f["throughput_tokens_per_s"] if f else 0
            cells.append(f"{evo / t:.2f}" if t else "-")
        print(f"| {row} | " + " | ".join(cells) + " |")

    abl = [(r, p) for r, p in rows if any(a in p for a in ABLATIONS)]
    if abl:
        print()
        names = [a for a in ABLATIONS if any(a in p for _, p in abl)]
        print("| workload | evolving | " + " | ".join(names) + " | reference |")
        print("|---" * (len(names) + 3) + "|")
        for row, p in abl:
            evo = p["evolving"]
            cells = []
            for a in names:
                f = p[a]
                r = evo["throughput_tokens_per_s"] / max(f["throughput_tokens_per_s"], 1e-9)
                lost = f["lost_kv_reuse"] or 0.0
                cells.append(f"{f['throughput_tokens_per_s']:,.0f} ({r:.2f}x, lost {lost:.3f})")
            refs = [
                f"{c} {p[c]['throughput_tokens_per_s']:,.0f}"
                + (f" ({p[c]['split']})" if "split" in p[c] else "")
                for c in p
                if c not in ("evolving", *ABLATIONS)
            ]
            head = f"{evo['throughput_tokens_per_s']:,.0f} (lost {evo['lost_kv_reuse'] or 0:.3f})"
            print(f"| {row} | {head} | " + " | ".join(cells) + " | " + "; ".join(refs) + " |")

    grid = [(r, p) for r, p in rows if _grid_row(r) and "best-static" in p]
    if grid:
        before = {}
        if args.against is not None:
            before = {r: p for r, p in _rows(args.against) if "evolving" in p}
        print()
        head = "| grid cell | evolving tok/s | best static | evolving / best, switches/h |"
        print(head + (f" before ({args.against.name}) |" if args.against else ""))
        print("|---" * (4 + bool(args.against)) + "|")
        for row, p in grid:
            evo, best = p["evolving"], p["best-static"]
            line = (
                f"| {row} | {evo['throughput_tokens_per_s']:,.0f} |"
                f" {best['throughput_tokens_per_s']:,.0f} ({best.get('split', '?')}) |"
                f" {_figures(p)} |"
            )
            if args.against is not None:
                old = before.get(row)
                line += f" {_figures(old)} |" if old and "best-static" in old else " - |"
            print(line)

    print()
    print("| scenario | claim | outcome |")
    print("|---|---|---|")
    for name in sorted(p.name for p in args.folder.iterdir() if (p / "results.json").exists()):
        results = json.loads((args.folder / name / "results.json").read_text())
        for v in results["claims"]:
            print(f"| {name} | {v['claim']} | {v['outcome']} |")


if __name__ == "__main__":
    main()
