"""The one error a trace file raises when it cannot be used: it names the file, line and field."""

from __future__ import annotations

from pathlib import Path


class TraceFormatError(ValueError):
    """A trace file that cannot be read as its format; `path`, `line` and `field` say where.

    `line` is 1-based (JSON Lines formats) or None (a whole-file JSON document); `field` is the
    JSON path of the offending value, or None when the file as a whole is unreadable.
    """

    def __init__(self, path: Path, field: str | None, reason: str, line: int | None = None) -> None:
        self.path = path
        self.field = field
        self.reason = reason
        self.line = line
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {field}: {reason}" if field else f"{where}: {reason}")


class WorkloadError(ValueError):
    """A request a workload tool cannot carry out (traces that cannot be mixed, an empty plan)."""
