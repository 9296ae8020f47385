"""SGLang 0.5.23's own KV events, end to end: a real radix cache records them, SGLang's
`ZmqEventPublisher` (built by its `EventPublisherFactory` from the `--kv-events-config` value our
flags produce) sends them over loopback ZMQ, and our `EventIngestor` applies them to a
`KvDirectory`, which must then hold exactly what the cache holds.

The scheduler's publishing step (`managers/scheduler_components/kv_events_publisher.py::
SchedulerKvEventsPublisher.publish_kv_events`: take the cache's events, publish one
`KVEventBatch`) needs the scheduler's runtime context, so `publish` below repeats its three lines.
"""

from __future__ import annotations

import atexit
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import structlog

from evolving_infra import KvDirectory, block_hashes
from evolving_infra.engines.sglang.flags import sglang_flags
from evolving_infra.router.ingest import EventIngestor
from sglang_support import CACHE_KINDS, PAGE, Pools, cache, cached_len, insert, pools, sg

pytestmark = pytest.mark.sglang

NODE = 3
A = list(range(1, 13))  # 3 pages
B = [*A[:8], 90, 91, 92, 93]  # A's first 2 pages, then its own
C = [5] * 6  # one full page and a partial one, which has no block
D = [40 + i for i in range(16)]
SEQS = (A, B, C, D)


@pytest.fixture(autouse=True)
def quiet_logs() -> Iterator[None]:
    """Shields the ingestor thread from a structlog setup another test left behind."""
    with structlog.testing.capture_logs():
        yield


class Publisher:
    """SGLang's publisher on loopback, configured exactly as `sglang_flags` configures it."""

    def __init__(self) -> None:
        argv = sglang_flags(
            phase="prefill", bootstrap_port=1, kv_events_endpoint="tcp://127.0.0.1:*",
            kv_replay_endpoint="tcp://127.0.0.1:*", fpm_endpoint=None, page_size=PAGE,
            hicache_mooncake=False,
        )  # fmt: skip
        config = argv[argv.index("--kv-events-config") + 1]
        kv_events = sg("sglang.srt.disaggregation.kv_events")
        self._batch = kv_events.KVEventBatch
        self._pub = kv_events.EventPublisherFactory.create(config, 0)
        source = self._pub.describe_local_source(PAGE)
        self.endpoint: str = source["endpoint"]
        self.replay_endpoint: str = source["replay_endpoint"]
        self.seq = 0

    def publish(self, c: Any) -> list[Any]:
        """One scheduler step's worth: whatever the cache recorded since the last one."""
        events = c.take_events()
        if events:
            self._pub.publish(self._batch(ts=time.time(), events=events))
            self.seq += 1
            # SGLang's `publish` only queues the batch; its thread sends it and files it in the
            # replay buffer, and serves replay requests between queued batches. Waiting for the
            # queue makes "published" mean "in the buffer": otherwise a replay can answer before
            # the last batches are filed and those go out on PUB before our subscription is in,
            # and the test would wait for a batch that only the next live one would repair.
            self._pub._event_queue.join()
        return list(events)

    def close(self) -> None:
        self._pub.shutdown()
        # SGLang registered the same shutdown to run at exit, where a second call waits a second
        # on the sentinel nobody takes any more.
        atexit.unregister(self._pub.shutdown)


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.close()


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def settled(ing: EventIngestor, seq: int) -> None:
    def done() -> bool:
        s = ing.state(NODE)
        return s is not None and s.next_seq == seq and not s.replaying

    wait_until(done, f"ingestion up to seq {seq}")


def connect(ing: EventIngestor, pub: Publisher) -> None:
    ing.add_engine(NODE, pub.endpoint, pub.replay_endpoint)
    settled(ing, pub.seq)  # the start-up replay brought everything published so far
    time.sleep(0.2)  # a PUB drops what it sends before the SUB's subscription arrives


