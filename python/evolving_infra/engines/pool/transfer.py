"""Moving KV blocks between engines: through the pool, or engine to engine.

Two real mechanisms, both over TCP on loopback here:

- **via the store**: the source `put`s a block into the pool, the destination `get`s it. Needs
  nothing but the two `PoolClient`s; what an L2 hit on another node costs.
- **engine to engine**: each engine's store worker also runs a Mooncake `TransferEngine`
  (`P2PHANDSHAKE`, no metadata server) with a registered staging buffer; the source writes
  blocks straight into the destination's buffer (`batch_transfer_sync_write`). This is the
  P→D KV hand-off path.

`python -m evolving_infra.engines.pool` starts a master and two clients and prints the
bytes/s of each path (figures in docs/pool.md).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from evolving_infra.engines.pool.errors import PoolOperationError
from evolving_infra.engines.pool.master import PoolMaster
from evolving_infra.engines.pool.store import (
    DEFAULT_SCALE,
    PoolClient,
    PoolConfig,
    PoolNamespace,
    block_payload_bytes,
)
from evolving_infra.engines.pool.wire import synthetic_payload
from evolving_infra.timing.specs import LLAMA3_70B

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class TransferAddress:
    """Where a peer's staging buffer lives: what a source needs to write into it."""

    peer: str  # "127.0.0.1:<rpc port>" of the peer's TransferEngine
    base: int  # address of the registered buffer in the peer's process
    size: int


class EngineTransfer:
    """A `TransferEngine` with a registered staging buffer, in the client's store worker.

    The buffer lives in the worker process (the engine's bytes reach it over the pipe with
    `stage`); transfers between two workers go over the TransferEngine's TCP transport.
    """

    def __init__(self, client: PoolClient, buffer_bytes: int) -> None:
        self.client = client
        reply = client._request("te_init", [buffer_bytes])
        self.address = TransferAddress(reply["peer"], reply["base"], reply["size"])

    def stage(self, offset: int, block_hash: int, payload: int | bytes) -> int:
        """Place a block (bytes, or a size for the synthetic payload) at `offset`; its length."""
        n: int = self.client._request("te_stage", [offset, block_hash, payload])
        return n

    def load(self, offset: int, length: int) -> bytes:
        data: bytes = self.client._request("te_load", [offset, length])
        return data

    def write(
        self,
        dst: TransferAddress,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        """Copy `lengths[i]` bytes from our buffer at `local_offsets[i]` into `dst`'s buffer."""
        self._transfer(True, dst, local_offsets, remote_offsets, lengths)

    def read(
        self,
        src: TransferAddress,
        local_offsets: Sequence[int],
        remote_offsets: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        """Copy from `src`'s buffer into ours (the pull direction)."""
        self._transfer(False, src, local_offsets, remote_offsets, lengths)

    def _transfer(
        self,
        write: bool,
        peer: TransferAddress,
        local: Sequence[int],
        remote: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        if not len(local) == len(remote) == len(lengths):
            raise ValueError("offsets and lengths must have equal lengths")
        for off, n in zip(remote, lengths, strict=True):
            if off < 0 or off + n > peer.size:
                raise ValueError(f"remote range {off}+{n} outside the peer's {peer.size} bytes")
        rc = self.client._request(
            "te_transfer",
            [write, peer.peer, list(local), [peer.base + off for off in remote], list(lengths)],
        )
        if rc != 0:
            raise PoolOperationError("te_write" if write else "te_read", rc)


@dataclass(frozen=True, slots=True)
class Throughput:
    path: str
    blocks: int
    block_bytes: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.blocks * self.block_bytes / self.seconds if self.seconds > 0 else 0.0


def measure_store_copy(
    src: PoolClient, dst: PoolClient, blocks: int, block_bytes: int, batch: int = 16
) -> tuple[Throughput, Throughput, Throughput]:
    """Put `blocks` synthetic blocks from `src`, read them at `dst`: (put, fetch, get).

    `fetch` is the Mooncake transfer into `dst`'s worker; `get` adds the pipe hop of the bytes
    to the engine process. Verification is outside the timed loops.
    """
    hashes = [-(i + 1) * 7919 for i in range(blocks)]  # negative: exercises signed keys
    batches = [hashes[i : i + batch] for i in range(0, blocks, batch)]
    t0 = time.perf_counter()
    for chunk in batches:
        src.put_batch([(h, block_bytes) for h in chunk])
    t1 = time.perf_counter()
    sizes = [n for chunk in batches for n in dst.fetch_batch(chunk)]
    t2 = time.perf_counter()
    got = [v for chunk in batches for v in dst.get_batch(chunk)]
    t3 = time.perf_counter()
    if sizes != [block_bytes] * blocks:
        raise AssertionError("fetch missed blocks")
    for h, v in zip(hashes, got, strict=True):
        if v != synthetic_payload(h, block_bytes):
            raise AssertionError(f"block {h} came back wrong")
    src.remove(hashes, force=True)
    return (
        Throughput("store put (own segment)", blocks, block_bytes, t1 - t0),
        Throughput("store fetch (into peer worker)", blocks, block_bytes, t2 - t1),
        Throughput("store get (bytes to peer engine)", blocks, block_bytes, t3 - t2),
    )


def measure_engine_copy(
    src: EngineTransfer, dst: EngineTransfer, blocks: int, block_bytes: int, batch: int = 16
) -> Throughput:
    """Write `blocks` blocks from `src`'s buffer into `dst`'s in batches; staging not timed."""
    per_batch = min(batch, blocks)
    if per_batch * block_bytes > min(src.address.size, dst.address.size):
        raise ValueError("a batch does not fit the staging buffers")
    for j in range(per_batch):
        src.stage(j * block_bytes, j, block_bytes)
    offsets = [j * block_bytes for j in range(per_batch)]
    lengths = [block_bytes] * per_batch
    done = 0
    t0 = time.perf_counter()
    while done < blocks:
        n = min(per_batch, blocks - done)
        src.write(dst.address, offsets[:n], offsets[:n], lengths[:n])
        done += n
    elapsed = time.perf_counter() - t0
    for j in range(min(per_batch, blocks)):
        if dst.load(j * block_bytes, block_bytes) != synthetic_payload(j, block_bytes):
            raise AssertionError(f"engine transfer of block {j} came back wrong")
    return Throughput("engine write (TransferEngine)", blocks, block_bytes, elapsed)


def main(argv: Sequence[str] | None = None) -> int:
    default_block = block_payload_bytes(LLAMA3_70B, 64, DEFAULT_SCALE)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--block-bytes", type=int, default=default_block)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    need = args.blocks * args.block_bytes
    seg = max(64 * 2**20, 2 * need)
    buf = max(16 * 2**20, 4 * args.batch * args.block_bytes)
    with PoolMaster() as master:
        cfg = PoolConfig(
            master.address,
            PoolNamespace("bench", 64),
            args.block_bytes,
            segment_bytes=seg,
            local_buffer_bytes=buf,
        )
        with PoolClient(cfg) as a, PoolClient(cfg) as b:
            store = measure_store_copy(a, b, args.blocks, args.block_bytes, args.batch)
            te_a, te_b = EngineTransfer(a, buf), EngineTransfer(b, buf)
            te = measure_engine_copy(te_a, te_b, args.blocks, args.block_bytes, args.batch)
    for t in (*store, te):
        print(
            f"{t.path:32s} {t.blocks} x {t.block_bytes} B in {t.seconds * 1e3:8.1f} ms:"
            f" {t.bytes_per_s / 1e6:8.1f} MB/s"
        )
    return 0
