"""`CommandError`: an error a subcommand reports to its user, and how the CLI words any error.

The rule of the CLI: an error is ONE line on stderr, `evolving-infra CMD: error: WHAT: FIX`
(what went wrong, then how to fix it), exit status 2, never a traceback. `cli.main` is the one
place that prints errors; code raises typed errors that carry their line:

- `CommandError(what, fix)`: the base of errors worded for the CLI (a missing dependency, a port
  taken, a child process that failed). A subclass whose failure is not the user's doing sets
  `exit_status = 1`; `details` (e.g. a log tail) are printed on the lines after the first.
- other exceptions the CLI knows (a bad trace file, a bad --config...) are reduced to the first
  line of their message by `one_line`; `OSError`s name their file (`os_error_line`).
"""

from __future__ import annotations

import os
from typing import ClassVar, Self

DEBUG_ENV = "EVOLVING_INFRA_DEBUG"


class CommandError(Exception):
    """What went wrong (`what`) and how to fix it (`fix`), each one line; `details`: more lines
    printed after the error line when they help (the end of a child's log)."""

    exit_status: ClassVar[int] = 2

    def __init__(self, what: str, fix: str = "", *, details: str = "") -> None:
        self.what = one_line(what)
        self.fix = one_line(fix)
        self.details = details.rstrip("\n")
        super().__init__(self.line)

    @property
    def line(self) -> str:
        return f"{self.what}: {self.fix}" if self.fix else self.what

    def otherwise(self, alternative: str) -> Self:
        """Adds a way around the error to the fix (`..., or run with --no-pool`); returns self,
        to be raised again by a caller that knows the alternative."""
        self.fix = f"{self.fix}, or {alternative}" if self.fix else alternative
        self.args = (self.line,)
        return self

    def __str__(self) -> str:
        return self.line


def one_line(text: str) -> str:
    """The first non-blank line of `text`, stripped (a message must fit on the error line)."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def os_error_line(e: OSError) -> str:
    """`PATH: reason` for an OSError about a file (not Python's `[Errno 2] ...: 'PATH'`)."""
    if e.filename is None or not e.strerror:
        return one_line(str(e)) or type(e).__name__
    reason = e.strerror[:1].lower() + e.strerror[1:]
    if e.filename2 is not None:
        return f"{e.filename} -> {e.filename2}: {reason}"
    return f"{os.fsdecode(e.filename)}: {reason}"


def message(e: BaseException) -> str:
    """The error line for `e` (without the `evolving-infra CMD: error: ` prefix)."""
    if isinstance(e, CommandError):
        return e.line
    if isinstance(e, OSError):
        return os_error_line(e)
    return one_line(str(e)) or type(e).__name__


def debugging() -> bool:
    """Whether EVOLVING_INFRA_DEBUG asks for tracebacks of unexpected errors."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")
