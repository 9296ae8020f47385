"""KV block transfers between two engines' store workers: through the pool and engine to engine.

Real `mooncake_master`, real `MooncakeDistributedStore`s and real `TransferEngine`s (TCP,
`P2PHANDSHAKE`) on loopback. Figures are printed, not asserted: 2 shared cores make them noise.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from evolving_infra.engines.pool import (
    EngineTransfer,
    PoolClient,
    PoolConfig,
    PoolMaster,
    PoolNamespace,
    PoolOperationError,
    block_payload_bytes,
    synthetic_payload,
)
from evolving_infra.engines.pool.transfer import measure_engine_copy, measure_store_copy
from evolving_infra.timing.specs import LLAMA3_70B

# Mooncake comes with the `pool` extra (in `dev`, which `make test` installs): without it these
# tests fail, naming the install command (`MooncakeMissingError`), rather than skip.

MiB = 2**20
BLOCK = block_payload_bytes(LLAMA3_70B, 64)  # 20 KiB: one 64-token block at scale 1024


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PoolClient, PoolClient]]:
    log_dir: Path = tmp_path_factory.mktemp("pool")
    with PoolMaster(log_dir=log_dir) as master:
        cfg = PoolConfig(master.address, PoolNamespace("llama-3-70b", 64), BLOCK, log_dir=log_dir)
        with ThreadPoolExecutor(2) as ex:
            a, b = ex.map(PoolClient, [cfg, cfg])
        yield a, b
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda c: c.close(), [a, b]))


def test_store_copy_moves_exact_bytes(pair: tuple[PoolClient, PoolClient]) -> None:
    a, b = pair
    figures = measure_store_copy(a, b, blocks=64, block_bytes=BLOCK)  # verifies every block
    for t in figures:
        assert t.blocks == 64
        assert t.bytes_per_s > 0
        print(f"\n{t.path}: {t.bytes_per_s / 1e6:.0f} MB/s", end="")
    assert b.stats().hits >= 128  # fetch and get both count
    assert b.exists([-7919]) == [False]  # measure_store_copy cleans up


def test_engine_to_engine_write_and_read(pair: tuple[PoolClient, PoolClient]) -> None:
    a, b = pair
    ta, tb = EngineTransfer(a, 4 * MiB), EngineTransfer(b, 4 * MiB)
    assert ta.address.peer != tb.address.peer
    # Push: a writes two blocks into b's buffer at offsets b chose.
    ta.stage(0, 11, BLOCK)
    ta.stage(BLOCK, 12, b"kv" * 100)
    ta.write(tb.address, [0, BLOCK], [2 * BLOCK, 0], [BLOCK, 200])
    assert tb.load(2 * BLOCK, BLOCK) == synthetic_payload(11, BLOCK)
    assert tb.load(0, 200) == b"kv" * 100
    # Pull: b reads a block back out of a's buffer.
    tb.read(ta.address, [3 * BLOCK], [0], [BLOCK])
    assert tb.load(3 * BLOCK, BLOCK) == synthetic_payload(11, BLOCK)
    with pytest.raises(ValueError, match="outside"):
        ta.write(tb.address, [0], [4 * MiB - 10], [BLOCK])
    te = measure_engine_copy(ta, tb, blocks=128, block_bytes=BLOCK)
    assert te.bytes_per_s > 0
    print(f"\n{te.path}: {te.bytes_per_s / 1e6:.0f} MB/s")


def test_engine_write_to_an_unregistered_address_fails_typed(
    pair: tuple[PoolClient, PoolClient],
) -> None:
    a, b = pair
    ta, tb = EngineTransfer(a, 4 * MiB), EngineTransfer(b, 4 * MiB)
    bogus = type(tb.address)(tb.address.peer, base=4096, size=1 * MiB)
    with pytest.raises(PoolOperationError):
        ta.write(bogus, [0], [0], [BLOCK])
    # The workers survive a rejected transfer.
    ta.write(tb.address, [0], [0], [64])
