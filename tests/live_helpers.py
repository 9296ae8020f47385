"""Real processes on loopback: simulated engines and the router, as the project runs them.

`LiveCluster` starts `evolving-infra engine --backend sim` processes (one per phase given) and an
`evolving-infra router` in front of them, waits until the router's `/health` says ok, and always
stops every process it started (SIGTERM, then SIGKILL) on exit. Each process logs to its own file
in `workdir`; when the `with` body raises, the tail of every log is attached to the exception as
a note, so a failing test shows what the engines and the router said.

Ports: engines take any free port (`--port 0 --grpc-port 0`) and name them in their JSON
`engine_serving` log line; the router's port is found by binding port 0 and releasing it (the
router logs the port it was given, not the one it got), a race only with another process
grabbing that port in the same millisecond.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

LOG_TAIL_LINES = 30


def command() -> list[str]:
    """How to run `evolving-infra`: the venv's script next to this Python, else `-m`."""
    script = Path(sys.executable).parent / "evolving-infra"
    if script.exists():
        return [str(script)]
    found = shutil.which("evolving-infra")
    return [found] if found else [sys.executable, "-m", "evolving_infra"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(slots=True)
class LiveProcess:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    def events(self) -> list[dict[str, Any]]:
        """The JSON log lines written so far (other lines skipped)."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                out.append(event)
        return out

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(text)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM (if not sent yet), then SIGKILL after `grace` seconds; closes the log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(grace)
        self.log_file.close()


@dataclass(slots=True)
class Engine:
    node_id: int
    phase: str
    port: int  # HTTP
    grpc_port: int  # EngineControl: what the router's --engines names


@dataclass
class LiveCluster:
    """Simulated engines (one per entry of `phases`) and the router, on loopback."""

    workdir: Path
    phases: Sequence[str] = ("prefill", "decode")
    time_scale: float = 50.0
    model: str = "llama-3-8b"
    page_size: int = 16
    engine_args: Sequence[str] = ()
    router_args: Sequence[str] = ("--no-planner",)
    start_timeout: float = 60.0
    engines: list[Engine] = field(default_factory=list)
    router_port: int = 0
    processes: list[LiveProcess] = field(default_factory=list)

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def __enter__(self) -> LiveCluster:
        try:
            self._start()
        except BaseException as e:
            self._add_logs(e)
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self._add_logs(exc)
        self.stop()

    def stop(self) -> None:
        # All at once (each takes a second or two to shut down), the router first: it then
        # stops calling the engines it is about to lose.
        for p in reversed(self.processes):
            p.terminate()
        for p in reversed(self.processes):
            p.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ({p.log_path}) ---\n{p.tail()}" for p in self.processes)

    def _add_logs(self, exc: BaseException) -> None:
        if self.processes:
            exc.add_note(self.logs())

    def _spawn(self, name: str, args: Sequence[str]) -> LiveProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / f"{name}.log"
        log_file = path.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [*command(), *args],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
        p = LiveProcess(name, proc, path, log_file)
        self.processes.append(p)
        return p

    def _start(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        started = []
        for node, phase in enumerate(self.phases):
            args = ["engine", "--backend", "sim", "--node-id", str(node), "--phase", phase,
                    "--port", "0", "--grpc-port", "0", "--time-scale", str(self.time_scale),
                    "--model", self.model, "--tp", "1", "--page-size", str(self.page_size),
                    *self.engine_args]  # fmt: skip
            started.append((node, phase, self._spawn(f"engine{node}", args)))
        for node, phase, p in started:
            event = _wait_for(p, "engine_serving", deadline)
            self.engines.append(Engine(node, phase, int(event["port"]), int(event["grpc_port"])))
        self.router_port = free_port()
        addresses = [f"127.0.0.1:{e.grpc_port}" for e in self.engines]
        router = self._spawn(
            "router",
            ["router", "--engines", *addresses, "--port", str(self.router_port),
             "--page-size", str(self.page_size), *self.router_args],
        )  # fmt: skip
        self._wait_healthy(router, deadline)

    def _wait_healthy(self, router: LiveProcess, deadline: float) -> None:
        last = ""
        while time.monotonic() < deadline:
            if router.proc.poll() is not None:
                raise RuntimeError(f"the router exited with {router.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.router_url}/health", timeout=2) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        return
            except urllib.error.HTTPError as e:  # 503 until the engines are registered
                last = e.read().decode(errors="replace")
                e.close()
            except OSError as e:  # not listening yet
                last = str(e)
            time.sleep(0.2)
        raise TimeoutError(f"the router's /health never said ok: {last}")


def _wait_for(p: LiveProcess, event_name: str, deadline: float) -> dict[str, Any]:
    while time.monotonic() < deadline:
        for event in p.events():
            if event.get("event") == event_name:
                return event
        if p.proc.poll() is not None:
            raise RuntimeError(f"{p.name} exited with {p.proc.returncode} before {event_name}")
        time.sleep(0.1)
    raise TimeoutError(f"{p.name} did not log {event_name} in time")
