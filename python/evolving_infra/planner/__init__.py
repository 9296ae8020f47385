"""Phase-split planners: how many nodes prefill and how many decode (pure decisions)."""

from evolving_infra.planner.base import Planner, SliceStats, Split, SwitchMode

__all__ = ["Planner", "SliceStats", "Split", "SwitchMode"]
