"""The store worker: one child process per engine that owns a `MooncakeDistributedStore`.

Why a process: pyzmq and `mooncake.store` in one process abort right after `setup()`
(`Assertion failed: pfd.revents & POLLIN`, notes §1.8), and engines publish KV events with
pyzmq. The worker is started with `python -m` (a fresh interpreter, never a fork of an engine
that holds ZMQ sockets), serves framed requests on stdin/stdout (`wire.py`) and exits when its
stdin closes, so it never outlives its engine for long.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

from evolving_infra.engines.pool import wire
from evolving_infra.engines.pool.errors import RPC_FAIL
from evolving_infra.engines.pool.wire import synthetic_payload

# Keys per `put_batch` / `get_batch` call at most. Mooncake's TCP transport (the one this
# machine has) queues at most 1,024 transfers per peer and fails the rest at once ("TCP lane
# queue-full rejection", tcp_transport.cpp: max_queued_transfers_per_peer=1024,
# max_pending_admissions_per_peer=1024); a block is at least one transfer. A 4,096-key get of one
# long prompt's blocks overflowed it, its failed keys were then fetched one by one, and the call
# outlasted its 30 s timeout (parity run, issue 27). Half the queue leaves room for the engine's
# other calls and the other engines' reads of the same segment.
MAX_BATCH_KEYS = 512


class _Worker:
    def __init__(self) -> None:
        self.store: Any = None
        self.config: Any = None
        self.hostname = ""
        self.local_buffer_bytes = 0
        self.te: Any = None
        self.te_buf: Any = None
        self.te_base = 0
        self.te_size = 0

    # -- store -------------------------------------------------------------------------------
    def setup(self, args: dict[str, Any]) -> dict[str, Any]:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # type: ignore[import-untyped, import-not-found, unused-ignore]

        store = MooncakeDistributedStore()
        rc = store.setup(
            "127.0.0.1",
            "P2PHANDSHAKE",
            int(args["segment_bytes"]),
            int(args["local_buffer_bytes"]),
            "tcp",
            "",
            args["master"],
        )
        if rc != 0:
            raise _CodeError("setup", rc)
        self.store = store
        self.hostname = store.get_hostname()
        self.local_buffer_bytes = int(args["local_buffer_bytes"])
        cfg = ReplicateConfig()
        cfg.replica_num = 1
        # NOTE: hard pin, so the master never evicts a block the directory still lists; and
        # the own segment first, so a node's L2 blocks sit in its own host memory (it falls
        # back to other segments silently when full, notes §1.5).
        cfg.with_hard_pin = True
        cfg.preferred_segment = self.hostname
        self.config = cfg
        return {"hostname": self.hostname, "pid": os.getpid()}

    def put(self, items: list[list[Any]]) -> list[int]:
        """`items` = [[key, hash, bytes-or-size], ...]; one return code per item."""
        codes: list[int] = []
        # NOTE: `put_batch` stages all values in the local buffer at once, so batches are cut
        # to half of it; a single value larger than the buffer goes alone (and may fail).
        limit = max(1, self.local_buffer_bytes // 2)
        chunk_keys: list[str] = []
        chunk_vals: list[bytes] = []
        used = 0

        def flush() -> None:
            nonlocal used
            if chunk_keys:
                codes.extend(self._put_chunk(chunk_keys, chunk_vals))
                chunk_keys.clear()
                chunk_vals.clear()
                used = 0

        for key, block_hash, value in items:
            data = synthetic_payload(block_hash, value) if isinstance(value, int) else value
            if used + len(data) > limit or len(chunk_keys) == MAX_BATCH_KEYS:
                flush()
            chunk_keys.append(key)
            chunk_vals.append(data)
            used += len(data)
        flush()
        return codes

    def _put_chunk(self, keys: list[str], values: list[bytes]) -> list[int]:
        if len(keys) == 1:
            return [int(self.store.put(keys[0], values[0], self.config))]
        rc = self.store.put_batch(keys, values, self.config)
        if isinstance(rc, int):
            if rc == 0:
                return [0] * len(keys)
            # The batch call reports one code for all: redo one by one to learn which went in.
            return [
                int(self.store.put(k, v, self.config)) for k, v in zip(keys, values, strict=True)
            ]
        return [int(c) for c in rc]

    def get(self, keys: list[str], size_hint: int) -> list[bytes | None]:
        # NOTE: `get_batch` lands every value in the local buffer at once and yields b'' for
        # all that do not fit, so batches are cut by the expected block size.
        per_chunk = max(1, min((self.local_buffer_bytes // 2) // max(1, size_hint), MAX_BATCH_KEYS))
        out: list[bytes | None] = []
        for i in range(0, len(keys), per_chunk):
            chunk = keys[i : i + per_chunk]
            # A missing key reads as b'' (no error), as does a failed transfer from a dead
            # owner; payloads are never empty, so b'' is a miss unless the key exists (then
            # the value was larger than the hint and is fetched alone).
            values: list[bytes | None] = [bytes(v) or None for v in self.store.get_batch(chunk)]
            empty = [j for j, v in enumerate(values) if v is None]
            if empty:
                present = self.store.batch_is_exist([chunk[j] for j in empty])
                for j, flag in zip(empty, present, strict=True):
                    if flag == 1:
                        values[j] = bytes(self.store.get(chunk[j])) or None
            out.extend(values)
        return out

    def fetch(self, keys: list[str], size_hint: int) -> list[int | None]:
        """Like `get`, but only the sizes go back: the transfer is real, the pipe hop is not."""
        return [None if v is None else len(v) for v in self.get(keys, size_hint)]

    def exists(self, keys: list[str]) -> list[int]:
        return [int(c) for c in self.store.batch_is_exist(keys)]

    def remove(self, keys: list[str], force: bool) -> list[int]:
        codes: list[int] = []
        for k in keys:
            codes.append(int(self.store.remove(k, force)))
            if codes[-1] == RPC_FAIL:
                # NOTE: with the master gone each key fails on its own after seconds of
                # reconnecting (25 keys outlasted a 30 s call timeout, stalling every call
                # queued behind): the first failure answers for the rest.
                return codes + [RPC_FAIL] * (len(keys) - len(codes))
        return codes

    def sizes(self, keys: list[str]) -> list[int]:
        return [int(self.store.get_size(k)) for k in keys]

    # -- transfer engine ---------------------------------------------------------------------
    def te_init(self, size: int) -> dict[str, Any]:
        from mooncake.engine import TransferEngine  # type: ignore[import-untyped, import-not-found, unused-ignore]

        if self.te is None:
            te = TransferEngine()
            rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
            if rc != 0:
                raise _CodeError("te_init", rc)
            buf = ctypes.create_string_buffer(size)
            base = ctypes.addressof(buf)
            rc = te.register_memory(base, size)
            if rc != 0:
                raise _CodeError("register_memory", rc)
            self.te, self.te_buf, self.te_base, self.te_size = te, buf, base, size
        return {
            "peer": f"127.0.0.1:{self.te.get_rpc_port()}",
            "base": self.te_base,
            "size": self.te_size,
        }

    def te_stage(self, offset: int, block_hash: int, value: bytes | int) -> int:
        data = synthetic_payload(block_hash, value) if isinstance(value, int) else value
        if offset < 0 or offset + len(data) > self.te_size:
            raise _CodeError("te_stage: out of buffer", -600)
        ctypes.memmove(self.te_base + offset, data, len(data))
        return len(data)

    def te_load(self, offset: int, length: int) -> bytes:
        if offset < 0 or offset + length > self.te_size:
            raise _CodeError("te_load: out of buffer", -600)
        return ctypes.string_at(self.te_base + offset, length)

    def te_transfer(
        self, write: bool, peer: str, local: list[int], remote: list[int], lengths: list[int]
    ) -> int:
        srcs = [self.te_base + off for off in local]
        fn = self.te.batch_transfer_sync_write if write else self.te.batch_transfer_sync_read
        return int(fn(peer, srcs, remote, lengths))

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


class _CodeError(Exception):
    def __init__(self, op: str, code: int) -> None:
        self.op = op
        self.code = code
        super().__init__(f"{op}: {code}")


def main() -> int:
    # NOTE: native code (glog, printf in Mooncake) writes to fd 1. The protocol gets a private
    # duplicate of stdout, and fd 1 is pointed at stderr (the worker log) so no stray byte can
    # corrupt a frame.
    proto_out = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    worker = _Worker()
    ops: dict[str, Any] = {
        "setup": worker.setup,
        "put": worker.put,
        "get": worker.get,
        "fetch": worker.fetch,
        "exists": worker.exists,
        "remove": worker.remove,
        "sizes": worker.sizes,
        "te_init": worker.te_init,
        "te_stage": worker.te_stage,
        "te_load": worker.te_load,
        "te_transfer": worker.te_transfer,
        "ping": lambda: os.getpid(),
    }
    while True:
        request = wire.read_frame(0)
        if request is None or request[1] == "close":
            worker.close()
            if request is not None:
                wire.write_all(proto_out, wire.encode([request[0], True, None]))
            return 0
        req_id, op, args = request
        try:
            reply = [req_id, True, ops[op](*args)]
        except _CodeError as e:
            reply = [req_id, False, ["code", e.code, e.op]]
        except ImportError as e:
            reply = [req_id, False, ["import", 0, str(e)]]
        except Exception as e:  # reported to the parent, which raises a typed error
            reply = [req_id, False, ["internal", 0, f"{type(e).__name__}: {e}"]]
        wire.write_all(proto_out, wire.encode(reply))


if __name__ == "__main__":
    sys.exit(main())
