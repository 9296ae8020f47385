"""`scripts/scenario-tables.py`: the grid tables (held-out and tuning cells, issue 25's bar in
bold) and `--against`, an earlier folder's figures of the same cells beside them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "scenario-tables.py"


def policy(tokens: float, switches: int = 0, split: str | None = None) -> dict[str, Any]:
    p: dict[str, Any] = {
        "throughput_tokens_per_s": tokens,
        "p95_ttft_s": 1.0,
        "switches": switches,
        "duration_s": 3600.0,
        "lost_kv_reuse": 0.0,
    }
    if split is not None:
        p["split"] = split
    return p


def write(folder: Path, scenario: str, cells: dict[str, tuple[float, int, float]]) -> None:
    """`cells`: label -> (evolving tok/s, its switches, best static tok/s)."""
    runs = {
        label: {
            "policies": {
                "evolving": policy(evo, switches),
                "best-static": policy(best, split="3P6D"),
            }
        }
        for label, (evo, switches, best) in cells.items()
    }
    (folder / scenario).mkdir(parents=True)
    (folder / scenario / "results.json").write_text(json.dumps({"runs": runs, "claims": []}))


def tables(*args: str | Path) -> list[str]:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.splitlines()


def row(lines: list[str], cell: str) -> list[str]:
    (line,) = [ln for ln in lines if ln.startswith(f"| {cell} |")]
    return [c.strip() for c in line.strip("|").split("|")]


def test_grid_cells_with_the_bar_and_an_earlier_run_beside_them(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    write(old, "tuning", {"a-s0": (900.0, 7, 1000.0), "b-s0": (1000.0, 2, 1000.0)})
    write(new, "tuning", {"a-s0": (990.0, 3, 1000.0), "b-s0": (950.0, 2, 1000.0)})
    write(new, "heldout", {"c-s4": (1010.0, 4, 1000.0)})

    alone = tables(new)
    assert row(alone, "tuning: a-s0") == ["tuning: a-s0", "990", "1,000 (3P6D)", "0.990, 3.0"]
    assert row(alone, "tuning: b-s0")[3] == "**0.950, 2.0**"  # under 0.98x
    assert row(alone, "heldout: c-s4")[3] == "1.010, 4.0"  # 4 an hour is within the bar
    assert not any("before" in ln for ln in alone)

    beside = tables(new, "--against", old)
    (head,) = [ln for ln in beside if ln.startswith("| grid cell |")]
    assert "before (old)" in head
    assert row(beside, "tuning: a-s0")[3:] == ["0.990, 3.0", "**0.900, 7.0**"]
    assert row(beside, "tuning: b-s0")[3:] == ["**0.950, 2.0**", "1.000, 2.0"]
    assert row(beside, "heldout: c-s4")[4] == "-"  # not in the earlier folder
