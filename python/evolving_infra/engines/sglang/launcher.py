"""The SGLang server as a child process: its command line, start, health wait, log tail, stop.

The child runs `python -m evolving_infra.engines.sglang.launcher ARGS...`, which applies the
in-process patch and runs SGLang's HTTP server (`patch.launch_patched_server`). It gets a
process group of its own: SGLang spawns its scheduler and detokenizer processes (one per GPU
rank), and stopping the engine must stop all of them, not only the first. (A parent killed
with SIGKILL cannot do that: `kill -- -PID` with the `sglang_started` pid stops the group.)
Its output goes through the parent (to stderr, as it comes), which keeps the last lines to say
why SGLang exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections import deque
from collections.abc import Mapping, Sequence

import structlog

from evolving_infra.engines.sglang.sglang_http import (
    SglangHttp,
    SglangTimeoutError,
    SglangUnavailableError,
)

log = structlog.get_logger("evolving_infra.engines.sglang")

SERVER_COMMAND: tuple[str, ...] = (sys.executable, "-m", "evolving_infra.engines.sglang.launcher")
TAIL_LINES = 40
HEALTH_POLL_S = 1.0


class SglangStartError(RuntimeError):
    """SGLang exited, or did not become healthy in time; the message ends with its last lines."""


class SglangProcess:
    """One SGLang server process (group). `start()`, `wait_healthy()`, then `stop()`."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        command: Sequence[str] = SERVER_COMMAND,
        echo: bool = True,
    ) -> None:
        self.argv = [*command, *argv]
        self.env = dict(env)
        self.echo = echo  # copy the child's output to our stderr as it comes
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not started"
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    async def start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own process group: `stop` signals all of SGLang
        )
        self._reader = asyncio.create_task(self._read_output(), name="sglang-output")
        log.info("sglang_started", pid=self._proc.pid, argv=self.argv)

    async def _read_output(self) -> None:
        assert self._proc is not None
        assert self._proc.stdout is not None
        partial = b""
        # Chunks, not readline(): one over-long line (a traceback with a tensor) must not stop
        # the copy, and a child whose pipe fills up would block.
        while chunk := await self._proc.stdout.read(1 << 16):
            if self.echo:
                with contextlib.suppress(ValueError, OSError):  # stderr closed under us
                    sys.stderr.write(chunk.decode(errors="replace"))
                    sys.stderr.flush()
            *lines, partial = (partial + chunk).split(b"\n")
            self._tail.extend(line.decode(errors="replace") for line in lines)
        if partial:
            self._tail.append(partial.decode(errors="replace"))

    def tail(self) -> str:
        """The last lines SGLang printed."""
        return "\n".join(self._tail)

    async def wait(self) -> int:
        """Until the process exits; its output is read to the end first."""
        assert self._proc is not None, "not started"
        code = await self._proc.wait()
        if self._reader is not None:
            # Shielded: a caller giving up on the wait must not stop the copy of the output.
            await asyncio.shield(self._reader)
        return code

    async def wait_healthy(self, url: str, timeout_s: float) -> None:
        """Until `url`/health answers 200; `SglangStartError` when the process exits first or
        `timeout_s` passes (loading a large model takes minutes)."""
        http = SglangHttp(url, timeout_s=30.0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        exited = asyncio.ensure_future(self.wait())
        try:
            while True:
                with contextlib.suppress(SglangUnavailableError, SglangTimeoutError):
                    status, _ = await http.health()
                    if status == 200:
                        return
                if exited.done():
                    raise SglangStartError(self.exit_message(exited.result()))
                if loop.time() >= deadline:
                    raise SglangStartError(
                        f"SGLang did not become healthy at {url}/health within {timeout_s:g} s;"
                        f" its last lines:\n{self.tail()}"
                    )
                await asyncio.wait({exited}, timeout=HEALTH_POLL_S)
        finally:
            if not exited.done():
                exited.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await exited
            await http.close()

    def exit_message(self, code: int) -> str:
        return f"SGLang exited with code {code}; its last lines:\n{self.tail()}"

    async def stop(self, timeout_s: float) -> int | None:
        """SIGTERM to the whole group, SIGKILL after `timeout_s`; the exit code (None: never
        started)."""
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is None:
            self._signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                log.warning("sglang_kill", pid=proc.pid, after_s=timeout_s)
                self._signal(signal.SIGKILL)
        code = await self.wait()
        # The group may outlive its leader (a scheduler process that ignored SIGTERM).
        self._signal(signal.SIGKILL)
        log.info("sglang_stopped", pid=proc.pid, code=code)
        return code

    def _signal(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)


def main(argv: Sequence[str] | None = None) -> int:
    """The child: SGLang's server with the evolving-infra patch, on `argv` (SGLang's flags)."""
    # Imported here: the parent process never imports SGLang (nor needs it installed).
    from evolving_infra.engines.sglang.patch import SglangVersionError, launch_patched_server

    try:
        launch_patched_server(list(sys.argv[1:] if argv is None else argv))
    except SglangVersionError as e:
        print(f"evolving-infra engine: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
