"""The SGLang 0.5.23 command-line flags of a symmetric engine (spellings from
`sglang/srt/arg_groups/fields/*.py`; tests/test_sglang_args.py parses them with SGLang's own
`prepare_server_args` and runs its validation).

The launcher adds them to the model, port and parallelism flags it owns. No SGLang import.
"""

from __future__ import annotations

import json
from typing import Final

PHASES: Final = ("prefill", "decode")


def sglang_flags(
    *,
    phase: str,
    bootstrap_port: int,
    kv_events_endpoint: str,
    kv_replay_endpoint: str,
    fpm_endpoint: str | None,
    page_size: int,
    hicache_mooncake: bool,
    priority_eviction: bool = True,
) -> list[str]:
    """SGLang args for one engine that starts as `phase` and can switch in place.

    - `--disaggregation-mode PHASE`, `--disaggregation-transfer-backend mooncake` (role switch
      supports Mooncake and Mori only), `--disaggregation-bootstrap-port PORT`: with role switch
      every instance runs a bootstrap server, so co-located engines need distinct ports.
    - `--enable-pd-role-switch`: `POST /pd_role_switch` (the patch keeps the KV across it).
    - `--disaggregation-decode-enable-radix-cache`: without it a decode engine runs with
      `disable_radix_cache=True`, and since the tree cache is built once at start, an engine that
      started as decode would then have no prefix cache in either role.
    - `--kv-events-config`: ZMQ publisher bound (`"bind": true`, else a concrete address such as
      127.0.0.1 would be *connected*) at `kv_events_endpoint`, replay ROUTER at
      `kv_replay_endpoint`; both `tcp://HOST:PORT` or `ipc://PATH`.
    - `--enable-forward-pass-metrics --forward-pass-metrics-ipc-name BASE` when `fpm_endpoint`
      (BASE, an `ipc://PATH`) is given: SGLang publishes at `fpm_subscribe_endpoint(BASE)`.
    - `--radix-eviction-policy priority` unless `priority_eviction=False`: the key the patch turns
      into "dead branches first, then LRU".
    - `--enable-hierarchical-cache --hicache-storage-backend mooncake` when `hicache_mooncake`
      (host L2 plus the shared Mooncake pool; its address comes from Mooncake's env/config).
    - `--page-size N` (tokens per KV block, the unit of block hashes).
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if page_size < 1:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if fpm_endpoint is not None and not fpm_endpoint.startswith("ipc://"):
        # SGLang appends ".{dp_rank}" to it, which only makes sense for a path.
        raise ValueError(f"fpm_endpoint must be an ipc:// path, got {fpm_endpoint!r}")
    kv_events = {
        "publisher": "zmq",
        "endpoint": kv_events_endpoint,
        "replay_endpoint": kv_replay_endpoint,
        "bind": True,
    }
    flags = [
        "--disaggregation-mode", phase,
        "--disaggregation-transfer-backend", "mooncake",
        "--disaggregation-bootstrap-port", str(bootstrap_port),
        "--enable-pd-role-switch",
        "--disaggregation-decode-enable-radix-cache",
        "--kv-events-config", json.dumps(kv_events, separators=(",", ":")),
        "--page-size", str(page_size),
    ]  # fmt: skip
    if fpm_endpoint is not None:
        flags += ["--enable-forward-pass-metrics", "--forward-pass-metrics-ipc-name", fpm_endpoint]
    if priority_eviction:
        flags += ["--radix-eviction-policy", "priority"]
    if hicache_mooncake:
        flags += ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"]
    return flags


def fpm_subscribe_endpoint(fpm_endpoint: str, dp_rank: int = 0) -> str:
    """Where SGLang publishes forward-pass metrics for a `--forward-pass-metrics-ipc-name` base
    (`managers/scheduler_components/metrics_reporter.py::_init_fpm`: `f"{base}.{dp_rank}"`)."""
    return f"{fpm_endpoint}.{dp_rank}"
