"""The engines' side of SGLang 0.5.23's ZMQ protocols, checked on real sockets over loopback.

KV events (`engines/events.py`): our encoder reproduces the golden bytes captured from SGLang's
own `RadixCache` exactly; the live frames, the replay request/response framing and its end
marker are those of SGLang's `ZmqEventPublisher`. Forward-pass metrics (`engines/samples.py`):
frames and map keys of SGLang's `_FpmPublisherThread`, and the messages parse back into the
`Sample`s they came from. Subscribers here are plain pyzmq sockets, not our ingestor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import msgpack
import pytest
import structlog
import zmq

from evolving_infra import KvDirectory
from evolving_infra.engines.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventPublisher,
    Medium,
    decode_batch,
    encode_batch,
    offset_endpoint,
    seq_bytes,
)
from evolving_infra.engines.samples import (
    ForwardPassMetrics,
    ForwardPassMetricsPublisher,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
    decode_message,
)
from evolving_infra.timing.samples import Sample, from_forward_pass_metrics
from test_golden_sglang import INSERTED_CHAINS, MAP_BATCHES

Socket = zmq.Socket[bytes]
TIMEOUT_MS = 5000


@pytest.fixture(autouse=True)
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """The test's log records. Also shields the publisher and ingestor threads from a structlog
    configuration left by an earlier test (the CLI's) that prints to a stream pytest has closed."""
    with structlog.testing.capture_logs() as records:
        yield records


# ------------------------------------------------------------------------------------------------
# encoding


@pytest.mark.parametrize("index", range(len(MAP_BATCHES)))
def test_reencoding_golden_batches_gives_the_same_bytes(index: int) -> None:
    golden = MAP_BATCHES[index]
    batch = decode_batch(golden)
    assert batch.encode() == golden
    assert encode_batch(batch.events, batch.ts, batch.dp_rank) == golden


def test_golden_events_rebuilt_with_the_constructors() -> None:
    """The first golden batch written from scratch: the constructors' defaults are SGLang's."""
    raw = msgpack.unpackb(MAP_BATCHES[0])
    ev = raw[1][0]
    event = BlockStored(ev["block_hashes"], None, ev["token_ids"], block_size=16)
    assert encode_batch([event], ts=0, dp_rank=0) == MAP_BATCHES[0]  # an int ts goes as float64


def test_wire_shape_of_each_event_type() -> None:
    payload = encode_batch(
        [
            BlockStored([1], None, [1, 2, 3, 4], 4),
            BlockRemoved([1], medium=Medium.CPU),
            AllBlocksCleared(),
            BlockStored([2], 1, [5], 1, lora_id=7, medium=None, session_id="s", lora_name="a"),
        ],
        ts=1.5,
        dp_rank=0,
    )
    # The example of the SGLang notes (§2.2), plus a store with the optional fields.
    expected: list[Any] = [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
            },
            {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU_PINNED"},
            {"type": "AllBlocksCleared"},
            {
                "type": "BlockStored",
                "block_hashes": [2],
                "parent_block_hash": 1,
                "token_ids": [5],
                "block_size": 1,
                "lora_id": 7,
                "session_id": "s",
                "lora_name": "a",
            },
        ],
        0,
    ]
    assert payload == msgpack.packb(expected)
    assert payload[:2] == b"\x93\xcb"  # [ts, events, dp_rank], ts a float64
    decoded = msgpack.unpackb(payload)
    assert [list(e) for e in decoded[1]] == [list(e) for e in expected[1]]  # key order


def test_our_encoding_applies_like_the_golden_bytes() -> None:
    ours, golden = KvDirectory(), KvDirectory()
    for payload in MAP_BATCHES:
        b = decode_batch(payload)
        assert ours.apply_events(1, encode_batch(b.events, b.ts, b.dp_rank), now=b.ts) == (
            golden.apply_events(1, payload, now=b.ts)
        )
        for chain in INSERTED_CHAINS:
            assert ours.match(chain).nodes == golden.match(chain).nodes
    assert ours.stats() == golden.stats()


def test_medium_and_tier_strings() -> None:
    d = KvDirectory()
    d.apply_events(0, encode_batch([BlockStored([1, 2], None, [0] * 8, 4, medium="CPU_PINNED")], 1))
    assert d.match([1, 2]).nodes == {0: (0, 2)}
    assert [str(m) for m in Medium] == ["GPU", "CPU_PINNED", "DISK", "EXTERNAL"]


