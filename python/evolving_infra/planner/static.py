"""The `static:xPyD` planner: a fixed split, never switched (the `static` and `best-static`
baselines of docs/simulator.md; `best-static` runs every split as `static` and reports the best).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from evolving_infra.planner.base import SliceStats, Split, SwitchMode
from evolving_infra.timing.model import IterationModel

_SPLIT = re.compile(r"(\d+)P(\d+)D", re.IGNORECASE)


def parse_split(text: str) -> Split:
    """'3P5D' -> Split(3, 5) (case-insensitive); ValueError otherwise."""
    m = _SPLIT.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not a split like 3P5D: {text!r}")
    return Split(int(m.group(1)), int(m.group(2)))


class StaticPlanner:
    """Never switches: `decide` returns None."""

    # Switch mode and interval do not matter (no switch ever happens); a minute keeps the
    # driver's planner ticks as sparse as the evolving planner's.
    switch_mode: SwitchMode = "in-place-keep"
    interval = 60.0
    reads_reuse = False

    def __init__(self, split: Split) -> None:
        if split.prefill < 1 or split.decode < 1:
            raise ValueError(f"a static split needs both phases, got {split}")
        self.split = split
        self.name = f"static:{split}"

    def decide(
        self, now: float, split: Split, window: Sequence[SliceStats], model: IterationModel
    ) -> Split | None:
        return None

    def switch_done(self) -> None:
        """Nothing is ever in flight."""

    def decision(self, now: float, asked: Split | None) -> dict[str, Any] | None:
        """Nothing is priced."""
        return None
