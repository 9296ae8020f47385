"""A real `mooncake_master` on loopback: the directory of the shared L2 pool.

The master only keeps metadata (which key lives in which client segment); the bytes live in the
segments the store clients mount. It is started as the bundled ELF rather than the
`mooncake_master` console script so that our PID is the master's (the notes' §1.6 orphan pitfall
of the wrapping scripts), with every listening socket on 127.0.0.1 and no HTTP metadata server:
the clients use `P2PHANDSHAKE`, and the master's own HTTP metadata server ignores its host flag
and binds 0.0.0.0 (notes §1.4).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import structlog

from evolving_infra.engines.pool.errors import (
    PACKAGE_NOT_FOUND,
    MasterStartError,
    MooncakeMissingError,
)
from evolving_infra.ports import LOOPBACK, free_ports

log = structlog.get_logger(__name__)


def mooncake_binary(name: str) -> Path:
    """Path of an ELF bundled in the `mooncake` wheel, found without importing the package.

    Importing `mooncake` loads `store.so` (and with it libibverbs), which a process that only
    starts the master has no use for.
    """
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MooncakeMissingError(PACKAGE_NOT_FOUND)
    for folder in spec.submodule_search_locations:
        path = Path(folder) / name
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise MooncakeMissingError(f"`{name}` not found in the mooncake package")


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((LOOPBACK, port)) == 0


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on loopback `port` (Linux /proc).

    A bare connect test is not enough: another process may hold the port we picked, and the
    master then exits with status 1 about a second later, after the port already "answered".
    """
    inodes: set[str] = set()
    want = f"0100007F:{port:04X}"
    try:
        with open("/proc/net/tcp") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[1] == want and fields[3] == "0A":  # 0A = LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
        if not inodes:
            return False
        fd_dir = Path(f"/proc/{pid}/fd")
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in inodes:
                    return True
    except OSError:
        return False
    return False


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    # Mooncake's periodic metrics lines run to kilobytes: keep the start of each.
    return "\n".join(line[:300] for line in text.splitlines()[-lines:])


@dataclass(frozen=True, slots=True)
class MasterAddress:
    """Where a running master listens; `rpc` is what store clients pass as the master address."""

    host: str
    rpc_port: int
    metrics_port: int

    @property
    def rpc(self) -> str:
        return f"{self.host}:{self.rpc_port}"


class PoolMaster:
    """Starts and stops one `mooncake_master` subprocess; also a context manager.

    `lease_ttl_ms` is the read lease during which a non-forced remove is refused (-706);
    `client_ttl_s` is how long a crashed client's segment still shows its keys (notes §1.5).
    Eviction by the master is switched off (watermark 1.0): the KV directory decides what leaves
    the pool, and a block evicted behind its back would make the directory stale.
    """

    def __init__(
        self,
        *,
        log_dir: Path | None = None,
        lease_ttl_ms: int = 1000,
        client_ttl_s: int = 10,
        start_timeout_s: float = 15.0,
        attempts: int = 3,
    ) -> None:
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.start_timeout_s = start_timeout_s
        self.attempts = attempts
        self._log_dir = log_dir
        self._proc: subprocess.Popen[bytes] | None = None
        self._address: MasterAddress | None = None
        self.log_path: Path | None = None

    @property
    def address(self) -> MasterAddress:
        if self._address is None or not self.running:
            raise MasterStartError("master is not running")
        return self._address

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> MasterAddress:
        """Launch the master and wait until its RPC port accepts connections."""
        if self.running:
            return self.address
        binary = mooncake_binary("mooncake_master")
        log_dir = self._log_dir or Path(tempfile.mkdtemp(prefix="ei-mooncake-master-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        last: MasterStartError | None = None
        for attempt in range(self.attempts):
            try:
                return self._start_once(binary, log_dir / f"master-{attempt}.log")
            except MasterStartError as e:
                # NOTE: a port taken between `free_ports` and the master's bind aborts the
                # master (notes §1.4); fresh ports on the next attempt get past that race.
                last = e
                log.warning("mooncake_master.start_failed", attempt=attempt, reason=e.reason)
        assert last is not None
        raise last

    def restart(self) -> MasterAddress:
        """A master that died (or was stopped) comes back on the same ports, empty, as an
        operator's restart would: the engines' pool clients find it at the address they know."""
        if self._address is None:
            raise MasterStartError("restart: the master was never started")
        self._kill()
        log_dir = self.log_path.parent if self.log_path is not None else Path(tempfile.mkdtemp())
        ports = (self._address.rpc_port, self._address.metrics_port)
        return self._start_once(
            mooncake_binary("mooncake_master"), log_dir / "master-restarted.log", ports
        )

    def _start_once(
        self, binary: Path, log_path: Path, ports: tuple[int, int] | None = None
    ) -> MasterAddress:
        rpc_port, metrics_port = ports or free_ports(2)
        args = [
            str(binary),
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={rpc_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={metrics_port}",
            "--enable_http_metadata_server=false",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            f"--client_ttl={self.client_ttl_s}",
            "--eviction_high_watermark_ratio=1.0",
        ]
        env = dict(os.environ, MC_TCP_BIND_ADDRESS=LOOPBACK)
        self.log_path = log_path
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        self._proc = proc
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            rc = proc.poll()
            if rc is not None:
                tail = _tail(log_path)
                if "error while loading shared libraries" in tail:
                    raise MooncakeMissingError(tail.strip().splitlines()[-1])
                raise MasterStartError(f"exited with status {rc}", tail, rc)
            if _port_open(rpc_port) and _listens(proc.pid, rpc_port):
                break
            if time.monotonic() > deadline:
                self._kill()
                raise MasterStartError(
                    f"RPC port {rpc_port} not listening after {self.start_timeout_s:.0f} s",
                    _tail(log_path),
                )
            time.sleep(0.05)
        self._address = MasterAddress(LOOPBACK, rpc_port, metrics_port)
        atexit.register(self.stop)
        log.info("mooncake_master.started", rpc=self._address.rpc, pid=proc.pid, log=str(log_path))
        return self._address

    def metrics(self, timeout_s: float = 2.0) -> dict[str, float]:
        """The master's Prometheus counters and gauges (`master_allocated_bytes`, ...).

        Labelled series are skipped; the admin server comes up ~1 s after the RPC port.
        """
        url = f"http://{LOOPBACK}:{self.address.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#") or "{" in line:
                continue
            name, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
        return out

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.info("mooncake_master.stopped", pid=proc.pid, returncode=proc.returncode)
        atexit.unregister(self.stop)
        self._proc = None

    def __enter__(self) -> PoolMaster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
