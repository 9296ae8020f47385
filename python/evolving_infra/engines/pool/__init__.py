"""The shared L2 (host-memory) KV pool on a real Mooncake master and store, and KV transfers.

`PoolMaster` runs `mooncake_master` on loopback; each engine opens a `PoolClient` (or
`AsyncPoolClient`), whose store worker process mounts part of the engine's host memory into the
pool; `EngineTransfer` moves blocks engine to engine. See docs/pool.md.
"""

from evolving_infra.engines.pool.errors import (
    MasterStartError,
    MasterUnreachableError,
    MooncakeMissingError,
    PoolError,
    PoolFullError,
    PoolOperationError,
    PoolTimeoutError,
    PoolUnavailableError,
)
from evolving_infra.engines.pool.master import MasterAddress, PoolMaster
from evolving_infra.engines.pool.store import (
    DEFAULT_SCALE,
    AsyncPoolClient,
    PoolClient,
    PoolConfig,
    PoolNamespace,
    PoolStats,
    block_payload_bytes,
)
from evolving_infra.engines.pool.transfer import EngineTransfer, Throughput, TransferAddress
from evolving_infra.engines.pool.wire import synthetic_payload
from evolving_infra.types import BlockHash

__all__ = [
    "DEFAULT_SCALE",
    "AsyncPoolClient",
    "BlockHash",
    "EngineTransfer",
    "MasterAddress",
    "MasterStartError",
    "MasterUnreachableError",
    "MooncakeMissingError",
    "PoolClient",
    "PoolConfig",
    "PoolError",
    "PoolFullError",
    "PoolMaster",
    "PoolNamespace",
    "PoolOperationError",
    "PoolStats",
    "PoolTimeoutError",
    "PoolUnavailableError",
    "Throughput",
    "TransferAddress",
    "block_payload_bytes",
    "synthetic_payload",
]
