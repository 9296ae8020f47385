"""Ingestion of the engines' ZMQ streams: KV events into the directory, pass metrics to a callback.

`EventIngestor` subscribes to each engine's KV-event stream (SGLang 0.5.23's `ZmqEventPublisher`
protocol, see `engines/events.py`) and applies every batch to the shared `KvDirectory` in `seq`
order. The stream is lossy (PUB drops at its high-water mark, a subscriber that joins late or
reconnects misses messages, decode engines batch 40 steps per message), so per engine it tracks
the next `seq` it expects and:

- **gap** (a later `seq` arrives): holds live batches back, asks the engine's replay endpoint for
  everything from the first missing `seq`, and applies the merged run in order;
- **gap beyond the replay buffer** (the replay starts after the missing `seq`, times out, or there
  is no replay endpoint): the node's holdings can no longer be known, so it is cleared
  (`KvDirectory.clear(node)`) and re-learned from whatever the buffer still has and later events;
- **restart** (an earlier `seq` that is not a repeat of one already applied): the engine started
  over, with an empty cache; the node is cleared and re-learned from a replay from `seq` 0;
- **cold start** (`add_engine`): a replay from 0, so a router that starts after its engines learns
  their caches (SGLang emits `AllBlocksCleared` as `seq` 0, so a full buffer is a full history);
- **corrupt bytes** (`EventDecodeError`): counted, logged, skipped; the `seq` still counts;
- **a batch the directory rejects** (say, a parent lost in a cleared gap): counted, and its events
  are applied one by one so the valid ones are kept.

One background thread polls every socket, so the router's asyncio loop never blocks on ZMQ and
`apply_events` (which releases the GIL) runs beside it. Replays are non-blocking: a slow engine
stalls only its own stream. `SampleIngestor` does the same for forward-pass metrics, delivering
each parsed `Sample` to a callback *on the ingestion thread* (an asyncio consumer hands it over
with `loop.call_soon_threadsafe`). Counters are plain dataclass snapshots, for Prometheus.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Final, Literal, Self

import msgpack
import structlog
import zmq

from evolving_infra import EventDecodeError, KvDirectory, KvDirectoryError
from evolving_infra.engines.events import END_SEQ, seq_bytes
from evolving_infra.engines.samples import decode_message
from evolving_infra.timing.samples import Sample, TimingError, from_forward_pass_metrics

log = structlog.get_logger(__name__)

Socket = zmq.Socket[bytes]
RECENT_SEQS: Final = 4096  # seqs remembered to tell a repeated batch from a restarted engine
FAIR_SHARE: Final = 256  # messages read from one socket before the others get a turn


@dataclass(slots=True)
class EventCounters:
    """KV-event ingestion figures (per engine, or summed), for Prometheus counters."""

    batches: int = 0  # batches applied whole
    events_applied: int = 0
    gaps: int = 0  # gaps in seq seen on the live stream
    gaps_repaired: int = 0  # gaps closed from the replay buffer
    nodes_cleared: int = 0  # holdings dropped because the history had a hole
    restarts: int = 0  # seq went back: the engine started over
    corrupt_batches: int = 0  # undecodable bytes or malformed frames
    rejected_batches: int = 0  # decodable, but inconsistent with the directory
    events_rejected: int = 0  # events of rejected batches that still could not apply
    duplicates: int = 0  # batches received twice (replay and live overlap)
    replays: int = 0  # replay requests sent
    replay_failures: int = 0  # replays that timed out or answered garbage

    def add(self, other: EventCounters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(slots=True)
class SampleCounters:
    """Forward-pass-metrics ingestion figures."""

    messages: int = 0
    samples: int = 0  # delivered to the callback
    heartbeats: int = 0
    mixed: int = 0  # prefill + decode in one pass: fits neither model form, dropped
    malformed: int = 0
    lost: int = 0  # messages missing from the seq (no replay for this stream)
    callback_errors: int = 0

    def add(self, other: SampleCounters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class _PollThread:
    """One thread that owns a set of ZMQ sockets; other threads talk to it through a queue.

    ZMQ sockets must stay on the thread that uses them, so `add`/`remove` calls are queued and a
    self-pipe in the poller wakes the thread at once (no polling timeout while idle).
    """

    def __init__(self, name: str, context: zmq.Context[Socket] | None) -> None:
        self._ctx = context or zmq.Context.instance()
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        self._poller = zmq.Poller()
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._handlers: dict[Socket, Callable[[Socket], None]] = {}
        self._lock = threading.Lock()  # guards what snapshot() and state() read
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = False
        self._thread.start()

    def _call(self, command: Callable[[], None]) -> None:
        if self._stopped:
            raise RuntimeError("ingestor is closed")
        self._commands.put(command)
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def close(self, timeout: float = 2.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._commands.put(None)
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")
        self._thread.join(timeout)
        # The pipe is closed here, not by the thread: a writer must never hit a reused fd.
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _watch(self, sock: Socket, handler: Callable[[Socket], None]) -> None:
        self._handlers[sock] = handler
        self._poller.register(sock, zmq.POLLIN)

    def _unwatch(self, sock: Socket) -> None:
        if self._handlers.pop(sock, None) is not None:
            self._poller.unregister(sock)
        sock.close(linger=0)

    def _deadline(self) -> float | None:
        """The next time `_tick` must run (monotonic), if any."""
        return None

    def _tick(self) -> None:
        """Timers (replay time-outs)."""

    def _shutdown(self) -> None:
        """Closes every socket (on the thread; subclasses own the sockets)."""

    def _run(self) -> None:
        try:
            while True:
                deadline = self._deadline()
                wait = (
                    None
                    if deadline is None
                    else max(0, int((deadline - time.monotonic()) * 1e3) + 1)
                )
                ready = dict(self._poller.poll(wait))
                if self._wake_r in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    while True:
                        try:
                            command = self._commands.get_nowait()
                        except queue.Empty:
                            break
                        if command is None:
                            return
                        command()
                for sock, handler in list(self._handlers.items()):
                    if sock in ready and sock in self._handlers:
                        handler(sock)
                self._tick()
        except Exception:
            # The router must learn that its view of the caches stopped updating.
            log.exception("ingestion thread died", thread=self._thread.name)
            raise
        finally:
            self._shutdown()


def _recv_some(sock: Socket) -> Iterable[list[bytes]]:
    """Up to FAIR_SHARE waiting messages, without blocking."""
    for _ in range(FAIR_SHARE):
        try:
            yield sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return


# ------------------------------------------------------------------------------------------------
# KV events


@dataclass(frozen=True, slots=True)
class EngineState:
    """Where ingestion stands for one engine."""

    next_seq: int  # the seq expected next; everything before it has been handled
    replaying: bool  # a replay is in flight (live batches are held back)


ReplayReason = Literal["cold start", "gap", "restart"]


@dataclass(eq=False, slots=True)
class _Replay:
    sock: Socket
    start: int
    deadline: float
    reason: ReplayReason
    got: dict[int, bytes] = field(default_factory=dict)
    failed: bool = False


@dataclass(eq=False, slots=True)
class _Engine:
    node: int
    endpoint: str
    replay_endpoint: str | None
    topic: bytes
    sub: Socket
    next_seq: int = 0
    recent: dict[int, int] = field(default_factory=dict)  # seq -> hash(payload)
    replay: _Replay | None = None
    held: dict[int, bytes] = field(default_factory=dict)  # live batches held during a replay
    counters: EventCounters = field(default_factory=EventCounters)


class EventIngestor(_PollThread):
    """Applies the KV events of many engines to one `KvDirectory` (see the module docstring)."""

    def __init__(
        self,
        directory: KvDirectory,
        *,
        replay_timeout: float = 2.0,
        hwm: int = 100_000,
        context: zmq.Context[Socket] | None = None,
    ) -> None:
        self.directory = directory
        self.replay_timeout = replay_timeout
        self.hwm = hwm
        self._engines: dict[int, _Engine] = {}
        self._retired = EventCounters()  # counts of removed engines stay in the totals
        super().__init__("kv-event-ingest", context)

    # -- caller side --------------------------------------------------------------------------

    def add_engine(
        self, node: int, endpoint: str, replay_endpoint: str | None = None, *, topic: str = ""
    ) -> None:
        """Subscribes to `node`'s stream (replacing any previous one) and syncs from a replay."""
        self._call(lambda: self._add(node, endpoint, replay_endpoint, topic.encode()))

    def remove_engine(self, node: int) -> None:
        """Unsubscribes; what the directory holds for the node is left to the caller."""
        self._call(lambda: self._remove(node))

    def snapshot(self, node: int | None = None) -> EventCounters:
        """Counters of one engine, or summed over every engine ever added."""
        with self._lock:
            if node is not None:
                return copy.copy(self._engines[node].counters)
            total = copy.copy(self._retired)
            for e in self._engines.values():
                total.add(e.counters)
            return total

    def state(self, node: int) -> EngineState | None:
        with self._lock:
            e = self._engines.get(node)
            return None if e is None else EngineState(e.next_seq, e.replay is not None)

    # -- thread side --------------------------------------------------------------------------

    def _add(self, node: int, endpoint: str, replay_endpoint: str | None, topic: bytes) -> None:
        self._remove(node)
        sub = self._ctx.socket(zmq.SUB)
        sub.set_hwm(self.hwm)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.connect(endpoint)
        e = _Engine(node, endpoint, replay_endpoint, topic, sub)
        self._watch(sub, lambda s: self._on_live(e, s))
        log.info("kv events: subscribed", node=node, endpoint=endpoint, replay=replay_endpoint)
        # The replay is in flight before `state()` can see the engine: "synced" means synced.
        self._start_replay(e, 0, "cold start")
        with self._lock:
            self._engines[node] = e

    def _remove(self, node: int) -> None:
        with self._lock:
            e = self._engines.pop(node, None)
            if e is not None:
                self._retired.add(e.counters)
        if e is not None:
            self._unwatch(e.sub)
            if e.replay is not None:
                self._unwatch(e.replay.sock)

    def _shutdown(self) -> None:
        for node in list(self._engines):
            self._remove(node)

    def _on_live(self, e: _Engine, sock: Socket) -> None:
        for frames in _recv_some(sock):
            # [topic, seq (8 bytes BE), payload]; SUB matches topic prefixes, we want it exact.
            if len(frames) != 3 or len(frames[1]) != 8 or frames[0] != e.topic:
                self._count(e, corrupt_batches=1)
                log.warning("kv events: malformed message", node=e.node, frames=len(frames))
                continue
            seq, payload = int.from_bytes(frames[1], "big"), frames[2]
            if e.replay is not None:
                e.held[seq] = payload
            else:
                self._receive(e, seq, payload)

    def _receive(self, e: _Engine, seq: int, payload: bytes) -> None:
        if seq == e.next_seq:
            self._apply(e, seq, payload)
        elif seq > e.next_seq:
            self._count(e, gaps=1)
            log.warning("kv events: gap", node=e.node, missing_from=e.next_seq, received=seq)
            e.held[seq] = payload
            self._start_replay(e, e.next_seq, "gap")
        elif e.recent.get(seq) == hash(payload):
            self._count(e, duplicates=1)
        else:
            self._count(e, restarts=1, nodes_cleared=1)
            log.warning("kv events: engine restarted, node cleared", node=e.node, seq=seq)
            self.directory.clear(e.node)
            e.recent.clear()
            e.next_seq = 0
            if seq == 0:
                self._apply(e, seq, payload)
            else:
                e.held[seq] = payload
                self._start_replay(e, 0, "restart")

    def _start_replay(self, e: _Engine, start: int, reason: ReplayReason) -> None:
        if e.replay_endpoint is None:
            self._finish_replay(e, start, reason, {}, failed=False)
            return
        # A fresh DEALER per request: a reply that comes late to a closed socket is dropped by
        # ZMQ, never mistaken for the answer to a later request (SGLang's replies carry no id).
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(e.replay_endpoint)
        sock.send_multipart((b"", seq_bytes(start)))
        e.replay = _Replay(sock, start, time.monotonic() + self.replay_timeout, reason)
        self._count(e, replays=1)
        self._watch(sock, lambda s: self._on_replay(e, s))

    def _on_replay(self, e: _Engine, sock: Socket) -> None:
        r = e.replay
        assert r is not None
        assert r.sock is sock
        for frames in _recv_some(sock):
            # [b"", topic, seq, payload] per batch, then [b"", b"", END_SEQ, b""].
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != 8:
                log.warning("kv events: malformed replay message", node=e.node)
                r.failed = True
            elif frames[2] != END_SEQ:
                r.got[int.from_bytes(frames[2], "big")] = frames[3]
                continue
            self._end_replay(e, r)
            return

    def _deadline(self) -> float | None:
        deadlines = [e.replay.deadline for e in self._engines.values() if e.replay is not None]
        return min(deadlines, default=None)

    def _tick(self) -> None:
        now = time.monotonic()
        for e in list(self._engines.values()):
            if e.replay is not None and e.replay.deadline <= now:
                log.warning("kv events: replay timed out", node=e.node, endpoint=e.replay_endpoint)
                e.replay.failed = True
                self._end_replay(e, e.replay)

    def _end_replay(self, e: _Engine, r: _Replay) -> None:
        self._unwatch(r.sock)
        e.replay = None
        if r.failed:
            self._count(e, replay_failures=1)
        self._finish_replay(e, r.start, r.reason, r.got, failed=r.failed)

    def _finish_replay(
        self, e: _Engine, start: int, reason: ReplayReason, got: dict[int, bytes], *, failed: bool
    ) -> None:
        """Applies the replayed and held batches in seq order; a hole clears the node."""
        batches = {**got, **e.held}
        e.held = {}
        holes = 0
        for seq in sorted(batches):
            if seq < e.next_seq:
                continue  # replay and live overlap, or an old batch: already applied
            if seq > e.next_seq:
                holes += 1
                self._count(e, nodes_cleared=1)
                log.warning("kv events: history lost, node cleared and re-learned", node=e.node,
                            missing_from=e.next_seq, resumes_at=seq, during=reason,
                            replay_failed=failed)  # fmt: skip
                self.directory.clear(e.node)
            self._apply(e, seq, batches[seq])
        if reason == "gap" and not holes:
            self._count(e, gaps_repaired=1)
            log.info("kv events: gap repaired from replay", node=e.node, start=start,
                     batches=len(batches))  # fmt: skip

    def _apply(self, e: _Engine, seq: int, payload: bytes) -> None:
        try:
            n = self.directory.apply_events(e.node, payload)
        except EventDecodeError as err:
            self._count(e, corrupt_batches=1)
            log.warning("kv events: corrupt batch skipped", node=e.node, seq=seq,
                        offset=err.offset, error=str(err))  # fmt: skip
        except KvDirectoryError as err:
            applied, rejected = self._salvage(e.node, payload)
            self._count(e, rejected_batches=1, events_applied=applied, events_rejected=rejected)
            log.warning("kv events: batch inconsistent with the directory, applied event by event",
                        node=e.node, seq=seq, applied=applied, rejected=rejected,
                        error=repr(err))  # fmt: skip
        else:
            self._count(e, batches=1, events_applied=n)
        with self._lock:
            e.next_seq = seq + 1
        e.recent[seq] = hash(payload)
        if len(e.recent) > RECENT_SEQS:
            # Seqs are applied in increasing order (`recent` is emptied when they go back), so
            # the first key is the oldest; popping `seq - RECENT_SEQS` alone kept, after every
            # jump over lost history, up to RECENT_SEQS stale ones for the process's life.
            del e.recent[next(iter(e.recent))]

    def _salvage(self, node: int, payload: bytes) -> tuple[int, int]:
        """Applies a rejected batch one event at a time; (events applied, events rejected).

        Only on this error path does Python re-read the msgpack: each event is re-encoded as a
        batch of one (an event's own bytes are unchanged), so the Rust decoder still does the
        interpretation and a batch's one bad event no longer costs the others.
        """
        try:
            ts, events, dp_rank = msgpack.unpackb(payload, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException):
            return 0, 1
        applied = rejected = 0
        for event in events:
            try:
                applied += self.directory.apply_events(node, msgpack.packb([ts, [event], dp_rank]))
            except KvDirectoryError:
                rejected += 1
        return applied, rejected

    def _count(self, e: _Engine, **increments: int) -> None:
        with self._lock:
            for name, n in increments.items():
                setattr(e.counters, name, getattr(e.counters, name) + n)


