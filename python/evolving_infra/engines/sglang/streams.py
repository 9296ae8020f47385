"""The sidecar's ZMQ ends: eviction hints out, KV events and forward-pass metrics in.

- `HintsPusher`: eviction hints to the patched scheduler (PUSH; the scheduler binds a PULL at
  `EVOLVING_INFRA_HINTS_ENDPOINT`). Wire contract, one msgpack map per `SetEvictionHints` call:
  `{"v": 1, "hashes": [int64, ...], "counts": [int, ...], "replace": bool}`; `counts[i] > 0`
  means live agent branches need block `hashes[i]` (the router sends their number, `R_b`).
- `KvOccupancy`: blocks held on GPU (L1) and in host memory (L2), counted from SGLang's own KV
  events. `/v1/loads` cannot say this: its `num_used_tokens` leaves out the evictable cached
  pages, which are exactly the KV a phase switch is meant to keep.
- `FpmFanout`: one SUB on SGLang's forward-pass metrics, handing `IterationSample`s to every
  `StreamIterationSamples` subscriber and republishing the frames unchanged on a TCP PUB, so a
  router on another host can subscribe (SGLang binds the stream on an `ipc://` path only: it
  appends `.{dp_rank}` to the endpoint, which a `tcp://` address cannot take).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import msgpack
import structlog
import zmq
import zmq.asyncio

from evolving_infra.control.errors import EngineUnavailableError
from evolving_infra.control.records import EvictionHints, IterationSample
from evolving_infra.engines.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventFormatError,
    Medium,
    decode_batch,
)
from evolving_infra.engines.samples import decode_message
from evolving_infra.types import Phase

log = structlog.get_logger("evolving_infra.engines.sglang")

HINTS_ENDPOINT_ENV = "EVOLVING_INFRA_HINTS_ENDPOINT"  # where the patched scheduler's PULL binds
HINTS_VERSION = 1
# A hint message replaces the previous one every few seconds: a short queue bounds how stale
# the hints a restarted scheduler receives can be.
HINTS_HWM = 16
POLL_MS = 100  # how often the receive loops look at their stop flag
SUBSCRIBER_QUEUE = 4096  # samples kept for a slow StreamIterationSamples subscriber


class HintsDroppedError(EngineUnavailableError):
    """The scheduler's hint receiver is not taking messages (not bound yet, or HWM reached)."""


def encode_hints(hints: EvictionHints) -> bytes:
    """The wire map of one call (module docstring)."""
    payload = msgpack.packb(
        {
            "v": HINTS_VERSION,
            "hashes": [h for h, _ in hints.hints],
            "counts": [c for _, c in hints.hints],
            "replace": hints.replace,
        }
    )
    assert isinstance(payload, bytes)
    return payload


