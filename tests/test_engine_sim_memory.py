"""What a long-running engine keeps stays bounded by its configuration, not by its uptime.

Issue 8 (the soak's memory): the KV-event replay buffer held 10,000 batches whatever their size
(tens of KiB each with ~100k-token prompts: hundreds of MiB), and the map of block parents kept
every page the engine ever saw. Each test drives the real structure far past its bound and
checks its size; none depends on timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
import zmq

from evolving_infra import block_hashes, cli, memtrace
from evolving_infra.engines.events import (
    DEFAULT_REPLAY_BYTES,
    END_SEQ,
    KvEventPublisher,
)
from evolving_infra.engines.sim import command, core
from evolving_infra.engines.sim.core import EngineCore
from evolving_infra.engines.sim.requests import GenerateSpec
from evolving_infra.nodemodel.kv import BlockParents
from test_engine_events import replay
from test_engine_sim_helpers import PAGE, RecordingSink, settings

Socket = zmq.Socket[bytes]


@pytest.fixture(autouse=True)
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Shields the publisher thread from a structlog configuration left by an earlier test."""
    with structlog.testing.capture_logs() as records:
        yield records


# ------------------------------------------------------------------------------------------------
# the replay buffer


def test_replay_buffer_is_bounded_by_bytes() -> None:
    ctx: zmq.Context[Socket] = zmq.Context()
    try:
        with KvEventPublisher(
            "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_bytes=10_000, context=ctx
        ) as pub:
            assert pub.replay_endpoint is not None
            payloads = [bytes([k]) * 1000 for k in range(50)]
            for p in payloads:
                pub.publish_payload(p)
                assert pub.flush()
                batches, size = pub.replay_buffer()
                assert size <= 10_000
                assert size == 1000 * batches
            assert pub.replay_buffer() == (10, 10_000)
            # A replay from before the buffer gets the newest batches in order, then the end:
            # what a client reads as a gap beyond the buffer.
            replies = replay(ctx, pub.replay_endpoint, 0)
            assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == list(range(40, 50))
            assert [r[3] for r in replies[:-1]] == payloads[40:]
            assert replies[-1] == [b"", b"", END_SEQ, b""]
            # One batch larger than the bound is still kept (the newest always is).
            pub.publish_payload(b"x" * 20_000)
            assert pub.flush()
            assert pub.replay_buffer() == (1, 20_000)
            assert [
                int.from_bytes(r[2], "big") for r in replay(ctx, pub.replay_endpoint, 0)[:-1]
            ] == [50]
    finally:
        ctx.term()


def test_replay_buffer_still_bounded_by_batches() -> None:
    with KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=3) as pub:
        for k in range(10):
            pub.publish_payload(bytes([k]))
        assert pub.flush()
        assert pub.replay_buffer() == (3, 3)


def test_replay_buffer_rejects_an_empty_bound() -> None:
    with pytest.raises(ValueError, match="replay buffer"):
        KvEventPublisher("tcp://127.0.0.1:*", buffer_bytes=0)


