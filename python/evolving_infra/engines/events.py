"""SGLang 0.5.23 KV events, publishing end: the wire format and `ZmqEventPublisher`'s protocol.

An engine announces every change to its prefix cache as a `KVEventBatch` on ZMQ (DESIGN §4). The
router decodes batches in Rust (`KvDirectory.apply_events`); this module *writes* them, for the
simulated engine and for tests, byte for byte as SGLang 0.5.23 does
(`sglang/srt/disaggregation/kv_events.py`):

- live stream, PUB: multipart `[topic, seq as 8-byte big-endian unsigned, payload]`, `seq` counting
  from 0 per publisher (a restarted engine starts again at 0);
- payload: msgspec msgpack of `KVEventBatch`, an *array* `[ts, events, attn_dp_rank]`; each event a
  *tagged map* `{"type": ClassName, field: value, ...}` in field-declaration order, fields with a
  default left out when they equal it (`omit_defaults=True`), fields without one always present
  (`lora_id` and `parent_block_hash` even when nil);
- replay, ROUTER: a client (DEALER) sends `[b"", start_seq (8-byte big-endian)]` and receives, for
  each buffered batch with `seq >= start_seq`, `[b"", topic, seq, payload]` exactly as it went
  live, then the end marker `[b"", b"", (-1 as 8-byte big-endian signed), b""]`. The buffer keeps
  the last `buffer_steps` batches (SGLang's bound), and here also no more than `buffer_bytes` of
  payload (at least the newest batch): a batch of ~100k-token prompts' pages is tens of KiB, so
  10,000 of them held hundreds of MiB per engine. Older ones are gone; a replay from before the
  buffer starts at its first batch, which a client reads as a gap beyond the buffer.

Two departures that change nothing on the wire: the live socket is an XPUB (a PUB that also sees
subscriptions, so `wait_subscribed` can end the slow-joiner race without sleeping), and
`publish(..., deliver=False)` buffers a batch for replay without sending it (fault injection: it
is what a subscriber sees when the PUB high-water mark drops a message).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, Literal, Self

import msgpack
import structlog
import zmq

log = structlog.get_logger(__name__)

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
"""The `seq` frame of the replay end marker (kv_events.py `ZmqEventPublisher.END_SEQ`)."""


def seq_bytes(seq: int) -> bytes:
    """A sequence number as it travels: 8 bytes, big-endian, unsigned."""
    return seq.to_bytes(8, "big")


class Medium(StrEnum):
    """SGLang's `StorageMedium`: the strings on the wire (note `CPU` is sent as "CPU_PINNED")."""

    GPU = "GPU"  # L1: device memory
    CPU = "CPU_PINNED"  # L2: pinned host memory
    DISK = "DISK"  # L3: not a directory tier, the router skips it
    EXTERNAL = "EXTERNAL"  # L4: shared remote pool, skipped too


MEDIUM_OF_TIER: Final[Mapping[Literal["L1", "L2"], Medium]] = {"L1": Medium.GPU, "L2": Medium.CPU}


