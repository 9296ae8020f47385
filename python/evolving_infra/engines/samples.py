"""SGLang 0.5.23 forward-pass metrics (`--enable-forward-pass-metrics`), publishing end.

One message per forward pass, so the router can fit its iteration-time model from the engine's
own GPU times (DESIGN §3). As SGLang does (`sglang/srt/observability/forward_pass_metrics.py`,
`_FpmPublisherThread`; endpoint chosen in `scheduler_components/metrics_reporter.py::_init_fpm`):

- a ZMQ PUB *bound* at `{forward_pass_metrics_ipc_name}.{dp_rank}` (default an `ipc://` temp file);
- multipart `[b"", seq as 8-byte big-endian, payload]`; `seq` counts from 0 and is also written
  into the message as `counter_id`;
- payload: msgspec msgpack of `ForwardPassMetrics`, a plain (untagged) *map* whose keys come in
  declaration order, every field present: `version` (1), `worker_id`, `dp_rank`, `counter_id`,
  `wall_time` (seconds of GPU time, from CUDA events), `scheduled_requests` and `queued_requests`
  (maps, below); the class docstring says "positional" but the struct is not `array_like`;
- an all-zero heartbeat (`wall_time` 0.0) about once a second while the scheduler is idle.

Subscribers turn messages into `timing.samples.Sample`s with `from_forward_pass_metrics`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Final

import msgpack
import zmq

from evolving_infra.engines.events import PublisherThread, seq_bytes
from evolving_infra.timing.samples import Sample

FPM_VERSION: Final = 1
HEARTBEAT_INTERVAL: Final = 1.0  # seconds, as `_FpmPublisherThread.HEARTBEAT_INTERVAL`


def _variance(values: Sequence[int]) -> float:
    """Population variance, as SGLang's `WelfordAccumulator.variance()` (0.0 for no values)."""
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values)


@dataclass(frozen=True, slots=True)
class ScheduledRequestMetrics:
    """The requests one forward pass ran (SGLang's field order; floats stay floats on the wire)."""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0  # tokens computed this pass (SGLang's "#new-token")
    var_prefill_length: float = 0.0  # variance of the requests' *prompt* lengths
    sum_prefill_kv_tokens: int = 0  # cached prefix tokens read
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0

    @classmethod
    def prefill(cls, batch: Sequence[tuple[int, int]]) -> ScheduledRequestMetrics:
        """A prefill pass over `(uncached, cached)` requests, summarised as SGLang does.

        NOTE: SGLang's variance is over `len(req.origin_input_ids)`, the whole prompt
        (uncached + cached for an unchunked prefill), not over the tokens computed.
        """
        return cls(
            num_prefill_requests=len(batch),
            sum_prefill_tokens=sum(u for u, _ in batch),
            var_prefill_length=_variance([u + c for u, c in batch]),
            sum_prefill_kv_tokens=sum(c for _, c in batch),
        )

    @classmethod
    def decode(cls, context_tokens: Sequence[int]) -> ScheduledRequestMetrics:
        """A decode pass over requests with these KV lengths."""
        return cls(
            num_decode_requests=len(context_tokens),
            sum_decode_kv_tokens=sum(context_tokens),
            var_decode_kv_tokens=_variance(context_tokens),
        )


@dataclass(frozen=True, slots=True)
class QueuedRequestMetrics:
    """The requests waiting after the pass (no `sum_prefill_kv_tokens` here, as in SGLang)."""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class ForwardPassMetrics:
    """One message of the stream; the defaults are SGLang's idle heartbeat."""

    version: int = FPM_VERSION
    worker_id: str = ""
    dp_rank: int = 0
    counter_id: int = 0
    wall_time: float = 0.0
    scheduled_requests: ScheduledRequestMetrics = field(default_factory=ScheduledRequestMetrics)
    queued_requests: QueuedRequestMetrics = field(default_factory=QueuedRequestMetrics)

    @classmethod
    def from_sample(
        cls, sample: Sample, *, worker_id: str = "", dp_rank: int = 0
    ) -> ForwardPassMetrics:
        """The message an engine would send for this measured iteration (decode: one request
        holding the whole context, since a `Sample` keeps only the total)."""
        if sample.phase == "prefill":
            scheduled = ScheduledRequestMetrics.prefill(sample.batch)
        else:
            scheduled = ScheduledRequestMetrics(
                num_decode_requests=sample.batch_size, sum_decode_kv_tokens=sample.context_tokens
            )
        return cls(
            worker_id=worker_id, dp_rank=dp_rank, wall_time=sample.seconds,
            scheduled_requests=scheduled,
        )  # fmt: skip

    def to_wire(self) -> dict[str, Any]:
        message = asdict(self)
        # msgspec writes a `float` field as float64 even when integral: keep the types exact.
        message["wall_time"] = float(self.wall_time)
        for part in ("scheduled_requests", "queued_requests"):
            for key, value in message[part].items():
                if key.startswith("var_"):
                    message[part][key] = float(value)
        return message

    def encode(self) -> bytes:
        payload = msgpack.packb(self.to_wire())
        assert isinstance(payload, bytes)
        return payload


def decode_message(payload: bytes) -> dict[str, Any]:
    """The decoded map, the input of `timing.samples.from_forward_pass_metrics`."""
    message = msgpack.unpackb(payload)
    if not isinstance(message, dict):
        raise ValueError(f"forward-pass metrics must be a map, got {type(message).__name__}")
    return message


class ForwardPassMetricsPublisher(PublisherThread):
    """SGLang's `_FpmPublisherThread`, wire-compatible (see the module docstring).

    `publish` stamps `worker_id`, `dp_rank` and `counter_id` as SGLang does; `set_idle(True)`
    starts the heartbeat, sent once `HEARTBEAT_INTERVAL` has passed without a message.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        worker_id: str = "",
        dp_rank: int = 0,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        # SGLang always binds this socket: the engine is the stable end.
        super().__init__(endpoint, bind=True, context=context, name="fpm-publisher")
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.heartbeat_interval = heartbeat_interval
        self._counter = 0  # thread side only
        self._idle_on = False
        self._last_send = time.monotonic()
        self._start()

    def publish(self, metrics: ForwardPassMetrics) -> None:
        """Sends one message (SGLang drops it when the queue or the socket is full)."""
        self._enqueue(replace(metrics, worker_id=self.worker_id, dp_rank=self.dp_rank))

    def publish_sample(self, sample: Sample) -> None:
        self.publish(ForwardPassMetrics.from_sample(sample))

    def set_idle(self, idle: bool) -> None:
        """Whether the engine is idle, which permits heartbeats (SGLang's `set_idle`)."""
        self._idle_on = idle
        self._wake()

    def _handle(self, item: Any) -> None:
        assert isinstance(item, ForwardPassMetrics)
        seq = self._counter
        self._counter += 1
        payload = replace(item, counter_id=seq).encode()
        # As SGLang: a full socket drops the message; the seq gap shows it.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((b"", seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        self._last_send = time.monotonic()

    def _poll_timeout_ms(self) -> int | None:
        if not self._idle_on:
            return None
        due = self._last_send + self.heartbeat_interval - time.monotonic()
        return max(0, int(due * 1000) + 1)

    def _idle(self) -> None:
        if self._idle_on and time.monotonic() - self._last_send >= self.heartbeat_interval:
            self._handle(ForwardPassMetrics(worker_id=self.worker_id, dp_rank=self.dp_rank))