# ------------------------------------------------------------------------------------------------
# forward-pass metrics

SampleCallback = Callable[[int, Sample], None]


@dataclass(eq=False, slots=True)
class _SampleSource:
    node: int
    sub: Socket
    next_seq: int | None = None
    counters: SampleCounters = field(default_factory=SampleCounters)


class SampleIngestor(_PollThread):
    """Turns each engine's forward-pass metrics into `Sample`s for `on_sample(node, sample)`.

    The idle heartbeat and mixed prefill+decode passes are counted, not delivered. There is no
    replay for this stream: a lost message is a lost sample, counted from the `seq` gap.
    """

    def __init__(
        self, on_sample: SampleCallback, *, context: zmq.Context[Socket] | None = None
    ) -> None:
        self.on_sample = on_sample
        self._sources: dict[int, _SampleSource] = {}
        self._retired = SampleCounters()
        super().__init__("fpm-ingest", context)

    def add_engine(self, node: int, endpoint: str) -> None:
        """Subscribes to the stream at `endpoint` (SGLang: `{ipc_name}.{dp_rank}`)."""
        self._call(lambda: self._add(node, endpoint))

    def remove_engine(self, node: int) -> None:
        self._call(lambda: self._remove(node))

    def snapshot(self, node: int | None = None) -> SampleCounters:
        with self._lock:
            if node is not None:
                return copy.copy(self._sources[node].counters)
            total = copy.copy(self._retired)
            for s in self._sources.values():
                total.add(s.counters)
            return total

    def _add(self, node: int, endpoint: str) -> None:
        self._remove(node)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        source = _SampleSource(node, sub)
        with self._lock:
            self._sources[node] = source
        self._watch(sub, lambda s: self._on_message(source, s))

    def _remove(self, node: int) -> None:
        with self._lock:
            source = self._sources.pop(node, None)
            if source is not None:
                self._retired.add(source.counters)
        if source is not None:
            self._unwatch(source.sub)

    def _shutdown(self) -> None:
        for node in list(self._sources):
            self._remove(node)

    def _on_message(self, source: _SampleSource, sock: Socket) -> None:
        for frames in _recv_some(sock):
            sample = self._parse(source, frames)
            if sample is None:
                continue
            try:
                self.on_sample(source.node, sample)
            except Exception:
                # A consumer's bug must not stop ingestion for every engine.
                self._bump(source, callback_errors=1)
                log.exception("forward-pass metrics: callback failed", node=source.node)

    def _parse(self, source: _SampleSource, frames: list[bytes]) -> Sample | None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._bump(source, malformed=1)
            return None
        seq = int.from_bytes(frames[1], "big")
        lost = 0 if source.next_seq is None or seq < source.next_seq else seq - source.next_seq
        source.next_seq = seq + 1
        try:
            sample = from_forward_pass_metrics(decode_message(frames[2]))
        except (ValueError, TypeError, TimingError, msgpack.UnpackException) as err:
            self._bump(source, messages=1, lost=lost, malformed=1)
            log.warning("forward-pass metrics: bad message", node=source.node, error=repr(err))
            return None
        if sample is None:
            idle = _is_heartbeat(frames[2])
            self._bump(source, messages=1, lost=lost, heartbeats=int(idle), mixed=int(not idle))
            return None
        self._bump(source, messages=1, lost=lost, samples=1)
        return sample

    def _bump(self, source: _SampleSource, **increments: int) -> None:
        with self._lock:
            for name, n in increments.items():
                setattr(source.counters, name, getattr(source.counters, name) + n)


def _is_heartbeat(payload: bytes) -> bool:
    message: dict[str, Any] = decode_message(payload)
    sched = message.get("scheduled_requests") or {}
    return not sched.get("num_prefill_requests") and not sched.get("num_decode_requests")