def _medium(value: str | None) -> str | None:
    # msgpack packs only exact `str`; a StrEnum member must go out as its plain value.
    return None if value is None else str(value)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """The engine now holds `block_hashes` (a chain under `parent_block_hash`) in `medium`.

    Fields in SGLang's declaration order. SGLang's recorder always sets `medium` ("GPU" unless a
    host tier stores); `None` leaves it off the wire, which consumers read as GPU.
    """

    block_hashes: Sequence[int]
    parent_block_hash: int | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = Medium.GPU
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None

    def to_wire(self) -> dict[str, Any]:
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(self.block_hashes),
            "parent_block_hash": self.parent_block_hash,
            "token_ids": list(self.token_ids),
            "block_size": self.block_size,
            "lora_id": self.lora_id,
        }
        # omit_defaults: these four default to None in SGLang and are dropped when None.
        optional = {
            "medium": _medium(self.medium),
            "cache_salt": self.cache_salt,
            "session_id": self.session_id,
            "lora_name": self.lora_name,
        }
        event.update((k, v) for k, v in optional.items() if v is not None)
        return event


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The engine no longer holds `block_hashes` in `medium`."""

    block_hashes: Sequence[int]
    medium: str | None = Medium.GPU

    def to_wire(self) -> dict[str, Any]:
        event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(self.block_hashes)}
        if self.medium is not None:
            event["medium"] = _medium(self.medium)
        return event


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine holds nothing any more (cache reset; SGLang also sends one at start-up)."""

    def to_wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One `KVEventBatch`: what an engine publishes per scheduler step that changed its cache."""

    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = 0

    def encode(self) -> bytes:
        return encode_batch(self.events, self.ts, self.dp_rank)


def encode_batch(events: Sequence[KvEvent], ts: float, dp_rank: int | None = 0) -> bytes:
    """The msgpack payload SGLang 0.5.23 sends for these events (msgspec's encoding).

    `ts` is a float64 even when integral (msgspec encodes a `float` field as one; SGLang passes
    `time.time()`). Ints take their shortest msgpack form, as both msgspec and msgpack do.
    """
    payload = msgpack.packb([float(ts), [e.to_wire() for e in events], dp_rank])
    assert isinstance(payload, bytes)
    return payload


class EventFormatError(ValueError):
    """Bytes that are not a 0.5.23 `KVEventBatch` (the Python reader is strict, unlike Rust's)."""


def decode_batch(payload: bytes) -> KvEventBatch:
    """Reads a tagged-map batch back into events (tools and tests; the router decodes in Rust)."""
    try:
        ts, raw_events, dp_rank = msgpack.unpackb(payload)
        events = tuple(_event(e) for e in raw_events)
        return KvEventBatch(float(ts), events, dp_rank)
    except (ValueError, TypeError, KeyError) as e:
        raise EventFormatError(f"not a KVEventBatch: {e!r}") from None


def _event(raw: Mapping[str, Any]) -> KvEvent:
    fields = {k: v for k, v in raw.items() if k != "type"}
    match raw["type"]:
        case "BlockStored":
            fields.setdefault("medium", None)
            return BlockStored(**fields)
        case "BlockRemoved":
            fields.setdefault("medium", None)
            return BlockRemoved(**fields)
        case "AllBlocksCleared":
            return AllBlocksCleared()
        case other:
            raise ValueError(f"unknown event type {other!r}")


# ------------------------------------------------------------------------------------------------
# the publishing thread


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """SGLang's `offset_endpoint_port`: rank r of a data-parallel engine publishes on port + r."""
    if dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("tcp") and ":" in endpoint:
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + dp_rank}"
    raise ValueError(f"cannot offset endpoint {endpoint!r} by dp rank {dp_rank}")


def _should_bind(endpoint: str, bind: bool | None) -> bool:
    # SGLang's heuristic (bind wildcard, ipc and inproc addresses; connect otherwise), unless told.
    if bind is not None:
        return bind
    return any(w in endpoint for w in ("*", "::", "0.0.0.0")) or endpoint.startswith(
        ("ipc://", "inproc://")
    )


_STOP: Final = object()

DEFAULT_REPLAY_BYTES: Final = 32 * 2**20
"""The replay buffer's default bound on payload bytes (`KvEventPublisher.buffer_bytes`)."""


class PublisherThread:
    """A ZMQ XPUB owned by one background thread, fed through a queue.

    ZMQ sockets are not thread-safe, and an engine publishes from its scheduler thread while
    subscriptions (and, for KV events, replay requests) arrive at any time: one thread owns every
    socket, and `publish` only enqueues. A self-pipe in the thread's poller wakes it at once, so
    an idle publisher sleeps instead of spinning on a timeout. Subclasses add sockets.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        bind: bool | None = None,
        hwm: int = 100_000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        name: str = "zmq-publisher",
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.set_hwm(hwm)
        # Every subscription is reported, not only the first per topic: wait_subscribed(n) counts.
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.linger = 0
        self.endpoint = endpoint
        if _should_bind(endpoint, bind):
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(endpoint)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        self._cond = threading.Condition()
        self._subscriptions = 0
        self._queued = 0
        self._done = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def _abort(self) -> None:
        """Releases what the constructor took, when a subclass fails before `_start`."""
        for s in [self._pub, *self._sockets()]:
            s.close(linger=0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- caller side --------------------------------------------------------------------------

    def _enqueue(self, item: Any) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("publisher is closed")
            self._queued += 1
            self._queue.put(item)
        self._wake()

    def _wake(self) -> None:
        with self._cond, contextlib.suppress(BlockingIOError):  # a full pipe holds a wake-up
            if self._wake_w >= 0:
                os.write(self._wake_w, b"\0")

    def wait_subscribed(self, count: int = 1, timeout: float = 5.0) -> bool:
        """Waits until `count` subscriptions have reached the socket (no sleep-and-hope)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._subscriptions >= count, timeout)

    def flush(self, timeout: float = 5.0) -> bool:
        """Waits until everything published so far has been handed to ZMQ."""
        with self._cond:
            return self._cond.wait_for(lambda: self._done >= self._queued, timeout)

    def close(self, timeout: float = 2.0) -> None:
        """Sends what is queued, then closes the sockets (linger 0, as SGLang's shutdown)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._wake()
        self._thread.join(timeout)
        # The pipe is closed here, not by the thread: a late `_wake` must never hit a reused fd.
        if not self._thread.is_alive():
            with self._cond:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_w = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- thread side --------------------------------------------------------------------------

    def _sockets(self) -> list[zmq.Socket[bytes]]:
        """Extra sockets to poll (subclasses)."""
        return []

    def _on_readable(self, sock: zmq.Socket[bytes]) -> None:
        """One of `_sockets()` has input."""

    def _handle(self, item: Any) -> None:
        """Sends one queued item."""

    def _poll_timeout_ms(self) -> int | None:
        """How long the thread may sleep with nothing to do (None: until woken)."""
        return None

    def _idle(self) -> None:
        """Called after each wake-up (subclasses: timers)."""

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        for s in self._sockets():
            poller.register(s, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(self._poll_timeout_ms()))
                if self._wake_r in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                if self._pub in ready:
                    self._read_subscriptions()
                for s in self._sockets():
                    if s in ready:
                        self._on_readable(s)
                if self._drain_queue():
                    return
                self._idle()
        finally:
            for s in [self._pub, *self._sockets()]:
                s.close(linger=0)

    def _read_subscriptions(self) -> None:
        while True:
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == b"\x01":
                with self._cond:
                    self._subscriptions += 1
                    self._cond.notify_all()

    def _drain_queue(self) -> bool:
        """Sends every queued item; True once the stop marker has been reached."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return False
            if item is _STOP:
                return True
            try:
                self._handle(item)
            except zmq.ZMQError:
                # A publisher must not die on one failed send; the gap is the subscriber's to see.
                log.exception("zmq send failed", publisher=self._thread.name)
            with self._cond:
                self._done += 1
                self._cond.notify_all()


