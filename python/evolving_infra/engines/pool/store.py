"""`PoolClient`: how an engine keeps its L2 (host-memory) KV blocks in the shared Mooncake pool.

Each engine runs one store worker (`worker.py`, a child process: pyzmq and the Mooncake store
cannot share a process) that mounts `segment_bytes` of its host memory into the pool and serves
put/get/exists/remove for the engine. Any engine can fetch a block another engine put: that is
the paper's shared L2 pool.

Keys are `ei/<model>/p<page_size>/<hash as 16 hex digits>`: the signed 64-bit block hash in
two's complement, under a model/page-size namespace so two models never collide.

Payloads have the real size of a block's KV (`kv_bytes_per_token x page_size`) divided by
`scale`, so that a CPU machine's memory holds a realistic number of blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import itertools
import math
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import structlog

from evolving_infra.engines.pool import wire
from evolving_infra.engines.pool.errors import (
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    RPC_FAIL,
    MasterUnreachableError,
    MooncakeMissingError,
    PoolFullError,
    PoolOperationError,
    PoolTimeoutError,
    PoolUnavailableError,
)
from evolving_infra.engines.pool.master import MasterAddress
from evolving_infra.ports import LOOPBACK
from evolving_infra.timing.specs import ModelConfig

log = structlog.get_logger(__name__)

DEFAULT_SCALE = 1024
# Mooncake refuses smaller segments (client_buffer_allocation.cpp: "Total size must be at least").
MIN_SEGMENT_BYTES = 16 * 2**20
_PIPE_BYTES = 2**20
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def block_payload_bytes(model: ModelConfig, page_size: int, scale: int = DEFAULT_SCALE) -> int:
    """Bytes stored per block: K and V of `page_size` tokens over all layers, divided by `scale`.

    A node holds the whole model's KV for its tokens whatever its TP degree (TP splits heads
    across the node's GPUs), so the per-block size does not depend on the deployment.
    """
    if page_size <= 0 or scale <= 0:
        raise ValueError("page_size and scale must be positive")
    return max(1, math.ceil(model.kv_bytes_per_token * page_size / scale))


@dataclass(frozen=True, slots=True)
class PoolNamespace:
    """The key prefix of one model and page size; blocks of other namespaces never collide."""

    model: str
    page_size: int

    def __post_init__(self) -> None:
        if not self.model or "/" in self.model:
            raise ValueError(f"model name must be non-empty and without '/': {self.model!r}")
        if self.page_size <= 0:
            raise ValueError("page_size must be positive")

    def key(self, block_hash: int) -> str:
        return self.keys([block_hash])[0]

    def keys(self, hashes: Sequence[int]) -> list[str]:
        """The keys of `hashes`, checked once for the batch (a hand-off puts thousands: one
        check and format per block was 8% of a prefill engine's CPU under `parity`)."""
        if hashes and not (min(hashes) >= _I64_MIN and max(hashes) <= _I64_MAX):
            bad = next(h for h in hashes if not _I64_MIN <= h <= _I64_MAX)
            raise ValueError(f"block hash {bad} is not a signed 64-bit integer")
        prefix = f"ei/{self.model}/p{self.page_size}/"
        return [f"{prefix}{h & 0xFFFF_FFFF_FFFF_FFFF:016x}" for h in hashes]


@dataclass(slots=True)
class PoolStats:
    """Counters of one client (this engine's view; the master's totals are `PoolMaster.metrics`)."""

    hostname: str
    segment_bytes: int
    scale: int
    block_bytes: int
    puts: int = 0
    put_bytes: int = 0
    gets: int = 0
    hits: int = 0
    get_bytes: int = 0
    removes: int = 0
    full_rejections: int = 0


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """How a client joins the pool. `segment_bytes` is this engine's contribution of host memory;
    `local_buffer_bytes` stages puts and gets (a batch is cut to half of it)."""

    master: MasterAddress
    namespace: PoolNamespace
    block_bytes: int
    scale: int = DEFAULT_SCALE
    segment_bytes: int = 64 * 2**20
    local_buffer_bytes: int = MIN_SEGMENT_BYTES
    call_timeout_s: float = 30.0
    setup_timeout_s: float = 20.0
    log_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.segment_bytes < MIN_SEGMENT_BYTES or self.local_buffer_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment and local buffer need at least {MIN_SEGMENT_BYTES} bytes")
        if self.block_bytes <= 0 or self.scale <= 0:
            raise ValueError("block_bytes and scale must be positive")


def _check_master(master: MasterAddress, timeout_s: float = 2.0) -> None:
    try:
        with socket.create_connection((master.host, master.rpc_port), timeout=timeout_s):
            pass
    except OSError as e:
        raise MasterUnreachableError(f"no mooncake_master at {master.rpc}: {e}") from e


class PoolClient:
    """Blocking client of the shared L2 pool, backed by one store worker process.

    Thread-safe (one call at a time on the pipe). Any failure of the worker (death, timeout,
    unreachable master) raises `PoolUnavailableError` and closes the client; make a new one.
    """

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        _check_master(config.master)
        log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="ei-pool-worker-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"worker-{os.getpid()}-{id(self):x}.log"
        env = dict(os.environ, MC_TCP_BIND_ADDRESS=LOOPBACK)
        with self.log_path.open("wb") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "evolving_infra.engines.pool.worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
            )
        assert self._proc.stdin is not None
        assert self._proc.stdout is not None
        self._wfd = self._proc.stdin.fileno()
        self._rfd = self._proc.stdout.fileno()
        # Non-blocking both ways: a hung worker must not block a write of a large payload.
        os.set_blocking(self._wfd, False)
        os.set_blocking(self._rfd, False)
        for fd in (self._wfd, self._rfd):
            # Larger pipes (64 KiB by default) cut the wakeups per block several-fold;
            # best effort, capped by /proc/sys/fs/pipe-max-size.
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        setup = {
            "master": config.master.rpc,
            "segment_bytes": config.segment_bytes,
            "local_buffer_bytes": config.local_buffer_bytes,
        }
        try:
            reply = self._request("setup", [setup], timeout_s=config.setup_timeout_s)
        except BaseException:
            # e.g. MooncakeMissingError: the worker is still alive and must not be left behind.
            self._closed = True
            self._kill()
            self._reap(0.0)
            raise
        self.hostname: str = reply["hostname"]
        self.worker_pid: int = reply["pid"]
        self._stats = PoolStats(
            self.hostname, config.segment_bytes, config.scale, config.block_bytes
        )
        log.info("pool.client.ready", hostname=self.hostname, worker_pid=self.worker_pid)

    # -- public API ----------------------------------------------------------------------------
    def put(self, block_hash: int, payload: int | bytes | None = None) -> None:
        """Store one block; `payload` is its bytes, or a size for a synthetic payload
        (default: the configured `block_bytes`). A block already present is left as it is."""
        self.put_batch([(block_hash, payload)])

    def put_batch(self, blocks: Sequence[tuple[int, int | bytes | None]]) -> None:
        """Store several blocks; raises `PoolFullError` naming those that did not fit."""
        items: list[list[Any]] = []
        sizes: list[int] = []
        keys = self.config.namespace.keys([h for h, _ in blocks])
        for (block_hash, payload), key in zip(blocks, keys, strict=True):
            value = self.config.block_bytes if payload is None else payload
            size = value if isinstance(value, int) else len(value)
            if size <= 0:
                # NOTE: Mooncake reads a missing key as b''; empty payloads would be ambiguous.
                raise ValueError("a block payload must not be empty")
            items.append([key, block_hash, value])
            sizes.append(size)
        codes: list[int] = self._request("put", [items])
        stored: list[int] = []
        rejected: list[int] = []
        for (block_hash, _), size, code in zip(blocks, sizes, codes, strict=True):
            if code in (0, OBJECT_ALREADY_EXISTS):
                stored.append(block_hash)
                if code == 0:
                    self._stats.puts += 1
                    self._stats.put_bytes += size
            elif code == NO_AVAILABLE_HANDLE:
                rejected.append(block_hash)
            else:
                self._fail("put", code)
        if rejected:
            self._stats.full_rejections += len(rejected)
            raise PoolFullError(stored, rejected)

    def get(self, block_hash: int) -> bytes | None:
        """The block's bytes, or None when no node's segment has it (or its owner died)."""
        return self.get_batch([block_hash])[0]

    def get_batch(self, hashes: Sequence[int]) -> list[bytes | None]:
        keys = self.config.namespace.keys(hashes)
        values: list[bytes | None] = self._request("get", [keys, self.config.block_bytes])
        self._stats.gets += len(keys)
        for v in values:
            if v is not None:
                self._stats.hits += 1
                self._stats.get_bytes += len(v)
        return values

    def fetch_batch(self, hashes: Sequence[int]) -> list[int | None]:
        """Pull blocks into this engine's worker and return their sizes (None: miss).

        The Mooncake transfer is the same as `get_batch`'s; the bytes stay in the worker. For
        engines that only need the transfer to happen (the simulated engine): it skips the pipe
        hop that dominates `get_batch` at large blocks.
        """
        keys = self.config.namespace.keys(hashes)
        sizes: list[int | None] = self._request("fetch", [keys, self.config.block_bytes])
        self._stats.gets += len(keys)
        for n in sizes:
            if n is not None:
                self._stats.hits += 1
                self._stats.get_bytes += n
        return sizes

    def exists(self, hashes: Sequence[int]) -> list[bool]:
        """Whether each block is in the pool. After an owner crash this stays True for about
        the master's `client_ttl` while `get` already misses (notes §1.5)."""
        keys = self.config.namespace.keys(hashes)
        codes: list[int] = self._request("exists", [keys])
        out: list[bool] = []
        for code in codes:
            if code not in (0, 1):
                self._fail("exists", code)
            out.append(code == 1)
        return out

    def remove(self, hashes: Sequence[int], *, force: bool = False) -> list[bool]:
        """Remove blocks; per block True if it is gone now (removed or absent).

        False means a reader holds the block's lease (`lease_ttl_ms` after any get or exists):
        retry later, or pass `force=True` to remove it under the reader's feet.
        """
        keys = self.config.namespace.keys(hashes)
        codes: list[int] = self._request("remove", [keys, force])
        out: list[bool] = []
        for code in codes:
            if code in (0, OBJECT_NOT_FOUND):
                out.append(True)
                self._stats.removes += code == 0
            elif code == OBJECT_HAS_LEASE:
                out.append(False)
            else:
                self._fail("remove", code)
        return out

    def _fail(self, op: str, code: int) -> NoReturn:
        if code == RPC_FAIL:
            # The master is gone: a restarted master would not know this client's segment
            # either, so the client is closed and the engine connects anew.
            self.close(timeout_s=0.5)
            raise MasterUnreachableError(f"{op}: lost the master at {self.config.master.rpc}")
        raise PoolOperationError(op, code)

    def stats(self) -> PoolStats:
        """A copy of this client's counters."""
        return dataclasses.replace(self._stats)

    def ping(self, timeout_s: float = 5.0) -> None:
        self._request("ping", [], timeout_s=timeout_s)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask the worker to unmount its segment and exit; kill it if it does not. Idempotent.

        Blocks in this client's segment leave the pool with it.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(PoolUnavailableError, OSError):
                self._roundtrip("close", [], timeout_s)
            self._reap(timeout_s)

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the pipe ------------------------------------------------------------------------------
    def _request(self, op: str, args: list[Any], timeout_s: float | None = None) -> Any:
        """One call to the worker; also used by `transfer.EngineTransfer` for its ops."""
        with self._lock:
            if self._closed:
                raise PoolUnavailableError("client is closed")
            try:
                return self._roundtrip(op, args, timeout_s or self.config.call_timeout_s)
            except PoolUnavailableError:
                self._closed = True
                self._reap(0.0)
                raise

    def _roundtrip(self, op: str, args: list[Any], timeout_s: float) -> Any:
        req_id = next(self._ids)
        deadline = time.monotonic() + timeout_s
        self._send(wire.encode([req_id, op, args]), deadline, op)
        header = self._recv(wire.HEADER.size, deadline, op)
        (length,) = wire.HEADER.unpack(header)
        got_id, ok, result = wire.decode(self._recv(length, deadline, op))
        assert got_id == req_id, "replies come in request order on one pipe"
        if ok:
            return result
        kind, code, message = result
        if kind == "import":
            raise MooncakeMissingError(message)
        if kind == "code" and op == "setup":
            raise PoolUnavailableError(
                f"store setup against {self.config.master.rpc} failed with code {code}",
                log_tail=self._log_tail(),
            )
        if kind == "code":
            raise PoolOperationError(message, code)
        raise PoolUnavailableError(f"worker failed in {op}: {message}", log_tail=self._log_tail())

    def _send(self, data: bytes, deadline: float, op: str) -> None:
        view = memoryview(data)
        with selectors.DefaultSelector() as sel:
            sel.register(self._wfd, selectors.EVENT_WRITE)
            while view:
                if not sel.select(self._left(deadline, op)):
                    continue
                try:
                    n = os.write(self._wfd, view)
                except BlockingIOError:
                    continue
                except (BrokenPipeError, OSError) as e:
                    raise self._dead(f"pipe to worker broke during {op}: {e}") from e
                view = view[n:]

    def _recv(self, n: int, deadline: float, op: str) -> bytes:
        parts: list[bytes] = []
        left = n
        with selectors.DefaultSelector() as sel:
            sel.register(self._rfd, selectors.EVENT_READ)
            while left:
                if not sel.select(self._left(deadline, op)):
                    continue
                try:
                    chunk = os.read(self._rfd, min(left, 1 << 20))
                except BlockingIOError:
                    continue
                if not chunk:
                    raise self._dead(f"worker exited during {op}")
                parts.append(chunk)
                left -= len(chunk)
        return b"".join(parts)

    def _left(self, deadline: float, op: str) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            # NOTE: kill rather than wait on: a late reply would be read as the next call's.
            self._kill()
            raise PoolTimeoutError(f"{op} timed out", log_tail=self._log_tail())
        return left

    def _dead(self, reason: str) -> PoolUnavailableError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(2.0)
        return PoolUnavailableError(reason, self._proc.returncode, self._log_tail())

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def _reap(self, timeout_s: float) -> None:
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._kill()

    def _log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(line[:300] for line in text.splitlines()[-lines:])