def test_replay_bound_is_an_engine_option(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert command.replay_bytes(parser.parse_args([])) == DEFAULT_REPLAY_BYTES == 32 * 2**20
    assert command.replay_bytes(parser.parse_args(["--kv-replay-mib", "0.5"])) == 2**19
    assert cli.main(["engine", "--backend", "sglang", "--kv-replay-mib", "8"]) == 2
    assert "--kv-replay-mib: only --backend sim takes it" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# the parent map


def tree(rng: random.Random, n: int) -> list[list[int]]:
    """`n` chains from first pages, each a fork of an earlier one or a fresh root (ids unique)."""
    ids = iter(range(1, 10**9))
    chains: list[list[int]] = []
    for _ in range(n):
        if chains and rng.random() < 0.7:
            base = rng.choice(chains)
            cut = rng.randrange(1, len(base) + 1)
            chain = base[:cut]
        else:
            chain = []
        chain = chain + [next(ids) for _ in range(rng.randrange(1, 30))]
        chains.append(chain)
    return chains


@pytest.mark.parametrize("seed", range(5))
def test_pruned_parents_keep_the_paths_of_what_they_keep(seed: int) -> None:
    rng = random.Random(seed)
    chains = tree(rng, 60)
    full, pruned = BlockParents(), BlockParents()
    for c in chains:
        full.register(c)
        pruned.register(c)
    everything = {h for c in chains for h in c}
    keep = set(rng.sample(sorted(everything), 25))
    needed = {int(h) for k in keep for h in full.pos[k][0]}  # what is kept and its ancestors
    assert pruned.prune(keep) == len(everything) - len(needed)
    assert len(pruned) == len(needed)
    for h in everything:
        if h in needed:
            path, j = pruned.pos[h]
            want, i = full.pos[h]
            assert (list(path), j) == (list(want), i)
        else:
            assert h not in pruned
    # Registering again after a prune (a forgotten block comes back) works as on a fresh map.
    for c in chains:
        pruned.register(c)
    for h in everything:
        path, j = pruned.pos[h]
        want, i = full.pos[h]
        assert (list(path), j) == (list(want), i)


def test_engine_parent_map_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents' sessions through a small cache: the map of parents holds what the tiers hold and
    the live requests need (and its slack), not every page seen; cache hits still come."""
    monkeypatch.setattr(core, "PARENTS_SLACK", 64)
    l1, l2 = 128, 64
    seen: set[int] = set()
    sizes: list[int] = []
    cached = 0

    async def main() -> None:
        nonlocal cached
        engine = EngineCore(
            settings(time_scale=2000.0, l1_blocks=l1, l2_blocks=l2), kv_sink=RecordingSink()
        )
        await engine.start()
        rng = random.Random(0)
        try:
            for session in range(30):
                ids = [rng.randrange(1, 256) for _ in range(40 * PAGE)]
                for turn in range(4):  # each turn extends the last prompt and its answer
                    live = engine.accept(GenerateSpec(f"{session}.{turn}", list(ids), 8))
                    seen.update(block_hashes(ids, PAGE))
                    await live.wait()
                    cached += live.cached_tokens if turn else 0
                    ids += live.output_ids + [rng.randrange(1, 256) for _ in range(10 * PAGE)]
                    sizes.append(len(engine.parents))
                    stats = engine.memory_stats()
                    assert stats["parent_blocks"] == len(engine.parents)
                    held = stats["held_l1"] + stats["held_l2"]
                    assert len(engine.parents) <= 2 * (held + 2 * len(ids) // PAGE) + 64
        finally:
            await engine.close()

    asyncio.run(main())
    assert len(seen) > 4 * (2 * (l1 + l2) + 64)  # far more pages than the bound: it matters
    assert max(sizes) < len(seen) // 2
    assert cached > 0  # a session's next turn still finds its prefix after prunings


# ------------------------------------------------------------------------------------------------
# memory traces


def test_memtrace_is_off_without_its_variable() -> None:
    assert memtrace.install("test", environ={}) is None


def test_memtrace_writes_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memtrace, "_watched", [])
    monkeypatch.setattr(memtrace, "_installed", False)
    stop = memtrace.install("test", environ={memtrace.ENV: f"{tmp_path}:0.01"})
    assert stop is not None
    lines: list[dict[str, Any]] = []
    try:
        memtrace.watch(lambda: {"things": 3})
        deadline = time.monotonic() + 10
        while not any("things" in x for x in lines) and time.monotonic() < deadline:
            time.sleep(0.01)
            texts = [f.read_text() for f in tmp_path.glob("test-*.jsonl")]
            lines = [json.loads(x) for t in texts for x in t.split("\n")[:-1]]  # whole lines
    finally:
        stop.set()
    line = next(x for x in lines if "things" in x)
    assert line["things"] == 3
    assert line["rss"] > 0
