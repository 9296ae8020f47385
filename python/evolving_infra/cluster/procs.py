"""One process of `cluster up`: its command line, its log, and how it failed.

`Proc.start()` runs the command with its output appended to its log (a restart appends to the
same log, after the lines of the run that died); `failure(code)` is the error that names the
process, its log and its own error line when it printed one.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from evolving_infra.errors import CommandError, one_line

TAIL_LINES = 15


class ClusterError(CommandError):
    """A process of the cluster failed to start or exited (not the user's doing: status 1); the
    first line names it and its log, `details` may hold the end of that log."""

    exit_status = 1


@dataclass
class Proc:
    name: str
    args: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    # How long `wait` gives it to exit after `interrupt` (the router drains its requests first).
    stop_timeout_s: float = 15.0

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def exited(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def interrupt(self) -> None:
        """Asks the process to shut down (SIGINT, as Ctrl-C would)."""
        p = self.popen
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGINT)

    def wait(self, timeout_s: float | None = None) -> None:
        """Waits for the exit; kills the process if it takes longer than `timeout_s` (default:
        its `stop_timeout_s`)."""
        p = self.popen
        if p is None:
            return
        try:
            p.wait(self.stop_timeout_s if timeout_s is None else timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def tail(self, lines: int = TAIL_LINES) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def failure(self, code: int) -> ClusterError:
        """The error for this process having exited with `code`: its own error line when it
        printed one (`evolving-infra X: error: ...`), else the end of its log on later lines."""
        said = _error_line(self.tail(40))
        if said:
            return ClusterError(f"{self.name} exited with status {code}: {said} (log: {self.log})")
        tail = "\n".join(f"  {line[:300]}" for line in self.tail().splitlines())
        return ClusterError(
            f"{self.name} exited with status {code}; its log: {self.log}"
            + ("; its last lines:" if tail else " (empty)"),
            details=tail,
        )


def _error_line(log: str) -> str:
    """What a child `evolving-infra` command said when it failed: its error line, unprefixed."""
    for line in reversed(log.splitlines()):
        if line.startswith("evolving-infra ") and ": error: " in line:
            return one_line(line.split(": error: ", 1)[1])
    return ""
