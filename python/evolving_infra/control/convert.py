"""Protobuf messages <-> `records`: the only module that knows both.

Decoding an enum goes through `_enum`, which rejects 0 (UNSPECIFIED) and values this side does
not know (proto3 enums are open: a newer peer can send any int). Requests decode into records
whose constructors validate, so a bad request raises `InvalidRequestError` (INVALID_ARGUMENT on
the server); a bad response raises `BadResponseError` on the client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from evolving_infra.control.errors import BadResponseError, InvalidRequestError
from evolving_infra.control.records import (
    EngineInfo,
    EvictionHints,
    Health,
    HealthState,
    HintsResult,
    IterationSample,
    KvLocation,
    PrefetchRequest,
    PrefetchResult,
    SwitchRequest,
    SwitchResult,
    Tier,
    TransferRequest,
    TransferResult,
)
from evolving_infra.control.v1 import engine_pb2 as pb
from evolving_infra.types import Phase

_K = TypeVar("_K", bound=str)

PHASE_TO_PB: dict[Phase, pb.Phase.ValueType] = {
    "prefill": pb.PHASE_PREFILL,
    "decode": pb.PHASE_DECODE,
}
TIER_TO_PB: dict[Tier, pb.Tier.ValueType] = {
    "L1": pb.TIER_L1,
    "L2": pb.TIER_L2,
    "pool": pb.TIER_POOL,
}
HEALTH_TO_PB: dict[HealthState, pb.HealthState.ValueType] = {
    "serving": pb.HEALTH_STATE_SERVING,
    "draining": pb.HEALTH_STATE_DRAINING,
    "switching": pb.HEALTH_STATE_SWITCHING,
    "down": pb.HEALTH_STATE_DOWN,
}
_PHASE_FROM_PB: dict[int, Phase] = {int(v): k for k, v in PHASE_TO_PB.items()}
_TIER_FROM_PB: dict[int, Tier] = {int(v): k for k, v in TIER_TO_PB.items()}
_HEALTH_FROM_PB: dict[int, HealthState] = {int(v): k for k, v in HEALTH_TO_PB.items()}


def _enum(table: Mapping[int, _K], value: int, what: str, error: type[Exception]) -> _K:
    found = table.get(value)
    if found is None:
        known = ", ".join(f"{v} ({k})" for v, k in sorted(table.items()))
        raise error(f"unknown {what} {value} (expected one of {known})")
    return found


def _request_phase(value: int, what: str) -> Phase:
    return _enum(_PHASE_FROM_PB, value, what, InvalidRequestError)


def _response_phase(value: int, what: str) -> Phase:
    return _enum(_PHASE_FROM_PB, value, what, BadResponseError)


# --- requests: records -> messages (client), messages -> records (server) -------------------


def switch_to_pb(r: SwitchRequest) -> pb.SwitchPhaseRequest:
    return pb.SwitchPhaseRequest(
        target_phase=PHASE_TO_PB[r.target],
        drain_timeout_s=r.drain_timeout_s,
        keep_kv=r.keep_kv,
        leader_epoch=r.leader_epoch,
    )


def switch_from_pb(m: pb.SwitchPhaseRequest) -> SwitchRequest:
    keep = m.keep_kv if m.HasField("keep_kv") else True
    phase = _request_phase(m.target_phase, "SwitchPhase target_phase")
    return SwitchRequest(phase, m.drain_timeout_s, keep, m.leader_epoch)


def location_to_pb(loc: KvLocation) -> pb.KvLocation:
    m = pb.KvLocation(tier=TIER_TO_PB[loc.tier], address=loc.address)
    if loc.node_id is not None:
        m.node_id = loc.node_id
    return m


def location_from_pb(m: pb.KvLocation, what: str) -> KvLocation:
    tier = _enum(_TIER_FROM_PB, m.tier, f"{what} tier", InvalidRequestError)
    return KvLocation(tier, m.node_id if m.HasField("node_id") else None, m.address)


def transfer_to_pb(r: TransferRequest) -> pb.TransferKVRequest:
    return pb.TransferKVRequest(
        source=location_to_pb(r.source),
        destination=location_to_pb(r.destination),
        hashes=r.hashes,
        allow_partial=r.allow_partial,
        answer_when_started=r.answer_when_started,
    )


def transfer_from_pb(m: pb.TransferKVRequest) -> TransferRequest:
    if not m.HasField("source") or not m.HasField("destination"):
        raise InvalidRequestError("TransferKV: source and destination are required")
    return TransferRequest(
        location_from_pb(m.source, "TransferKV source"),
        location_from_pb(m.destination, "TransferKV destination"),
        tuple(m.hashes),
        m.allow_partial,
        m.answer_when_started,
    )


def prefetch_to_pb(r: PrefetchRequest) -> pb.PrefetchRequest:
    return pb.PrefetchRequest(
        request_id=r.request_id,
        hashes=r.hashes,
        source=TIER_TO_PB[r.source],
        wait=r.wait,
        allow_partial=r.allow_partial,
    )


def prefetch_from_pb(m: pb.PrefetchRequest) -> PrefetchRequest:
    tier = _enum(_TIER_FROM_PB, m.source, "Prefetch source", InvalidRequestError)
    if tier == "L1":
        raise InvalidRequestError("Prefetch: source must be L2 or pool, got L1")
    return PrefetchRequest(m.request_id, tuple(m.hashes), tier, m.wait, m.allow_partial)


def hints_to_pb(r: EvictionHints) -> pb.SetEvictionHintsRequest:
    return pb.SetEvictionHintsRequest(
        hints=[pb.EvictionHint(hash=h, priority=p) for h, p in r.hints], replace=r.replace
    )


def hints_from_pb(m: pb.SetEvictionHintsRequest) -> EvictionHints:
    return EvictionHints(tuple((h.hash, h.priority) for h in m.hints), m.replace)


# --- responses: records -> messages (server), messages -> records (client) ------------------


def info_to_pb(i: EngineInfo) -> pb.EngineInfo:
    return pb.EngineInfo(
        node_id=i.node_id,
        model=i.model,
        backend=i.backend,
        phase=PHASE_TO_PB[i.phase],
        page_size=i.page_size,
        l1_capacity_blocks=i.l1_capacity_blocks,
        l2_capacity_blocks=i.l2_capacity_blocks,
        l1_used_blocks=i.l1_used_blocks,
        l2_used_blocks=i.l2_used_blocks,
        http_url=i.http_url,
        kv_events_endpoint=i.kv_events_endpoint,
        kv_replay_endpoint=i.kv_replay_endpoint,
        samples_endpoint=i.samples_endpoint,
        version=i.version,
        bootstrap_port=i.bootstrap_port,
    )


def info_from_pb(m: pb.EngineInfo) -> EngineInfo:
    return EngineInfo(
        node_id=m.node_id,
        model=m.model,
        backend=m.backend,
        phase=_response_phase(m.phase, "EngineInfo phase"),
        page_size=m.page_size,
        l1_capacity_blocks=m.l1_capacity_blocks,
        l2_capacity_blocks=m.l2_capacity_blocks,
        l1_used_blocks=m.l1_used_blocks,
        l2_used_blocks=m.l2_used_blocks,
        http_url=m.http_url,
        kv_events_endpoint=m.kv_events_endpoint,
        kv_replay_endpoint=m.kv_replay_endpoint,
        samples_endpoint=m.samples_endpoint,
        version=m.version,
        bootstrap_port=m.bootstrap_port,
    )


def switch_result_to_pb(r: SwitchResult) -> pb.SwitchPhaseResponse:
    return pb.SwitchPhaseResponse(
        phase=PHASE_TO_PB[r.phase],
        previous_phase=PHASE_TO_PB[r.previous_phase],
        drain_s=r.drain_s,
        switch_s=r.switch_s,
        total_s=r.total_s,
        l1_blocks_kept=r.l1_blocks_kept,
        l2_blocks_kept=r.l2_blocks_kept,
    )


def switch_result_from_pb(m: pb.SwitchPhaseResponse) -> SwitchResult:
    return SwitchResult(
        phase=_response_phase(m.phase, "SwitchPhaseResponse phase"),
        previous_phase=_response_phase(m.previous_phase, "SwitchPhaseResponse previous_phase"),
        drain_s=m.drain_s,
        switch_s=m.switch_s,
        total_s=m.total_s,
        l1_blocks_kept=m.l1_blocks_kept,
        l2_blocks_kept=m.l2_blocks_kept,
    )


def transfer_result_to_pb(r: TransferResult) -> pb.TransferKVResponse:
    return pb.TransferKVResponse(
        blocks_moved=r.blocks_moved,
        bytes=r.bytes,
        seconds=r.seconds,
        missing_hashes=r.missing_hashes,
    )


def transfer_result_from_pb(m: pb.TransferKVResponse) -> TransferResult:
    return TransferResult(m.blocks_moved, m.bytes, m.seconds, tuple(m.missing_hashes))


def prefetch_result_to_pb(r: PrefetchResult) -> pb.PrefetchResponse:
    return pb.PrefetchResponse(
        blocks_started=r.blocks_started,
        blocks_ready=r.blocks_ready,
        seconds=r.seconds,
        missing_hashes=r.missing_hashes,
    )


def prefetch_result_from_pb(m: pb.PrefetchResponse) -> PrefetchResult:
    return PrefetchResult(m.blocks_started, m.blocks_ready, m.seconds, tuple(m.missing_hashes))


def hints_result_to_pb(r: HintsResult) -> pb.SetEvictionHintsResponse:
    return pb.SetEvictionHintsResponse(applied=r.applied, ignored=r.ignored)


def hints_result_from_pb(m: pb.SetEvictionHintsResponse) -> HintsResult:
    return HintsResult(m.applied, m.ignored)


def sample_to_pb(s: IterationSample) -> pb.IterationSample:
    return pb.IterationSample(
        seq=s.seq,
        timestamp_s=s.timestamp_s,
        phase=PHASE_TO_PB[s.phase],
        wall_s=s.wall_s,
        prefill=[pb.PrefillItem(uncached_tokens=u, cached_tokens=c) for u, c in s.prefill],
        prefill_requests=s.prefill_requests,
        prefill_uncached_tokens=s.prefill_uncached_tokens,
        prefill_uncached_var=s.prefill_uncached_var,
        prefill_cached_tokens=s.prefill_cached_tokens,
        decode_batch_size=s.decode_batch_size,
        decode_context_tokens=s.decode_context_tokens,
    )


def sample_from_pb(m: pb.IterationSample) -> IterationSample:
    return IterationSample(
        seq=m.seq,
        timestamp_s=m.timestamp_s,
        phase=_response_phase(m.phase, "IterationSample phase"),
        wall_s=m.wall_s,
        prefill=tuple((p.uncached_tokens, p.cached_tokens) for p in m.prefill),
        prefill_requests=m.prefill_requests,
        prefill_uncached_tokens=m.prefill_uncached_tokens,
        prefill_uncached_var=m.prefill_uncached_var,
        prefill_cached_tokens=m.prefill_cached_tokens,
        decode_batch_size=m.decode_batch_size,
        decode_context_tokens=m.decode_context_tokens,
    )


def health_to_pb(h: Health) -> pb.HealthResponse:
    return pb.HealthResponse(
        state=HEALTH_TO_PB[h.state], reason=h.reason, phase=PHASE_TO_PB[h.phase]
    )


def health_from_pb(m: pb.HealthResponse) -> Health:
    state = _enum(_HEALTH_FROM_PB, m.state, "health state", BadResponseError)
    return Health(state, _response_phase(m.phase, "HealthResponse phase"), m.reason)
