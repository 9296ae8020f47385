"""Framing between a `PoolClient` and its store worker (4-byte big-endian length + msgpack),
and the synthetic block payload both sides agree on.

Request  `[id, op, args]`; reply `[id, True, result]` or `[id, False, [kind, code, message]]`.
Kept free of Mooncake and of blocking I/O policy: the parent reads with deadlines, the worker
blocks.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import msgpack

HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 31  # a sanity bound: a corrupted header must not make us allocate wildly


def encode(obj: Any) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> Any:
    return msgpack.unpackb(body, raw=False)


def read_exact(fd: int, n: int) -> bytes | None:
    """Blocking read of exactly `n` bytes; None on EOF (the other side closed the pipe)."""
    parts: list[bytes] = []
    left = n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_frame(fd: int) -> Any | None:
    header = read_exact(fd, HEADER.size)
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise ValueError(f"frame of {length} bytes exceeds the bound")
    body = read_exact(fd, length)
    return None if body is None else decode(body)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def synthetic_payload(block_hash: int, size: int) -> bytes:
    """Deterministic bytes standing in for a block's KV: the signed hash, repeated.

    A reader can check any fetched payload without the writer's copy.
    """
    stamp = block_hash.to_bytes(8, "little", signed=True)
    reps, rest = divmod(size, 8)
    return stamp * reps + stamp[:rest]
