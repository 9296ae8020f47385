"""The router's API keys (issue 8, security defaults): a data key on /v1/*, a separate admin key
on /metrics, /health always open; 401s in OpenAI's error shape that are counted and leave the
router serving. Real aiohttp app and client on loopback (tests/router_helpers.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster_helpers import start_cluster
from evolving_infra.cli import config_defaults
from evolving_infra.control.server import CONTROL_API_KEY_ENV
from evolving_infra.router import config
from evolving_infra.router.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, ApiKeys
from router_helpers import Router, run_router

DATA, ADMIN = "sk-data-123", "sk-admin-456"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def refused(r: Router, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    resp = await r.client.request(method, path, **kwargs)
    assert resp.status == 401, await resp.text()
    assert resp.headers["WWW-Authenticate"] == "Bearer"
    body: dict[str, Any] = await resp.json()
    assert body["error"]["code"] == "invalid_api_key"
    assert body["error"]["type"] == "authentication_error"
    return body


def errors_401(text: str) -> float:
    """`evolving_errors_total{type="authentication_error",code="invalid_api_key"}` in a page."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "evolving_errors_total" and s.labels.get("code") == "invalid_api_key":
                return float(s.value)
    return 0.0


def test_without_keys_everything_is_open() -> None:
    async def check(r: Router) -> None:
        for path in ("/v1/models", "/health", "/metrics"):
            assert (await r.client.get(path)).status == 200, path
        assert (await r.client.post("/v1/chat/completions", json=CHAT)).status == 200

    run_router(check)


def test_data_key_guards_the_api_and_not_health() -> None:
    async def check(r: Router) -> None:
        body = await refused(r, "POST", "/v1/chat/completions", json=CHAT)
        assert "Authorization: Bearer" in body["error"]["message"]
        await refused(r, "GET", "/v1/models", headers=bearer("sk-wrong"))
        await refused(r, "POST", "/v1/branches/b1/end", headers={"Authorization": "Basic eDp5"})
        # A key that is not ASCII is a wrong key (401), not a server error.
        await refused(r, "GET", "/v1/models", headers={"X-API-Key": "ключ"})
        assert r.dispatcher.seen == []  # nothing refused reached dispatch
        ok = await r.client.post("/v1/chat/completions", json=CHAT, headers=bearer(DATA))
        assert ok.status == 200
        assert (await ok.json())["choices"][0]["message"]["content"]
        assert (await r.client.get("/v1/models", headers={"X-API-Key": DATA})).status == 200
        # Open without a key: health (load balancers). With no admin key, metrics take the
        # data key: a key set means the router is not meant to be open.
        assert (await r.client.get("/health")).status == 200
        await refused(r, "GET", "/metrics")
        metrics = await r.client.get("/metrics", headers=bearer(DATA))
        assert metrics.status == 200
        assert errors_401(await metrics.text()) == 5

    run_router(check, api_keys=ApiKeys(data=DATA))


def test_metrics_public_leaves_metrics_open_but_not_the_api() -> None:
    async def check(r: Router) -> None:
        assert (await r.client.get("/metrics")).status == 200
        await refused(r, "GET", "/v1/models")

    run_router(check, api_keys=ApiKeys(data=DATA, metrics_public=True))
    # An admin key guards /metrics whatever --metrics-public says.
    keys = ApiKeys(data=DATA, admin=ADMIN, metrics_public=True)
    assert keys.required("/metrics") == (ADMIN, "admin endpoints")


def test_admin_key_guards_metrics_and_the_two_keys_are_separate() -> None:
    async def check(r: Router) -> None:
        await refused(r, "GET", "/metrics")
        await refused(r, "GET", "/metrics", headers=bearer(DATA))
        await refused(r, "GET", "/v1/models", headers=bearer(ADMIN))
        assert (await r.client.get("/metrics", headers=bearer(ADMIN))).status == 200
        assert (await r.client.get("/v1/models", headers=bearer(DATA))).status == 200
        assert (await r.client.get("/health")).status == 200

    run_router(check, api_keys=ApiKeys(data=DATA, admin=ADMIN))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    return p


def test_keys_come_from_flags_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["--engines", "127.0.0.1:1"]
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_API_KEY_ENV, raising=False)
    c = config.RouterConfig.from_args(_parser().parse_args(base))
    assert c.api_keys == ApiKeys()
    assert not c.api_keys.enabled
    assert not c.exposed_without_key  # loopback by default
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    monkeypatch.setenv(ADMIN_API_KEY_ENV, "admin-env")
    c = config.RouterConfig.from_args(_parser().parse_args(base))
    assert c.api_keys == ApiKeys(data="from-env", admin="admin-env")
    c = config.RouterConfig.from_args(_parser().parse_args([*base, "--api-key", "flag"]))
    assert c.api_keys.data == "flag"
    # An empty value means "no key", not "the empty key".
    monkeypatch.setenv(API_KEY_ENV, "")
    c = config.RouterConfig.from_args(_parser().parse_args([*base, "--host", "0.0.0.0"]))
    assert c.api_keys.data is None
    assert c.exposed_without_key


def test_keys_from_the_config_file(tmp_path: Path) -> None:
    toml = tmp_path / "router.toml"
    toml.write_text('engines = ["127.0.0.1:1"]\napi-key = "file-key"\nadmin-api-key = "adm"\n')
    p = _parser()
    p.set_defaults(**config_defaults(p, toml))
    c = config.RouterConfig.from_args(p.parse_args([]))
    assert c.api_keys == ApiKeys(data="file-key", admin="adm")


def test_engines_and_router_share_a_control_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Live: engines started with a control key (from the environment, as `cluster up`'s
    children inherit it) serve a router that has it; a router without it cannot start, and
    says why."""
    monkeypatch.setenv(CONTROL_API_KEY_ENV, "ctl-key")
    c = start_cluster(tmp_path, engines=2, prefill=1)
    try:
        body = json.dumps(CHAT).encode()
        req = urllib.request.Request(
            f"{c.router_url}/v1/chat/completions", data=body,
            headers={"content-type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
        env = {k: v for k, v in os.environ.items() if k != CONTROL_API_KEY_ENV}
        keyless = subprocess.run(
            [sys.executable, "-m", "evolving_infra", "router", "--engines", *c.control,
             "--port", "0"],
            capture_output=True, text=True, timeout=60, env=env, check=False,
        )  # fmt: skip
        assert keyless.returncode == 2
        assert "control API key" in keyless.stderr
    finally:
        c.stop()