def assert_same_holdings(d: KvDirectory, c: Any) -> None:
    """Per sequence, the directory's L1 prefix is the cache's device prefix, in pages; and the
    directory holds no block besides (the sequences cover the whole tree)."""
    for s in SEQS:
        m = d.match(block_hashes(s, PAGE))
        assert m.nodes.get(NODE, (0, 0)) == (cached_len(c, s) // PAGE,) * 2, s
    assert d.held(NODE, "L1") == c.evictable_size() // PAGE
    assert d.held(NODE, "L2") == 0


def grow(c: Any, p: Pools, pub: Publisher) -> list[Any]:
    """Requests A..D finish one per step; returns the events SGLang published."""
    events = []
    for s in SEQS:
        insert(c, p, s)
        events += pub.publish(c)
    return events


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_directory_follows_the_cache(kind: str, publisher: Publisher) -> None:
    p = pools()
    c = cache(kind, p)
    publisher.publish(c)  # the AllBlocksCleared every cache records when it starts
    d = KvDirectory()
    with EventIngestor(d) as ing:
        connect(ing, publisher)
        events = grow(c, p, publisher)
        settled(ing, publisher.seq)
        assert_same_holdings(d, c)
        # SGLang's block hashes are ours: A's three pages arrive as one chained BlockStored.
        stored = [e for e in events if type(e).__name__ == "BlockStored"]
        assert stored[0].block_hashes == block_hashes(A, PAGE)
        assert stored[0].parent_block_hash is None
        # B's own page hangs under A's second one.
        assert stored[1].block_hashes == block_hashes(B, PAGE)[2:]
        assert stored[1].parent_block_hash == block_hashes(A, PAGE)[1]

        base = sg("sglang.srt.mem_cache.base_prefix_cache")
        c.evict(base.EvictParams(num_tokens=3 * PAGE))
        removed = publisher.publish(c)
        assert {type(e).__name__ for e in removed} == {"BlockRemoved"}
        settled(ing, publisher.seq)
        assert_same_holdings(d, c)
        assert d.held(NODE, "L1") < len({h for s in SEQS for h in block_hashes(s, PAGE)})


def test_late_and_returning_subscribers_catch_up_by_replay(publisher: Publisher) -> None:
    """Batches sent while nobody listened (before the router started, or while it was away)
    come back from SGLang's replay buffer."""
    p = pools()
    c = cache("unified-rust", p)
    publisher.publish(c)
    grow(c, p, publisher)  # four batches nobody received
    d = KvDirectory()
    with EventIngestor(d) as ing:
        connect(ing, publisher)
        assert_same_holdings(d, c)
        assert ing.snapshot(NODE).batches == publisher.seq

        ing.remove_engine(NODE)
        base = sg("sglang.srt.mem_cache.base_prefix_cache")
        c.evict(base.EvictParams(num_tokens=2 * PAGE))
        publisher.publish(c)  # missed
        ing.add_engine(NODE, publisher.endpoint, publisher.replay_endpoint)
        settled(ing, publisher.seq)
        assert_same_holdings(d, c)
        # Re-added, it starts over from seq 0: SGLang's first batch clears the node's blocks.
        assert ing.snapshot(NODE).batches == publisher.seq


def test_flag_config_is_sglangs_own() -> None:
    """The `--kv-events-config` JSON binds (not connects) even on a concrete address."""
    argv = sglang_flags(
        phase="decode", bootstrap_port=1, kv_events_endpoint="tcp://127.0.0.1:5557",
        kv_replay_endpoint="tcp://127.0.0.1:5558", fpm_endpoint=None, page_size=PAGE,
        hicache_mooncake=False,
    )  # fmt: skip
    value = argv[argv.index("--kv-events-config") + 1]
    config = sg("sglang.srt.disaggregation.kv_events").KVEventsConfig.from_cli(value)
    assert (config.publisher, config.endpoint, config.replay_endpoint, config.bind) == (
        "zmq",
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
        True,
    )
    assert json.loads(value)["bind"] is True
