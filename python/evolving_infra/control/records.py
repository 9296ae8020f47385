"""The engine-control calls as plain Python records: what engines implement and clients get back.

Neither engine code nor client code sees protobuf: `convert.py` maps these to and from the
messages of `proto/evolving_infra/v1/engine.proto` (whose comments give each field's unit).
Request records validate themselves on construction and raise `InvalidRequestError`, so the
same rules hold for a client building a request and for a server decoding one off the wire.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from evolving_infra.control.errors import InvalidRequestError
from evolving_infra.timing.samples import Sample, from_forward_pass_metrics
from evolving_infra.types import Phase

Tier = Literal["L1", "L2", "pool"]  # "L1"/"L2" as in the KV directory; "pool": the shared L2 pool
HealthState = Literal["serving", "draining", "switching", "down"]

PHASES: tuple[Phase, ...] = ("prefill", "decode")
TIERS: tuple[Tier, ...] = ("L1", "L2", "pool")

# One request's block list: 2^18 pages is 4M tokens at SGLang's default page size of 16, far
# beyond any context, and keeps a message of sint64 hashes (<= 10 bytes each) under 3 MiB.
MAX_HASHES = 1 << 18
MAX_HINTS = 1 << 18
MAX_DRAIN_TIMEOUT_S = 24 * 3600.0
MAX_REQUEST_ID_CHARS = 512
_INT64 = (-(1 << 63), (1 << 63) - 1)
_UINT32_MAX = (1 << 32) - 1


def check_hashes(what: str, hashes: Sequence[int], *, allow_empty: bool = False) -> None:
    """Raise `InvalidRequestError` unless `hashes` is a usable block list: no repeats, in range."""
    if not hashes and not allow_empty:
        raise InvalidRequestError(f"{what}: no block hashes given")
    if len(hashes) > MAX_HASHES:
        raise InvalidRequestError(f"{what}: {len(hashes)} hashes, at most {MAX_HASHES} allowed")
    lo, hi = _INT64
    for h in hashes:
        if not lo <= h <= hi:
            raise InvalidRequestError(f"{what}: hash {h} is outside the signed 64-bit range")
    if len(set(hashes)) != len(hashes):
        raise InvalidRequestError(f"{what}: a block hash is repeated")


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """`GetInfo`: what a node is and where its other endpoints are."""

    node_id: int
    model: str
    backend: str  # "sim" or "sglang"
    phase: Phase
    page_size: int  # tokens per block
    l1_capacity_blocks: int
    l2_capacity_blocks: int
    l1_used_blocks: int = 0
    l2_used_blocks: int = 0
    http_url: str = ""
    kv_events_endpoint: str = ""
    kv_replay_endpoint: str = ""
    samples_endpoint: str = ""
    version: str = ""
    # Where a decode engine fetches this node's KV (SGLang's --disaggregation-bootstrap-port);
    # 0: the port of `http_url` (the simulated engine serves the hand-off on its HTTP port).
    bootstrap_port: int = 0


@dataclass(frozen=True, slots=True)
class SwitchRequest:
    """`SwitchPhase`: drain, switch in place to `target`, keep the KV unless `keep_kv` is False."""

    target: Phase
    drain_timeout_s: float = 0.0  # 0: the engine's default
    keep_kv: bool = True
    # The planner's leader lease epoch (0: a router without replicas): the server refuses one
    # below the highest it has seen (`StaleLeaderError`), before the engine sees the request.
    leader_epoch: int = 0

    def __post_init__(self) -> None:
        if self.target not in PHASES:
            raise InvalidRequestError(f"SwitchPhase: unknown phase {self.target!r}")
        if not 0 <= self.leader_epoch < 2**64:
            raise InvalidRequestError(
                f"SwitchPhase: leader_epoch must be in [0, 2^64), got {self.leader_epoch}"
            )
        t = self.drain_timeout_s
        if not math.isfinite(t) or not 0 <= t <= MAX_DRAIN_TIMEOUT_S:
            raise InvalidRequestError(
                f"SwitchPhase: drain_timeout_s must be in [0, {MAX_DRAIN_TIMEOUT_S:g}], got {t}"
            )


@dataclass(frozen=True, slots=True)
class SwitchResult:
    """How the switch went: the phases, and seconds spent draining, switching and in total."""

    phase: Phase
    previous_phase: Phase
    drain_s: float
    switch_s: float
    total_s: float
    l1_blocks_kept: int
    l2_blocks_kept: int


@dataclass(frozen=True, slots=True)
class KvLocation:
    """One end of a KV transfer: tier L1/L2 of a node, or the shared pool (no node)."""

    tier: Tier
    node_id: int | None = None
    address: str = ""  # the node's (or pool's) transfer address; "": the engine looks it up

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise InvalidRequestError(f"KvLocation: unknown tier {self.tier!r}")
        if self.tier == "pool" and self.node_id is not None:
            raise InvalidRequestError("KvLocation: the pool has no node_id")
        if self.tier != "pool" and self.node_id is None:
            raise InvalidRequestError(f"KvLocation: tier {self.tier} needs a node_id")
        if self.node_id is not None and not 0 <= self.node_id <= _UINT32_MAX:
            raise InvalidRequestError(f"KvLocation: node_id must be >= 0, got {self.node_id}")

    @classmethod
    def node(cls, node_id: int, tier: Literal["L1", "L2"] = "L1", address: str = "") -> KvLocation:
        return cls(tier, node_id, address)

    @classmethod
    def pool(cls, address: str = "") -> KvLocation:
        return cls("pool", None, address)


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """`TransferKV`: copy the chain `hashes` from `source` to `destination`."""

    source: KvLocation
    destination: KvLocation
    hashes: tuple[int, ...]
    allow_partial: bool = False
    # Answer once the pull has begun (the proto's comment); the destination's prefills wait.
    answer_when_started: bool = False

    def __post_init__(self) -> None:
        check_hashes("TransferKV", self.hashes)
        if self.source == self.destination:
            raise InvalidRequestError("TransferKV: source and destination are the same")
        if self.source.tier == "pool" and self.destination.tier == "pool":
            raise InvalidRequestError("TransferKV: pool to pool moves nothing")


@dataclass(frozen=True, slots=True)
class TransferResult:
    blocks_moved: int
    bytes: int
    seconds: float
    missing_hashes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PrefetchRequest:
    """`Prefetch`: load a queued request's blocks into L1 from this node's L2 or the pool."""

    request_id: str
    hashes: tuple[int, ...]
    source: Literal["L2", "pool"] = "L2"
    wait: bool = False
    allow_partial: bool = False

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(
                f"Prefetch: request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters"
            )
        if self.source not in ("L2", "pool"):
            raise InvalidRequestError(f"Prefetch: source must be L2 or pool, got {self.source!r}")
        check_hashes("Prefetch", self.hashes)


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    blocks_started: int
    blocks_ready: int
    seconds: float
    missing_hashes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class EvictionHints:
    """`SetEvictionHints`: (hash, priority) pairs; higher priority is kept longer."""

    hints: tuple[tuple[int, int], ...]
    replace: bool = False  # True: forget earlier hints (unlisted blocks go back to 0)

    def __post_init__(self) -> None:
        if not self.hints and not self.replace:
            raise InvalidRequestError("SetEvictionHints: no hints given (empty needs replace)")
        if len(self.hints) > MAX_HINTS:
            raise InvalidRequestError(
                f"SetEvictionHints: {len(self.hints)} hints, at most {MAX_HINTS} allowed"
            )
        check_hashes("SetEvictionHints", [h for h, _ in self.hints], allow_empty=True)
        for h, priority in self.hints:
            if not 0 <= priority <= _UINT32_MAX:
                raise InvalidRequestError(
                    f"SetEvictionHints: priority of block {h} must be >= 0, got {priority}"
                )


@dataclass(frozen=True, slots=True)
class HintsResult:
    applied: int  # hints recorded for blocks the node holds
    ignored: int  # hints for blocks it does not hold


@dataclass(frozen=True, slots=True)
class IterationSample:
    """One forward pass. A prefill pass gives `prefill` pairs (exact) or only the sums."""

    seq: int
    timestamp_s: float
    phase: Phase
    wall_s: float
    prefill: tuple[tuple[int, int], ...] = ()  # (uncached_tokens, cached_tokens) per request
    prefill_requests: int = 0
    prefill_uncached_tokens: int = 0
    prefill_uncached_var: float = 0.0
    prefill_cached_tokens: int = 0
    decode_batch_size: int = 0
    decode_context_tokens: int = 0

    @classmethod
    def from_sample(cls, sample: Sample, *, seq: int, timestamp_s: float) -> IterationSample:
        """The message for one `Sample` of a node in phase `sample.phase` (sums filled in too)."""
        if sample.phase == "decode":
            return cls(
                seq,
                timestamp_s,
                "decode",
                sample.seconds,
                decode_batch_size=sample.batch_size,
                decode_context_tokens=sample.context_tokens,
            )
        uncached = [u for u, _ in sample.batch]
        n = len(uncached)
        mean = sum(uncached) / n if n else 0.0
        return cls(
            seq,
            timestamp_s,
            "prefill",
            sample.seconds,
            prefill=sample.batch,
            prefill_requests=n,
            prefill_uncached_tokens=sum(uncached),
            prefill_uncached_var=sum((u - mean) ** 2 for u in uncached) / n if n else 0.0,
            prefill_cached_tokens=sum(c for _, c in sample.batch),
        )

    def to_sample(self) -> Sample | None:
        """The iteration-time model's sample; None for an idle or mixed prefill+decode pass.

        Without per-request pairs, the prefill batch is rebuilt from the sums exactly as for
        SGLang's forward-pass metrics (`timing.samples.from_forward_pass_metrics`). Raises
        `timing.BadSampleError` for a pass that cannot be real (time <= 0).
        """
        if self.prefill:
            if self.decode_batch_size:
                return None
            return Sample("prefill", self.wall_s, batch=self.prefill)
        metrics = {
            "version": 1,
            "wall_time": self.wall_s,
            "scheduled_requests": {
                "num_prefill_requests": self.prefill_requests,
                "sum_prefill_tokens": self.prefill_uncached_tokens,
                "var_prefill_length": self.prefill_uncached_var,
                "sum_prefill_kv_tokens": self.prefill_cached_tokens,
                "num_decode_requests": self.decode_batch_size,
                "sum_decode_kv_tokens": self.decode_context_tokens,
            },
        }
        return from_forward_pass_metrics(metrics)


@dataclass(frozen=True, slots=True)
class Health:
    """`Health`: only a "serving" node takes new requests; `reason` says why it does not."""

    state: HealthState
    phase: Phase
    reason: str = ""