class AsyncPoolClient:
    """The same API for asyncio engines: each call runs in a thread, so the loop keeps serving.

    Calls are serialised by the underlying client (one pipe); use a few clients for parallelism.
    """

    def __init__(self, client: PoolClient) -> None:
        self.client = client

    @classmethod
    async def connect(cls, config: PoolConfig) -> AsyncPoolClient:
        return cls(await asyncio.to_thread(PoolClient, config))

    async def put(self, block_hash: int, payload: int | bytes | None = None) -> None:
        await asyncio.to_thread(self.client.put, block_hash, payload)

    async def put_batch(self, blocks: Sequence[tuple[int, int | bytes | None]]) -> None:
        await asyncio.to_thread(self.client.put_batch, blocks)

    async def get(self, block_hash: int) -> bytes | None:
        return await asyncio.to_thread(self.client.get, block_hash)

    async def get_batch(self, hashes: Sequence[int]) -> list[bytes | None]:
        return await asyncio.to_thread(self.client.get_batch, hashes)

    async def fetch_batch(self, hashes: Sequence[int]) -> list[int | None]:
        return await asyncio.to_thread(self.client.fetch_batch, hashes)

    async def exists(self, hashes: Sequence[int]) -> list[bool]:
        return await asyncio.to_thread(self.client.exists, hashes)

    async def remove(self, hashes: Sequence[int], *, force: bool = False) -> list[bool]:
        return await asyncio.to_thread(self.client.remove, hashes, force=force)

    def stats(self) -> PoolStats:
        return self.client.stats()

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)