class HintsPusher:
    """Non-blocking PUSH of hint maps; a message that cannot be queued is dropped, not waited for.

    `IMMEDIATE` queues only on a connected receiver, so a scheduler that has not bound its PULL
    yet shows up as a dropped send instead of hints piling up for it.
    """

    def __init__(self, endpoint: str, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.endpoint = endpoint
        self._sock: zmq.Socket[bytes] = context.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, HINTS_HWM)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)

    def send(self, hints: EvictionHints) -> None:
        try:
            self._sock.send(encode_hints(hints), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("hints_dropped", endpoint=self.endpoint, hints=len(hints.hints))
            raise HintsDroppedError(
                f"eviction hints dropped: the scheduler at {self.endpoint} is not taking them"
                " (not listening yet, or behind)"
            ) from None

    def close(self) -> None:
        self._sock.close(linger=0)


class KvOccupancy:
    """Blocks per tier from SGLang's KV events: GPU → L1; CPU_PINNED (or "CPU") → L2.

    NOTE: counts start when the sidecar subscribes. SGLang sends `AllBlocksCleared` at start-up,
    so a sidecar started with its engine counts from empty; one attached to a running engine
    undercounts until the cache turns over. A `seq` gap (dropped batch) is counted in `gaps`.
    """

    def __init__(self) -> None:
        self.gpu: set[int] = set()
        self.host: set[int] = set()
        self.batches = 0
        self.gaps = 0
        self._next_seq: int | None = None

    @property
    def l1(self) -> int:
        return len(self.gpu)

    @property
    def l2(self) -> int:
        return len(self.host)

    def apply(self, seq: int, payload: bytes) -> None:
        """One batch; raises `EventFormatError` for bytes that are not a 0.5.23 batch."""
        if self._next_seq is not None and seq != self._next_seq:
            self.gaps += 1
        self._next_seq = seq + 1
        self.batches += 1
        for event in decode_batch(payload).events:
            if isinstance(event, AllBlocksCleared):
                self.gpu.clear()
                self.host.clear()
                continue
            tier = self._tier(event.medium)
            if tier is None:
                continue
            if isinstance(event, BlockStored):
                tier.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                tier.difference_update(event.block_hashes)

    def _tier(self, medium: str | None) -> set[int] | None:
        if medium is None or medium == Medium.GPU:  # no medium: GPU, as SGLang's recorder means
            return self.gpu
        if medium in (Medium.CPU, "CPU"):
            return self.host
        return None  # DISK / EXTERNAL: no tier of ours


async def _frames(sock: zmq.asyncio.Socket, stop: asyncio.Event) -> AsyncIterator[list[bytes]]:
    """Multipart messages from `sock` until `stop` is set (checked every `POLL_MS`)."""
    while not stop.is_set():
        if await sock.poll(POLL_MS):  # POLLIN
            yield await sock.recv_multipart()


async def follow_kv_events(
    context: zmq.asyncio.Context, endpoint: str, occupancy: KvOccupancy, stop: asyncio.Event
) -> None:
    """Feeds `occupancy` from SGLang's KV-event PUB at `endpoint` until `stop`."""
    sock = context.socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        async for frames in _frames(sock, stop):
            if len(frames) != 3:
                log.warning("kv_event_malformed", endpoint=endpoint, frames=len(frames))
                continue
            try:
                occupancy.apply(int.from_bytes(frames[1], "big"), frames[2])
            except EventFormatError as e:
                log.warning("kv_event_malformed", endpoint=endpoint, error=str(e))
    finally:
        sock.close(linger=0)


def sample_from_fpm(
    seq: int, message: Mapping[str, Any], phase: Phase, timestamp_s: float
) -> IterationSample | None:
    """The control record of one forward-pass-metrics map; None for the idle heartbeat.

    NOTE: SGLang's `var_prefill_length` is the variance of whole prompt lengths; it travels as
    `prefill_uncached_var` unchanged, as `IterationSample.to_sample` reads it back (the same
    reading `timing.samples.from_forward_pass_metrics` applies to the raw stream).
    """
    wall = float(message["wall_time"])
    if not wall > 0:
        return None
    s = message["scheduled_requests"]
    return IterationSample(
        seq=seq,
        timestamp_s=timestamp_s,
        phase=phase,
        wall_s=wall,
        prefill_requests=int(s["num_prefill_requests"]),
        prefill_uncached_tokens=int(s["sum_prefill_tokens"]),
        prefill_uncached_var=float(s["var_prefill_length"]),
        prefill_cached_tokens=int(s["sum_prefill_kv_tokens"]),
        decode_batch_size=int(s["num_decode_requests"]),
        decode_context_tokens=int(s["sum_decode_kv_tokens"]),
    )


class FpmFanout:
    """One subscription to SGLang's forward-pass metrics, shared by every consumer."""

    def __init__(self, phase: Callable[[], Phase]) -> None:
        self._phase = phase
        self._queues: set[asyncio.Queue[IterationSample | None]] = set()
        self.received = 0
        self.malformed = 0

    def subscribe(self) -> asyncio.Queue[IterationSample | None]:
        q: asyncio.Queue[IterationSample | None] = asyncio.Queue(maxsize=SUBSCRIBER_QUEUE)
        self._queues.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[IterationSample | None]) -> None:
        self._queues.discard(q)

    def end(self) -> None:
        """Ends every subscriber's stream (the sidecar is closing)."""
        for q in self._queues:
            if q.full():  # make room for the end marker: a lagging reader must still stop
                q.get_nowait()
            q.put_nowait(None)
        self._queues.clear()

    def _deliver(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.malformed += 1
            return
        try:
            seq = int.from_bytes(frames[1], "big")
            sample = sample_from_fpm(seq, decode_message(frames[2]), self._phase(), time.time())
        except (KeyError, TypeError, ValueError) as e:
            self.malformed += 1
            log.warning("fpm_malformed", error=repr(e))
            return
        self.received += 1
        if sample is None:
            return
        for q in self._queues:
            if not q.full():  # a slow subscriber loses samples (its seq shows the gap)
                q.put_nowait(sample)

    async def run(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        relay: zmq.Socket[bytes] | None,
        stop: asyncio.Event,
    ) -> None:
        """Reads SGLang's stream at `endpoint` until `stop`; frames also go out on `relay` (a
        plain PUB: it never blocks, it drops at its high-water mark as SGLang's does)."""
        sock = context.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(endpoint)
            async for frames in _frames(sock, stop):
                if relay is not None:
                    with contextlib.suppress(zmq.Again):
                        relay.send_multipart(frames, flags=zmq.NOBLOCK)
                self._deliver(frames)
        finally:
            sock.close(linger=0)