class KvEventPublisher(PublisherThread):
    """SGLang's `ZmqEventPublisher`, wire-compatible: live PUB plus an optional replay ROUTER.

    `endpoint` and `replay_endpoint` follow SGLang's `KVEventsConfig` (port offset by `dp_rank`,
    bind heuristics); with a wildcard port (`tcp://127.0.0.1:*`) the bound addresses are in
    `endpoint` and `replay_endpoint` after construction.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        buffer_bytes: int = DEFAULT_REPLAY_BYTES,
        hwm: int = 100_000,
        dp_rank: int = 0,
        bind: bool | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if buffer_steps < 1 or buffer_bytes < 1:
            raise ValueError(f"a replay buffer of {buffer_steps} batches, {buffer_bytes} bytes")
        super().__init__(
            offset_endpoint(endpoint, dp_rank), bind=bind, hwm=hwm, context=context,
            name="kv-event-publisher",
        )  # fmt: skip
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.buffer_steps = buffer_steps
        self.buffer_bytes = buffer_bytes
        # Touched by the publishing thread only (`_handle`, `_serve_replay`).
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffered_bytes = 0
        self._seq = itertools.count()
        self._seq_lock = threading.Lock()
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            # ROUTER: one request, many replies, to any number of clients (told apart by identity).
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.linger = 0
            try:
                self._replay.bind(offset_endpoint(replay_endpoint, dp_rank))
            except zmq.ZMQError:
                self._abort()
                raise
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._start()

    def publish(
        self, events: Sequence[KvEvent], ts: float | None = None, *, deliver: bool = True
    ) -> int:
        """Publishes one batch; returns its `seq`. `deliver=False`: buffer it, do not send it."""
        ts = time.time() if ts is None else ts
        return self.publish_payload(encode_batch(events, ts, self.dp_rank), deliver=deliver)

    def publish_payload(self, payload: bytes, *, deliver: bool = True) -> int:
        """Publishes already-encoded bytes (another encoder's, or deliberately corrupt ones)."""
        # The seq is taken and enqueued under one lock: queue order is seq order.
        with self._seq_lock:
            seq = next(self._seq)
            self._enqueue((seq, payload, deliver))
        return seq

    def _handle(self, item: Any) -> None:
        seq, payload, deliver = item
        if deliver:
            self._pub.send_multipart((self.topic, seq_bytes(seq), payload))
        # As SGLang: buffered after the send, so a replay never runs ahead of the live stream.
        buffer = self._buffer
        buffer.append((seq, payload))
        self._buffered_bytes += len(payload)
        while len(buffer) > self.buffer_steps or (
            self._buffered_bytes > self.buffer_bytes and len(buffer) > 1
        ):
            self._buffered_bytes -= len(buffer.popleft()[1])

    def replay_buffer(self) -> tuple[int, int]:
        """(batches, payload bytes) held for replay now (a snapshot from any thread)."""
        return len(self._buffer), self._buffered_bytes

    def _sockets(self) -> list[zmq.Socket[bytes]]:
        return [] if self._replay is None else [self._replay]

    def _on_readable(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._serve_replay(sock, frames)

    def _serve_replay(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        # [identity, b"", start_seq]; anything else is ignored without a reply, as SGLang does.
        if len(frames) != 3:
            log.warning("invalid replay request", frames=len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                sock.send_multipart((client, b"", self.topic, seq_bytes(seq), payload))
        sock.send_multipart((client, b"", b"", END_SEQ, b""))
