#!/usr/bin/env python3
"""Seeds the `decode_events` corpus from the golden SGLang event batches.

Reads `tests/data/sglang/radix_events.json` (SGLang 0.5.23, tagged maps) and
`radix_events_positional.json` (the same events as SGLang 0.5.4 encodes them, positional arrays)
and writes, into `corpus/decode_events/` next to this script:

- every batch alone (each applies to the target's prior state; the later ones name parents only
  the earlier ones create, so they exercise the refusal path);
- each whole recorded sequence as one input, batches joined by the target's separator, so that
  every batch is accepted in turn;
- a few hand-written batches for decoder paths the golden bytes do not reach (unknown event
  types and keys, DISK/CPU media, unsigned and narrow integers, float32 and integer timestamps,
  nil and missing dp_rank, nil ts, trailing fields, bin/ext values, 16- and 32-bit lengths,
  empty and short positional events).

Standard library only; run from anywhere: `python3 rust/kvdir/fuzz/build_corpus.py`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GOLDEN = HERE.parents[2] / "tests" / "data" / "sglang"
# Must equal SEP in fuzz_targets/decode_events.rs.
SEP = b"\xc1BATCH\xc1"


class Ext:
    """A MessagePack ext value (type code, data)."""

    def __init__(self, code: int, data: bytes) -> None:
        self.code, self.data = code, data


class U64:
    """An integer forced into `uint 64` (two's complement of a negative value)."""

    def __init__(self, value: int) -> None:
        self.value = value % (1 << 64)


def _len(n: int, fix: int, fix_max: int, m16: int) -> bytes:
    if n <= fix_max:
        return bytes([fix | n])
    if n < 1 << 16:
        return bytes([m16]) + struct.pack(">H", n)
    return bytes([m16 + 1]) + struct.pack(">I", n)


def pack(v: Any) -> bytes:
    """A small MessagePack writer: shortest integer forms, float64, str, bin, arrays, maps."""
    if v is None:
        return b"\xc0"
    if v is True or v is False:
        return b"\xc3" if v else b"\xc2"
    if isinstance(v, U64):
        return b"\xcf" + struct.pack(">Q", v.value)
    if isinstance(v, int):
        if 0 <= v < 128 or -32 <= v < 0:
            return struct.pack(">b", v) if v < 0 else bytes([v])
        for marker, fmt, lo, hi in (
            (0xCC, ">B", 0, 1 << 8),
            (0xCD, ">H", 0, 1 << 16),
            (0xCE, ">I", 0, 1 << 32),
            (0xCF, ">Q", 0, 1 << 64),
            (0xD0, ">b", -(1 << 7), 1 << 7),
            (0xD1, ">h", -(1 << 15), 1 << 15),
            (0xD2, ">i", -(1 << 31), 1 << 31),
            (0xD3, ">q", -(1 << 63), 1 << 63),
        ):
            if lo <= v < hi:
                return bytes([marker]) + struct.pack(fmt, v)
        raise ValueError(v)
    if isinstance(v, float):
        return b"\xcb" + struct.pack(">d", v)
    if isinstance(v, str):
        b = v.encode()
        if len(b) < 32:
            return bytes([0xA0 | len(b)]) + b
        if len(b) < 256:
            return bytes([0xD9, len(b)]) + b
        return bytes([0xDA]) + struct.pack(">H", len(b)) + b
    if isinstance(v, bytes):
        return bytes([0xC4, len(v)]) + v
    if isinstance(v, Ext):
        fixext = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
        if len(v.data) in fixext:
            return bytes([fixext[len(v.data)], v.code]) + v.data
        return bytes([0xC7, len(v.data), v.code]) + v.data
    if isinstance(v, list):
        return _len(len(v), 0x90, 15, 0xDC) + b"".join(pack(x) for x in v)
    if isinstance(v, dict):
        return _len(len(v), 0x80, 15, 0xDE) + b"".join(pack(k) + pack(x) for k, x in v.items())
    raise TypeError(type(v))


def stored(
    hashes: list[Any], parent: Any, medium: str | None = "GPU", **extra: Any
) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(len(hashes) * 4)),
        "block_size": 4,
        "lora_id": None,
        "medium": medium,
        **extra,
    }


