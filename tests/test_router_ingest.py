"""The router's side: KV events and pass metrics from real publishers over loopback ZMQ.

Each test drives a real `KvEventPublisher` (SGLang's wire protocol, see test_engine_events.py)
into a real `EventIngestor` and compares the directory with a second one fed the same payloads
directly: what the events imply. Losses are made on purpose (a batch buffered for replay but not
sent), never left to timing; waits poll with a deadline, and publishing starts only once the
publisher has seen the subscription and the ingestor's start-up replay is over.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog
import zmq

from directory_helpers import TIERS, read_match, semantic_stats
from evolving_infra import KvDirectory
from evolving_infra.engines.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventPublisher,
    encode_batch,
)
from evolving_infra.engines.samples import (
    ForwardPassMetrics,
    ForwardPassMetricsPublisher,
    ScheduledRequestMetrics,
)
from evolving_infra.router import ingest
from evolving_infra.router.ingest import EventCounters, EventIngestor, SampleIngestor
from evolving_infra.timing.samples import Sample
from test_golden_sglang import INSERTED_CHAINS, MAP_BATCHES

Socket = zmq.Socket[bytes]
LOOPBACK = "tcp://127.0.0.1:*"


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def settled(ingestor: EventIngestor, node: int, next_seq: int) -> None:
    """Waits until every batch before `next_seq` has been handled and no replay is in flight."""

    def done() -> bool:
        s = ingestor.state(node)
        return s is not None and s.next_seq == next_seq and not s.replaying

    wait_until(done, f"node {node} to reach seq {next_seq}")


def connect(
    ingestor: EventIngestor, node: int, pub: KvEventPublisher, subscribers: int = 1
) -> None:
    ingestor.add_engine(node, pub.endpoint, pub.replay_endpoint)
    assert pub.wait_subscribed(subscribers)
    settled(ingestor, node, 0)  # the cold-start replay of an empty buffer is over


def holdings(d: KvDirectory, chains: Iterable[Sequence[int]], nodes: Iterable[int]) -> Any:
    """What a directory says about its holdings (eviction candidates as sets: times differ)."""
    return {
        "stats": semantic_stats(d),
        "match": [read_match(d.match(list(c))) for c in chains],
        "candidates": {(n, t): sorted(d.eviction_order(n, t)) for n in nodes for t in TIERS},
    }


def fed(node: int, payloads: Iterable[bytes], d: KvDirectory | None = None) -> KvDirectory:
    d = KvDirectory() if d is None else d
    for p in payloads:
        d.apply_events(node, p)
    return d


@pytest.fixture
def directory() -> KvDirectory:
    return KvDirectory()


@pytest.fixture
def ingestor(directory: KvDirectory) -> Iterator[EventIngestor]:
    with EventIngestor(directory, replay_timeout=2.0) as ing:
        yield ing


def roots(n: int, base: int = 1000) -> list[bytes]:
    """n batches, each storing its own two-block chain under no parent (independent of order)."""
    return [
        encode_batch([BlockStored([base + 2 * k, base + 2 * k + 1], None, [k] * 8, 4)], ts=k)
        for k in range(n)
    ]


ROOT_CHAINS = [[1000 + 2 * k, 1000 + 2 * k + 1] for k in range(12)]


@pytest.fixture(autouse=True)
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """The test's log records. Also shields the publisher and ingestor threads from a structlog
    configuration left by an earlier test (the CLI's) that prints to a stream pytest has closed."""
    with structlog.testing.capture_logs() as records:
        yield records


# ------------------------------------------------------------------------------------------------
# KV events


def test_stream_applies_like_the_payloads(directory: KvDirectory, ingestor: EventIngestor) -> None:
    """Two engines, real SGLang bytes on one and hand-built events on the other, interleaved."""
    with KvEventPublisher(LOOPBACK, LOOPBACK) as a, KvEventPublisher(LOOPBACK, LOOPBACK) as b:
        connect(ingestor, 5, a)
        connect(ingestor, 6, b)
        other = roots(4)
        for k, payload in enumerate(MAP_BATCHES):
            a.publish_payload(payload)
            if k < len(other):
                b.publish_payload(other[k])
        settled(ingestor, 5, len(MAP_BATCHES))
        settled(ingestor, 6, len(other))
    expected = KvDirectory()
    events = sum(expected.apply_events(5, p) for p in MAP_BATCHES)
    fed(6, other, expected)
    chains = [*INSERTED_CHAINS, *ROOT_CHAINS]
    assert holdings(directory, chains, [5, 6]) == holdings(expected, chains, [5, 6])
    assert ingestor.snapshot(5) == EventCounters(
        batches=len(MAP_BATCHES), events_applied=events, replays=1
    )
    assert ingestor.snapshot().batches == len(MAP_BATCHES) + len(other)


def test_gap_is_repaired_from_replay(
    directory: KvDirectory, ingestor: EventIngestor, logs: list[MutableMapping[str, Any]]
) -> None:
    with KvEventPublisher(LOOPBACK, LOOPBACK) as pub:
        connect(ingestor, 2, pub)
        for k, payload in enumerate(MAP_BATCHES):
            # Batches 3 and 4 store pages that later batches extend: they must come back.
            pub.publish_payload(payload, deliver=k not in (3, 4))
        settled(ingestor, 2, len(MAP_BATCHES))
    expected = fed(2, MAP_BATCHES)
    assert holdings(directory, INSERTED_CHAINS, [2]) == holdings(expected, INSERTED_CHAINS, [2])
    c = ingestor.snapshot(2)
    assert (c.gaps, c.gaps_repaired, c.nodes_cleared, c.replays) == (1, 1, 0, 2)
    assert (c.batches, c.corrupt_batches, c.rejected_batches) == (len(MAP_BATCHES), 0, 0)
    warned = [(r["event"], r.get("missing_from"), r.get("received")) for r in logs]
    assert ("kv events: gap", 3, 5) in warned
    assert any(r["event"] == "kv events: gap repaired from replay" for r in logs)


def test_gap_beyond_the_buffer_clears_and_relearns(
    directory: KvDirectory, ingestor: EventIngestor, logs: list[MutableMapping[str, Any]]
) -> None:
    batches = roots(9)
    directory.store(7, "L1", ROOT_CHAINS[0])  # another node's copy survives the clear
    with KvEventPublisher(LOOPBACK, LOOPBACK, buffer_steps=3) as pub:
        connect(ingestor, 1, pub)
        pub.publish_payload(batches[0])
        settled(ingestor, 1, 1)
        assert directory.match(ROOT_CHAINS[0]).nodes == {1: (2, 2), 7: (2, 2)}
        for k in range(1, 7):  # seqs 1-5 are lost, 6 arrives: the buffer only has 4, 5, 6
            pub.publish_payload(batches[k], deliver=k == 6)
        settled(ingestor, 1, 7)
        pub.publish_payload(batches[7])  # and the stream goes on
        pub.publish_payload(batches[8])
        settled(ingestor, 1, 9)
    expected = KvDirectory()
    expected.store(7, "L1", ROOT_CHAINS[0])
    fed(1, batches[4:], expected)
    assert holdings(directory, ROOT_CHAINS, [1, 7]) == holdings(expected, ROOT_CHAINS, [1, 7])
    c = ingestor.snapshot(1)
    assert (c.gaps, c.gaps_repaired, c.nodes_cleared, c.batches) == (1, 0, 1, 6)
    lost = [r for r in logs if r["event"] == "kv events: history lost, node cleared and re-learned"]
    assert [(r["missing_from"], r["resumes_at"]) for r in lost] == [(1, 4)]


def test_seqs_remembered_stay_bounded_across_lost_history(
    ingestor: EventIngestor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seqs kept to tell a repeat from a restart are the last RECENT_SEQS applied, also
    after the stream jumps over history lost beyond the buffer (the seqs before the jump were
    once never dropped: a leak per lost stretch, for the router's whole life)."""
    monkeypatch.setattr(ingest, "RECENT_SEQS", 8)
    batches = roots(40)
    with KvEventPublisher(LOOPBACK, LOOPBACK, buffer_steps=3) as pub:
        connect(ingestor, 1, pub)
        for k in range(6):
            pub.publish_payload(batches[k])
        settled(ingestor, 1, 6)
        for k in range(6, 17):  # 6-13 lost beyond the buffer; 16 arrives, 14-16 replayed
            pub.publish_payload(batches[k], deliver=k == 16)
        settled(ingestor, 1, 17)
        for k in range(17, 40):
            pub.publish_payload(batches[k])
        settled(ingestor, 1, 40)
        assert ingestor.snapshot(1).nodes_cleared == 1
        assert sorted(ingestor._engines[1].recent) == list(range(32, 40))


def test_corrupt_batch_is_counted_and_skipped(
    directory: KvDirectory, ingestor: EventIngestor, logs: list[MutableMapping[str, Any]]
) -> None:
    corrupt = MAP_BATCHES[5][:-7] + b"\xc1" * 7  # truncated events, reserved marker
    with KvEventPublisher(LOOPBACK, LOOPBACK) as pub:
        connect(ingestor, 3, pub)
        for payload in MAP_BATCHES[:5]:
            pub.publish_payload(payload)
        pub.publish_payload(corrupt)
        pub.publish_payload(b"")
        for payload in MAP_BATCHES[5:]:
            pub.publish_payload(payload)
        settled(ingestor, 3, len(MAP_BATCHES) + 2)
    expected = fed(3, MAP_BATCHES)
    assert holdings(directory, INSERTED_CHAINS, [3]) == holdings(expected, INSERTED_CHAINS, [3])
    c = ingestor.snapshot(3)
    assert (c.corrupt_batches, c.batches, c.gaps, c.nodes_cleared) == (2, len(MAP_BATCHES), 0, 0)
    skipped = [r["seq"] for r in logs if r["event"] == "kv events: corrupt batch skipped"]
    assert skipped == [5, 6]


def test_inconsistent_batch_keeps_its_valid_events(
    directory: KvDirectory, ingestor: EventIngestor
) -> None:
    """A store under a parent the directory never saw rejects the batch; the rest still apply."""
    with KvEventPublisher(LOOPBACK, LOOPBACK) as pub:
        connect(ingestor, 4, pub)
        pub.publish([BlockStored([1, 2], None, [0] * 8, 4)])
        pub.publish(
            [
                BlockStored([30], 999, [0] * 4, 4),  # unknown parent
                BlockStored([40, 41], None, [0] * 8, 4),
                BlockRemoved([2]),
            ]
        )
        settled(ingestor, 4, 2)
    assert directory.match([1, 2]).nodes == {4: (1, 1)}
    assert directory.match([40, 41]).nodes == {4: (2, 2)}
    assert 30 not in directory
    c = ingestor.snapshot(4)
    assert (c.batches, c.rejected_batches, c.events_applied, c.events_rejected) == (1, 1, 3, 1)


@pytest.mark.parametrize("first_seen", [0, 1], ids=["seq0-arrives", "seq0-lost"])
def test_publisher_restart(
    directory: KvDirectory, ingestor: EventIngestor, tmp_path: Path, first_seen: int
) -> None:
    live, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"
    old = roots(4)
    new = [encode_batch([AllBlocksCleared(), BlockStored([50, 51], None, [0] * 8, 4)], 1.0)]
    new += roots(2, base=2000)
    with KvEventPublisher(live, replay) as pub:
        connect(ingestor, 9, pub)
        for payload in old:
            pub.publish_payload(payload)
        settled(ingestor, 9, len(old))
    with KvEventPublisher(live, replay) as pub:  # same addresses, seq from 0 again
        assert pub.wait_subscribed()
        for k, payload in enumerate(new):
            pub.publish_payload(payload, deliver=k >= first_seen)
        settled(ingestor, 9, len(new))
    chains = [*ROOT_CHAINS, [50, 51], [2000, 2001], [2002, 2003]]
    assert holdings(directory, chains, [9]) == holdings(fed(9, new), chains, [9])
    c = ingestor.snapshot(9)
    assert (c.restarts, c.gaps, c.nodes_cleared) == (1, 0, 1)


def test_cold_start_learns_the_history(directory: KvDirectory, ingestor: EventIngestor) -> None:
    """A router that starts after its engine learns the cache from the replay buffer."""
    with KvEventPublisher(LOOPBACK, LOOPBACK) as pub:
        for payload in MAP_BATCHES[:12]:
            pub.publish_payload(payload)  # nobody listens: PUB drops them
        assert pub.flush()
        ingestor.add_engine(0, pub.endpoint, pub.replay_endpoint)
        settled(ingestor, 0, 12)
        assert pub.wait_subscribed()
        for payload in MAP_BATCHES[12:]:
            pub.publish_payload(payload)
        settled(ingestor, 0, len(MAP_BATCHES))
    expected = fed(0, MAP_BATCHES)
    assert holdings(directory, INSERTED_CHAINS, [0]) == holdings(expected, INSERTED_CHAINS, [0])
    c = ingestor.snapshot(0)
    assert (c.batches, c.gaps, c.nodes_cleared, c.replays) == (len(MAP_BATCHES), 0, 0, 1)


def test_without_replay_a_gap_clears(directory: KvDirectory, ingestor: EventIngestor) -> None:
    """No replay endpoint, or one that never answers: the node is cleared after the time-out."""
    ctx: zmq.Context[Socket] = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)  # takes requests, never replies
    mute.linger = 0
    mute.bind(LOOPBACK)
    mute_endpoint = mute.getsockopt_string(zmq.LAST_ENDPOINT)
    batches = roots(4)
    with (
        EventIngestor(directory, replay_timeout=0.2) as timing_out,
        KvEventPublisher(LOOPBACK) as a,
        KvEventPublisher(LOOPBACK) as b,
    ):
        ingestor.add_engine(0, a.endpoint)
        timing_out.add_engine(1, b.endpoint, mute_endpoint)
        assert a.wait_subscribed()
        assert b.wait_subscribed()
        settled(timing_out, 1, 0)  # the cold-start replay timed out
        for pub in (a, b):
            for k, payload in enumerate(batches):
                pub.publish_payload(payload, deliver=k != 1)
        settled(ingestor, 0, 4)
        settled(timing_out, 1, 4)
        c1 = timing_out.snapshot(1)
    mute.close()
    expected = fed(1, batches[2:], fed(0, batches[2:]))
    assert holdings(directory, ROOT_CHAINS, [0, 1]) == holdings(expected, ROOT_CHAINS, [0, 1])
    c0 = ingestor.snapshot(0)
    assert (c0.gaps, c0.nodes_cleared, c0.replays, c0.batches) == (1, 1, 0, 3)
    assert (c1.gaps, c1.nodes_cleared, c1.replays, c1.replay_failures) == (1, 1, 2, 2)


def test_remove_engine_keeps_the_totals(directory: KvDirectory, ingestor: EventIngestor) -> None:
    with KvEventPublisher(LOOPBACK, LOOPBACK) as pub:
        connect(ingestor, 1, pub)
        pub.publish_payload(roots(1)[0])
        settled(ingestor, 1, 1)
        ingestor.remove_engine(1)
        wait_until(lambda: ingestor.state(1) is None, "the engine to go")
    assert ingestor.snapshot().batches == 1
    assert directory.match(ROOT_CHAINS[0]).nodes == {1: (2, 2)}  # holdings are the caller's


# ------------------------------------------------------------------------------------------------
# forward-pass metrics

SAMPLES = [
    Sample("prefill", 0.25, batch=((900, 5000),)),
    Sample("decode", 0.02, batch_size=32, context_tokens=64000),
    Sample("decode", 0.03, batch_size=8, context_tokens=9000),
]


def test_samples_reach_the_callback(tmp_path: Path) -> None:
    got: list[tuple[int, Sample]] = []

    def on_sample(node: int, sample: Sample) -> None:
        if sample.batch_size == 8:
            raise RuntimeError("a consumer bug")
        got.append((node, sample))

    mixed = ScheduledRequestMetrics(
        num_prefill_requests=1, sum_prefill_tokens=5, num_decode_requests=2
    )
    with (
        SampleIngestor(on_sample) as ingestor,
        ForwardPassMetricsPublisher(f"ipc://{tmp_path}/fpm.0", heartbeat_interval=0.05) as pub,
    ):
        ingestor.add_engine(4, pub.endpoint)
        assert pub.wait_subscribed()
        for s in SAMPLES[:2]:
            pub.publish_sample(s)
        pub.publish(ForwardPassMetrics(wall_time=0.1, scheduled_requests=mixed))
        pub.publish_sample(SAMPLES[2])
        wait_until(lambda: ingestor.snapshot(4).messages == 4, "four messages")
        pub.set_idle(True)
        wait_until(lambda: ingestor.snapshot(4).heartbeats >= 1, "a heartbeat")
        pub.set_idle(False)
        c = ingestor.snapshot(4)
    assert got == [(4, SAMPLES[0]), (4, SAMPLES[1])]
    assert (c.samples, c.mixed, c.callback_errors, c.malformed, c.lost) == (3, 1, 1, 0, 0)
