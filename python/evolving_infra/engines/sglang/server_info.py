"""SGLang 0.5.23's `/server_info`, read into the facts `GetInfo` reports (`StaticFacts`).

`/server_info` (`entrypoints/http_server.py::server_info`, `utils/common.py::build_server_info`)
is the launcher's resolved server args, flat (`page_size`, `model_path`, `served_model_name`,
`disaggregation_bootstrap_port`, `enable_hierarchical_cache`, `hicache_size`, `hicache_ratio`,
`enable_forward_pass_metrics`, ...), plus the scheduler's `max_total_num_tokens`, the KV-event
publisher's descriptor `kv_events` (`runtime_context.py::describe_kv_events_publisher`:
`endpoint_host` (often a wildcard the subscriber must replace), `endpoint_port_base`,
`replay_endpoint_port_base`, `block_size`, `dp_size`), `internal_states` (one map per DP rank,
from the scheduler's own context) and `version`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from evolving_infra.engines.sglang.sglang_http import SglangResponseError

log = structlog.get_logger("evolving_infra.engines.sglang")

SGLANG_VERSION = "0.5.23"
WILDCARD_HOSTS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
DEFAULT_HICACHE_RATIO = 2.0  # SGLang's host-pool size without --hicache-ratio/--hicache-size


@dataclass(frozen=True, slots=True)
class StaticFacts:
    """What `/server_info` says once and for all (until SGLang restarts)."""

    model: str
    page_size: int
    bootstrap_port: int
    l1_capacity_blocks: int
    l2_capacity_blocks: int
    kv_events_endpoint: str  # advertised ("" without a publisher)
    kv_replay_endpoint: str
    kv_events_local: str  # where the sidecar itself subscribes
    fpm_endpoint: str  # SGLang's pass-metrics PUB for DP rank 0 ("" when off)
    version: str


def bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def tcp(host: str, port: int, instead_of_wildcard: str) -> str:
    return f"tcp://{bracket(instead_of_wildcard if host in WILDCARD_HOSTS else host)}:{port}"


def _fpm_base(info: Mapping[str, Any]) -> str:
    # The scheduler picks a temp-file endpoint itself when none is given and records it only in
    # its own context: the first DP rank's internal state has it, the top level may not.
    states = info.get("internal_states") or [{}]
    first = states[0] if isinstance(states[0], dict) else {}
    return str(
        first.get("forward_pass_metrics_ipc_name")
        or info.get("forward_pass_metrics_ipc_name")
        or ""
    )


def l2_capacity_tokens(info: Mapping[str, Any], l1_tokens: int) -> int:
    """The host (HiCache) pool in tokens, as SGLang sizes it (`mem_cache/pool_host/base.py`):
    `--hicache-size` GB / bytes per token, else `--hicache-ratio` x the device pool. An estimate:
    SGLang's padding page and its auto-shrink to fit host memory are not visible here."""
    if not info.get("enable_hierarchical_cache"):
        return 0
    if info.get("hicache_host_memory_mode") == "buffer_only":
        return 0  # host memory only stages pages to L3: no L2 tier
    size_gb = float(info.get("hicache_size") or 0)
    if size_gb > 0:
        states = info.get("internal_states") or [{}]
        memory = (states[0] if isinstance(states[0], dict) else {}).get("memory_usage") or {}
        kv_gb, capacity = float(memory.get("kvcache") or 0), int(memory.get("token_capacity") or 0)
        return int(size_gb * capacity / kv_gb) if kv_gb > 0 and capacity > 0 else 0
    return int(l1_tokens * float(info.get("hicache_ratio") or DEFAULT_HICACHE_RATIO))


def parse_server_info(info: Mapping[str, Any], *, advertise: str, local: str) -> StaticFacts:
    """`/server_info` of SGLang 0.5.23 → the facts GetInfo reports; `SglangResponseError` when a
    field it needs is missing or unusable."""
    try:
        page_size = int(info["page_size"])
        l1_tokens = int(info["max_total_num_tokens"])
        model = str(info.get("served_model_name") or info["model_path"])
        bootstrap_port = int(info["disaggregation_bootstrap_port"])
        kv = info.get("kv_events")
        events = replay = events_local = ""
        if isinstance(kv, dict):
            host, port = str(kv["endpoint_host"]), int(kv["endpoint_port_base"])
            events, events_local = tcp(host, port, advertise), tcp(host, port, local)
            if kv.get("replay_endpoint_port_base") is not None:
                replay = tcp(host, int(kv["replay_endpoint_port_base"]), advertise)
            # Blocks are hashed at the publisher's block size (page x DCP width).
            page_size = int(kv.get("block_size") or page_size)
            if int(kv.get("dp_size") or 1) > 1:
                log.warning("sglang_dp_ranks", dp_size=kv["dp_size"], note="rank 0 only")
        fpm = _fpm_base(info) if info.get("enable_forward_pass_metrics") else ""
        version = str(info.get("version", "?"))
    except (KeyError, TypeError, ValueError) as e:
        raise SglangResponseError(f"SGLang /server_info: unexpected answer ({e!r})") from None
    if page_size < 1 or l1_tokens < 0:
        raise SglangResponseError(f"SGLang /server_info: page_size {page_size}, tokens {l1_tokens}")
    if version != SGLANG_VERSION:
        log.warning("sglang_version", version=version, expected=SGLANG_VERSION)
    return StaticFacts(
        model=model,
        page_size=page_size,
        bootstrap_port=bootstrap_port,
        l1_capacity_blocks=l1_tokens // page_size,
        l2_capacity_blocks=l2_capacity_tokens(info, l1_tokens) // page_size,
        kv_events_endpoint=events,
        kv_replay_endpoint=replay,
        kv_events_local=events_local,
        fpm_endpoint=f"{fpm}.0" if fpm else "",  # SGLang binds `{ipc_name}.{dp_rank}`
        version=f"sglang {version}",
    )
