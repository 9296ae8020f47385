"""One place that configures structlog for every `evolving-infra` process.

Commands log for people (console lines); daemons (router, engines) log JSON lines for machines.
Both go to stderr, so that stdout carries only results (e.g. `--json`).

NOTE: the stream is looked up when a line is written, not when logging is configured. A logger
factory bound to the `sys.stderr` of the moment keeps writing to it after it is replaced, e.g.
by pytest between tests, and a background thread (a ZMQ publisher) that logs to a closed
stream dies with `ValueError`.
"""

from __future__ import annotations

import sys
from typing import Literal

import structlog

Level = Literal["debug", "info", "warning", "error"]


class _CurrentStderr:
    """`sys.stderr` as it is at each write."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(*, json: bool = False, level: Level = "info") -> None:
    """Console lines (`json=False`) or JSON lines with ISO UTC times, at `level` and above."""
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso" if json else "%H:%M:%S", utc=json),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
