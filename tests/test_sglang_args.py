"""The flags the launcher passes, parsed and validated by SGLang 0.5.23's own `ServerArgs`.

`prepare_server_args` parses; `resolve_once` runs SGLang's whole resolution pipeline, including
`arg_groups/pd_disaggregation_hook.py::handle_pd_disaggregation` (what role switch rejects, and
the decode radix-cache switch). It needs a device: `--device cpu` stands in for the GPU, and the
model is a directory with only a config.json, which resolution reads; nothing is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from evolving_infra.engines.sglang.flags import fpm_subscribe_endpoint, sglang_flags
from sglang_support import sg, tiny_model_dir

pytestmark = pytest.mark.sglang


def flags(**overrides: Any) -> list[str]:
    kwargs: dict[str, Any] = {
        "phase": "prefill",
        "bootstrap_port": 18998,
        "kv_events_endpoint": "tcp://127.0.0.1:15557",
        "kv_replay_endpoint": "tcp://127.0.0.1:15558",
        "fpm_endpoint": "ipc:///tmp/evolving-infra-e0-fpm",
        "page_size": 16,
        "hicache_mooncake": True,
    }
    return sglang_flags(**{**kwargs, **overrides})


def server_args(tmp_path: Path, extra: list[str]) -> Any:
    argv = ["--model-path", tiny_model_dir(tmp_path / "model"), "--device", "cpu", *extra]
    return sg("sglang.srt.server_args").prepare_server_args(argv)


def resolved(args: Any) -> Any:
    """What SGLang decided after validation (`resolving_view`: its declared overrides first)."""
    args.resolve_once()
    return sg("sglang.srt.arg_groups.model_override_base").resolving_view(args)


def test_every_flag_parses_to_its_field(tmp_path: Path) -> None:
    a = server_args(tmp_path, flags())
    assert a.disaggregation_mode == "prefill"
    assert a.disaggregation_transfer_backend == "mooncake"
    assert a.disaggregation_bootstrap_port == 18998
    assert a.enable_pd_role_switch is True
    assert a.disaggregation_decode_enable_radix_cache is True
    assert json.loads(a.kv_events_config) == {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:15557",
        "replay_endpoint": "tcp://127.0.0.1:15558",
        "bind": True,
    }
    assert a.enable_forward_pass_metrics is True
    assert a.forward_pass_metrics_ipc_name == "ipc:///tmp/evolving-infra-e0-fpm"
    assert fpm_subscribe_endpoint(a.forward_pass_metrics_ipc_name) == (
        "ipc:///tmp/evolving-infra-e0-fpm.0"
    )
    assert a.radix_eviction_policy == "priority"
    assert a.enable_hierarchical_cache is True
    assert a.hicache_storage_backend == "mooncake"
    assert a.page_size == 16


def test_optional_flags_are_left_out(tmp_path: Path) -> None:
    a = server_args(
        tmp_path, flags(fpm_endpoint=None, hicache_mooncake=False, priority_eviction=False)
    )
    assert (a.enable_forward_pass_metrics, a.enable_hierarchical_cache) == (False, False)
    assert (a.hicache_storage_backend, a.radix_eviction_policy) == (None, "lru")


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_sglang_validation_accepts_both_phases(tmp_path: Path, phase: str) -> None:
    view = resolved(server_args(tmp_path, flags(phase=phase)))
    assert view.disaggregation_mode == phase
    assert view.enable_pd_role_switch is True
    # A decode engine keeps its radix cache (SGLang would disable it without the flag).
    assert view.disable_radix_cache is False
    assert view.page_size == 16


def test_decode_without_the_radix_flag_loses_its_prefix_cache(tmp_path: Path) -> None:
    """Why `--disaggregation-decode-enable-radix-cache` is always passed: without it a decode
    engine has no radix cache (kept across role switches), and with HiCache it does not start."""
    argv = flags(phase="decode", hicache_mooncake=False)
    argv.remove("--disaggregation-decode-enable-radix-cache")
    assert resolved(server_args(tmp_path, argv)).disable_radix_cache is True
    argv = flags(phase="decode")
    argv.remove("--disaggregation-decode-enable-radix-cache")
    with pytest.raises(ValueError, match="mutually exclusive"):
        resolved(server_args(tmp_path, argv))


def test_sglang_rejects_role_switch_with_speculative_decoding(tmp_path: Path) -> None:
    """The validation above is live: a combination role switch cannot rebuild fails."""
    argv = [*flags(), "--speculative-algorithm", "EAGLE"]
    with pytest.raises(ValueError, match="enable-pd-role-switch"):
        resolved(server_args(tmp_path, argv))


def test_flag_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="phase"):
        flags(phase="both")
    with pytest.raises(ValueError, match="page_size"):
        flags(page_size=0)
    with pytest.raises(ValueError, match="ipc://"):
        flags(fpm_endpoint="tcp://127.0.0.1:5560")