def removed(hashes: list[Any], medium: str | None = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def hand_written() -> dict[str, bytes]:
    """Batches that reach decoder paths the golden bytes do not."""
    big = -0x7123456789ABCDEF
    seeds: dict[str, Any] = {
        # Chains under the target's prior state (1 → 2 → 3, 1 → 2 → 4, 7), in L1 and L2.
        "prior-extend": [1.5, [stored([10, 11], 3), stored([12], 4, "CPU_PINNED")], 0],
        "prior-remove": [2, [removed([3, 2]), removed([2], "CPU_PINNED"), removed([99])], None],
        "prior-clear": [0.0, [{"type": "AllBlocksCleared"}, stored([1, 2], None)], 0],
        # Media that are not tiers, unknown event types and keys, vLLM-style unsigned hashes.
        "media-skipped": [
            1.0,
            [stored([5], 4, "DISK"), removed([1], "EXTERNAL"), stored([6], None, "CPU")],
            0,
        ],
        "unknown-type": [
            1.0,
            [{"type": "BlockPinned", "block_hashes": [1]}, ["BlockPinned", 1, 2]],
            0,
        ],
        "unknown-keys": [
            1.0,
            [
                stored(
                    [U64(big), U64(-5)],
                    None,
                    extra_key={"nested": [1, {"x": b"\x00\x01"}]},
                    ext=Ext(3, b"abcd"),
                )
            ],
            0,
        ],
        "int-widths": [
            7,
            [stored([200, 70000, 5_000_000_000, -100, -40000, -3_000_000_000], None)],
            3,
        ],
        "narrow-ts": None,  # float32 ts, written below
        "trailing-fields": [1.0, [["BlockRemoved", [3], "GPU", "extra", 1]], 0, "extra", [1, 2]],
        "two-fields": [1.0, [stored([8], None)]],
        "positional-mixed": [
            1.0,
            [
                ["BlockStored", [20, 21], None, [1, 2, 3], 16, None],
                ["BlockStored", [22], 21, [4], 16, None, "CPU_PINNED", "more"],
                ["BlockRemoved", [21]],
                ["AllBlocksCleared"],
            ],
            0,
        ],
        "parent-mismatch": [1.0, [stored([3], 1)], 0],
        "duplicate": [1.0, [stored([30, 31, 30], None)], 0],
        "unknown-parent": [1.0, [stored([40], 41)], 0],
        "long-chain": [1.0, [stored(list(range(1000, 1040)), None)], 0],
        "nil-ts": [None, [stored([8], None)], 0],
        "positional-empty": [1.0, [[]], 0],
        "positional-short": [1.0, [["BlockStored", [1]]], 0],
    }
    out = {k: pack(v) for k, v in seeds.items() if v is not None}
    # float32 ts and a 32-bit-length events array.
    events = pack(stored([50], None))
    out["narrow-ts"] = (
        b"\x93\xca" + struct.pack(">f", 2.5) + b"\xdd" + struct.pack(">I", 1) + events + b"\xc0"
    )
    # Two batches in one input: the second names a parent the first creates.
    out["two-batches"] = (
        pack([1.0, [stored([60], None)], 0]) + SEP + pack([2.0, [stored([61], 60)], 0])
    )
    return out


def main() -> int:
    out = HERE / "corpus" / "decode_events"
    out.mkdir(parents=True, exist_ok=True)
    seeds: dict[str, bytes] = {}
    for name, file in (
        ("tagged", "radix_events.json"),
        ("positional", "radix_events_positional.json"),
    ):
        data = json.loads((GOLDEN / file).read_text())
        batches = [base64.b64decode(b) for b in data["event_batches_msgpack_b64"]]
        for i, b in enumerate(batches):
            assert SEP not in b, f"{file} batch {i} contains the separator"
            seeds[f"{name}-{i:02d}"] = b
        seeds[f"{name}-all"] = SEP.join(batches)
    seeds.update(hand_written())
    for name, b in seeds.items():
        # Content-addressed like libFuzzer's own files, with a readable prefix.
        (out / f"{name}-{hashlib.sha1(b).hexdigest()[:12]}").write_bytes(b)
    print(f"{len(seeds)} seeds in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