def test_endpoint_offset_by_dp_rank() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("inproc://cache", 2) == "inproc://cache_dp2"


# ------------------------------------------------------------------------------------------------
# live stream and replay on real sockets


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Socket]]:
    context: zmq.Context[Socket] = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscriber(ctx: zmq.Context[Socket], endpoint: str, topic: bytes = b"") -> Socket:
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.rcvtimeo = TIMEOUT_MS
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def replay(ctx: zmq.Context[Socket], endpoint: str, start: int) -> list[list[bytes]]:
    """SGLang's replay exchange from a DEALER: every reply up to and including the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.rcvtimeo = TIMEOUT_MS
    dealer.connect(endpoint)
    dealer.send_multipart([b"", seq_bytes(start)])
    replies = []
    while True:
        frames = dealer.recv_multipart()
        replies.append(frames)
        if frames[2] == END_SEQ:
            dealer.close()
            return replies


def test_live_frames_and_replay(ctx: zmq.Context[Socket]) -> None:
    with KvEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv", buffer_steps=3, context=ctx
    ) as pub:
        assert pub.replay_endpoint is not None
        sub = subscriber(ctx, pub.endpoint, b"kv")
        assert pub.wait_subscribed()
        payloads = MAP_BATCHES[:5]
        for p in payloads:
            pub.publish_payload(p)
        for seq, p in enumerate(payloads):
            assert sub.recv_multipart() == [b"kv", seq.to_bytes(8, "big"), p]
        sub.close()
        assert pub.flush()

        # Only the last buffer_steps batches are kept; each replay reply repeats the live frames.
        replies = replay(ctx, pub.replay_endpoint, 0)
        assert replies == [
            *([b"", b"kv", seq_bytes(s), payloads[s]] for s in (2, 3, 4)),
            [b"", b"", b"\xff" * 8, b""],
        ]
        assert replay(ctx, pub.replay_endpoint, 4)[0] == [b"", b"kv", seq_bytes(4), payloads[4]]
        assert len(replay(ctx, pub.replay_endpoint, 99)) == 1  # only the end marker


def test_unheld_batches_are_replayed_not_sent(ctx: zmq.Context[Socket]) -> None:
    with KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", context=ctx) as pub:
        assert pub.replay_endpoint is not None
        sub = subscriber(ctx, pub.endpoint)
        assert pub.wait_subscribed()
        assert pub.publish([AllBlocksCleared()], ts=1.0, deliver=False) == 0
        assert pub.publish([BlockStored([5], None, [1], 1)], ts=2.0) == 1
        topic, seq, payload = sub.recv_multipart()
        assert (topic, int.from_bytes(seq, "big")) == (b"", 1)
        assert decode_batch(payload).events == (BlockStored([5], None, [1], 1),)
        replies = replay(ctx, pub.replay_endpoint, 0)
        assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [0, 1]
        assert decode_batch(replies[0][3]).events == (AllBlocksCleared(),)
        sub.close()


def test_malformed_replay_request_gets_no_answer(
    ctx: zmq.Context[Socket], logs: list[MutableMapping[str, Any]]
) -> None:
    with KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", context=ctx) as pub:
        assert pub.replay_endpoint is not None
        pub.publish([AllBlocksCleared()])
        assert pub.flush()
        dealer = ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", b"x", b"y"])  # four frames at the ROUTER: ignored
        dealer.send_multipart([b"", seq_bytes(0)])
        dealer.rcvtimeo = TIMEOUT_MS
        assert int.from_bytes(dealer.recv_multipart()[2], "big") == 0  # the valid one answered
        dealer.close()
    assert [r["event"] for r in logs] == ["invalid replay request"]


def test_dp_rank_goes_into_the_batch() -> None:
    with KvEventPublisher("tcp://127.0.0.1:*", dp_rank=0) as pub0:
        assert msgpack.unpackb(encode_batch([], 1.0, pub0.dp_rank))[2] == 0
    payload = encode_batch([AllBlocksCleared()], 1.0, dp_rank=3)
    assert msgpack.unpackb(payload) == [1.0, [{"type": "AllBlocksCleared"}], 3]


def test_publish_after_close_raises() -> None:
    pub = KvEventPublisher("tcp://127.0.0.1:*")
    pub.close()
    with pytest.raises(RuntimeError):
        pub.publish([AllBlocksCleared()])


# ------------------------------------------------------------------------------------------------
# forward-pass metrics

FPM_KEYS = ["version", "worker_id", "dp_rank", "counter_id", "wall_time"]
SCHEDULED_KEYS = [
    "num_prefill_requests",
    "sum_prefill_tokens",
    "var_prefill_length",
    "sum_prefill_kv_tokens",
    "num_decode_requests",
    "sum_decode_kv_tokens",
    "var_decode_kv_tokens",
]
QUEUED_KEYS = [k for k in SCHEDULED_KEYS if k != "sum_prefill_kv_tokens"]

SAMPLES = [
    Sample("prefill", 0.25, batch=((900, 5000),)),
    Sample("decode", 0.02, batch_size=32, context_tokens=64000),
    Sample("prefill", 0.4, batch=((300, 64), (100, 64))),  # equal prefixes: variance carries over
]


def test_fpm_message_layout() -> None:
    m = ForwardPassMetrics(
        worker_id="w",
        dp_rank=1,
        counter_id=7,
        wall_time=1,
        scheduled_requests=ScheduledRequestMetrics.prefill([(10, 0), (30, 4)]),
        queued_requests=QueuedRequestMetrics(num_prefill_requests=2, sum_prefill_tokens=99),
    )
    message = msgpack.unpackb(m.encode())
    assert list(message) == [*FPM_KEYS, "scheduled_requests", "queued_requests"]
    assert list(message["scheduled_requests"]) == SCHEDULED_KEYS
    assert list(message["queued_requests"]) == QUEUED_KEYS
    assert message["wall_time"] == 1.0
    assert isinstance(message["wall_time"], float)
    assert message["scheduled_requests"]["var_prefill_length"] == 144.0  # lengths 10 and 34
    assert isinstance(message["queued_requests"]["var_decode_kv_tokens"], float)
    assert ScheduledRequestMetrics.decode([10, 20, 30]).var_decode_kv_tokens == pytest.approx(
        200 / 3
    )


def fpm_endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/fpm.0"  # SGLang's shape: {ipc_name}.{dp_rank}


def test_fpm_frames_and_round_trip(ctx: zmq.Context[Socket], tmp_path: Path) -> None:
    with ForwardPassMetricsPublisher(
        fpm_endpoint(tmp_path), worker_id="engine-3", dp_rank=0, context=ctx
    ) as pub:
        sub = subscriber(ctx, pub.endpoint)
        assert pub.wait_subscribed()
        for s in SAMPLES:
            pub.publish_sample(s)
        for seq, s in enumerate(SAMPLES):
            topic, seq_frame, payload = sub.recv_multipart()
            assert (topic, seq_frame) == (b"", seq.to_bytes(8, "big"))
            message = decode_message(payload)
            assert (message["worker_id"], message["counter_id"], message["version"]) == (
                "engine-3",
                seq,
                1,
            )
            back = from_forward_pass_metrics(message)
            assert back is not None
            assert (back.phase, back.seconds, back.batch_size, back.context_tokens) == (
                s.phase,
                s.seconds,
                s.batch_size,
                s.context_tokens,
            )
            assert sorted(back.batch) == sorted(s.batch)
        sub.close()


def test_fpm_idle_heartbeat(ctx: zmq.Context[Socket], tmp_path: Path) -> None:
    with ForwardPassMetricsPublisher(
        fpm_endpoint(tmp_path), heartbeat_interval=0.05, context=ctx
    ) as pub:
        sub = subscriber(ctx, pub.endpoint)
        assert pub.wait_subscribed()
        start = time.monotonic()
        pub.set_idle(True)
        _, seq, payload = sub.recv_multipart()
        pub.set_idle(False)
        assert time.monotonic() - start < 2.0
        message: dict[str, Any] = decode_message(payload)
        assert message == msgpack.unpackb(
            ForwardPassMetrics(counter_id=int.from_bytes(seq, "big")).encode()
        )
        assert message["wall_time"] == 0.0
        assert from_forward_pass_metrics(message) is None
        sub.close()
