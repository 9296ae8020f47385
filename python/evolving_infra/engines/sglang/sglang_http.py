"""Typed client of the SGLang 0.5.23 HTTP endpoints the sidecar drives, and their failures.

Shapes as in the 0.5.23 source (`sglang/srt/entrypoints/http_server.py`, `v1_loads.py`,
`managers/load_snapshot.py`, `managers/io_struct.py`):

- `GET /health`: 200 when serving; 503 while starting, shutting down, or when its own probe
  (a one-token generation, unless `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`) got no answer in
  `SGLANG_HEALTH_CHECK_TIMEOUT` (20 s). With generation on it takes at least a second.
- `GET /server_info`: the resolved server args (flat: `page_size`, `model_path`,
  `disaggregation_bootstrap_port`, ...), the scheduler's `max_total_num_tokens`, `kv_events`
  (the publisher's descriptor or null), `internal_states` (one map per DP rank, from the
  scheduler's own context: its live `disaggregation_mode`, `memory_usage`, ...) and `version`.
- `GET /v1/loads`: `{"loads": [one map per DP rank]}` with `num_running_reqs`,
  `num_waiting_reqs` (the waiting queue plus the PD bootstrap/prealloc/transfer/retracted
  queues), `num_used_tokens` (pages held by requests; evictable cached pages are *not* counted),
  `max_total_num_tokens`, `disaggregation{mode, *_queue_reqs}`, `queues{grammar, ...}`.
- `POST /pd_role_switch {"new_role", "decode_cuda_graph_memory_gb"}`: 200 with
  `PdRoleSwitchReqOutput{success: true, message, old_role, new_role, safe_to_restore}`, 400 with
  the same map and `success: false`, or 400 `{"error": {"message"}}` when the handler raised.
- `POST /flush_cache?timeout=S`: 200 text, or 400 with the reason (requests still present).

Every failure becomes a control error (`control/errors.py`) whose message names the endpoint and
carries SGLang's own words, so the router sees why without reading SGLang's log.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from evolving_infra.control.errors import (
    EngineBusyError,
    EngineInternalError,
    EngineTimeoutError,
    EngineUnavailableError,
)

MAX_BODY_CHARS = 512  # SGLang's error bodies quoted in messages


class SglangUnavailableError(EngineUnavailableError):
    """SGLang's HTTP server cannot be reached: not started yet, exited, connection refused."""


class SglangTimeoutError(EngineTimeoutError):
    """An SGLang endpoint did not answer within the sidecar's timeout for it."""


class SglangRejectedError(EngineBusyError):
    """SGLang refused a control call (HTTP 400 or `success: false`); nothing was done.

    `reason` is SGLang's message; `safe_to_restore` is False when SGLang says the instance is
    unusable after the failure (a role switch that failed half way: restart required).
    """

    def __init__(self, message: str, *, reason: str, safe_to_restore: bool = True) -> None:
        super().__init__(message)
        self.reason = reason
        self.safe_to_restore = safe_to_restore


class SglangResponseError(EngineInternalError):
    """SGLang answered with a status or a body the sidecar cannot use (not 0.5.23's shape)."""


@dataclass(frozen=True, slots=True)
class Loads:
    """`/v1/loads`, summed over DP ranks: what a drain waits for and what occupancy says."""

    mode: str  # "prefill", "decode" or "null" (SGLang's live disaggregation mode)
    running: int
    waiting: int  # waiting queue + PD bootstrap/prealloc/transfer/retracted queues
    grammar: int  # requests waiting for a grammar to compile
    pd_queued: int  # requests in any PD queue (prefill bootstrap/inflight, decode queues)
    used_tokens: int  # tokens held by requests (SGLang excludes evictable cached pages)
    max_total_tokens: int

    @property
    def idle(self) -> bool:
        """What SGLang's `Scheduler.is_fully_idle` checks before a role switch, as far as
        `/v1/loads` shows it (the in-flight overlap batch is not visible here: SGLang itself
        rejects a switch then, and the sidecar drains again)."""
        return self.running == 0 and self.waiting == 0 and self.grammar == 0 and not self.pd_queued

    def describe(self) -> str:
        return (
            f"{self.running} running, {self.waiting} waiting, {self.pd_queued} in PD queues,"
            f" {self.grammar} compiling grammars"
        )

    @classmethod
    def from_json(cls, body: Any) -> Loads:
        """Raises `SglangResponseError` when `body` is not a 0.5.23 `/v1/loads` answer."""
        try:
            ranks = body["loads"]
            if not isinstance(ranks, list) or not ranks:
                raise ValueError("no DP rank in 'loads'")
            pd_keys = (
                "prefill_bootstrap_queue_reqs",
                "prefill_inflight_queue_reqs",
                "decode_prealloc_queue_reqs",
                "decode_transfer_queue_reqs",
                "decode_retracted_queue_reqs",
            )
            pd = [r.get("disaggregation") or {} for r in ranks]
            return cls(
                mode=str(pd[0].get("mode", "null")),
                running=sum(int(r["num_running_reqs"]) for r in ranks),
                waiting=sum(int(r["num_waiting_reqs"]) for r in ranks),
                grammar=sum(int((r.get("queues") or {}).get("grammar", 0)) for r in ranks),
                pd_queued=sum(int(d.get(k, 0)) for d in pd for k in pd_keys),
                used_tokens=sum(int(r["num_used_tokens"]) for r in ranks),
                max_total_tokens=sum(int(r["max_total_num_tokens"]) for r in ranks),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SglangResponseError(f"SGLang /v1/loads: unexpected answer ({e!r})") from None


@dataclass(frozen=True, slots=True)
class RoleSwitchOutcome:
    """`PdRoleSwitchReqOutput`."""

    success: bool
    message: str
    old_role: str
    new_role: str
    safe_to_restore: bool


class SglangHttp:
    """Calls to one SGLang HTTP server at `base_url`; every call has a timeout.

    Build and use it inside the event loop that runs it; `close()` releases the session.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 10.0, api_key: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        # SGLang's admin endpoints (/pd_role_switch, /flush_cache) take the admin key, or the
        # API key when no admin key is set, as a bearer token.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    async def _request(
        self,
        method: str,
        path: str,
        *,
        timeout_s: float | None = None,
        body: Any = None,
        params: dict[str, str] | None = None,
    ) -> tuple[int, str]:
        """(status, body text); transport failures raised as typed errors."""
        url = f"{self.base_url}{path}"
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(timeout):
                async with self._http().request(method, url, json=body, params=params) as r:
                    return r.status, await r.text()
        except TimeoutError:
            raise SglangTimeoutError(
                f"SGLang at {self.base_url}: {method} {path} did not answer within {timeout:g} s"
            ) from None
        except aiohttp.ClientError as e:
            raise SglangUnavailableError(
                f"SGLang at {self.base_url}: {method} {path}: {e or type(e).__name__}"
            ) from None

    async def _json(self, path: str, *, timeout_s: float | None = None) -> Any:
        status, text = await self._request("GET", path, timeout_s=timeout_s)
        if status != 200:
            raise _unexpected(f"GET {path}", status, text)
        try:
            return json.loads(text)
        except ValueError:
            raise SglangResponseError(f"SGLang GET {path}: not JSON: {_quote(text)}") from None

    async def health(self, *, timeout_s: float | None = None) -> tuple[int, str]:
        """`/health`'s status and body (200: serving; 503: starting, exiting or unhealthy)."""
        return await self._request("GET", "/health", timeout_s=timeout_s)

    async def server_info(self) -> dict[str, Any]:
        info = await self._json("/server_info")
        if not isinstance(info, dict):
            raise SglangResponseError("SGLang GET /server_info: not a JSON object")
        return info

    async def loads(self) -> Loads:
        return Loads.from_json(await self._json("/v1/loads?include=core,disagg,queues"))

    async def role_switch(
        self, new_role: str, *, decode_graph_memory_gb: float | None, timeout_s: float
    ) -> RoleSwitchOutcome:
        """`POST /pd_role_switch`. A refusal SGLang explains (`success: false`) is returned, not
        raised: the caller decides whether to drain again; a handler failure raises."""
        body: dict[str, Any] = {"new_role": new_role}
        if decode_graph_memory_gb is not None:
            body["decode_cuda_graph_memory_gb"] = decode_graph_memory_gb
        status, text = await self._request(
            "POST", "/pd_role_switch", body=body, timeout_s=timeout_s
        )
        try:
            answer = json.loads(text)
        except ValueError:
            answer = None
        if isinstance(answer, dict) and "success" in answer and status in (200, 400):
            return RoleSwitchOutcome(
                success=bool(answer["success"]),
                message=str(answer.get("message", "")),
                old_role=str(answer.get("old_role", "")),
                new_role=str(answer.get("new_role", "")),
                safe_to_restore=bool(answer.get("safe_to_restore", False)),
            )
        raise _unexpected("POST /pd_role_switch", status, text)

    async def flush_cache(self, *, timeout_s: float) -> None:
        """`POST /flush_cache`: drops the radix tree (L1 and host L2). SGLang waits up to
        `timeout_s` for the engine to be idle and refuses (400) otherwise."""
        status, text = await self._request(
            "POST", "/flush_cache", params={"timeout": f"{timeout_s:g}"}, timeout_s=timeout_s + 5
        )
        if status != 200:
            raise _unexpected("POST /flush_cache", status, text)


def _quote(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= MAX_BODY_CHARS else text[:MAX_BODY_CHARS] + "...")


def _error_message(text: str) -> str:
    """SGLang's own words from an error body: `{"error": {"message"}}`, `{"error": "..."}`,
    `{"message"}`, FastAPI's `{"detail"}`, or the text itself."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:MAX_BODY_CHARS]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for value in (error, body.get("message"), body.get("detail")):
            if value:
                return str(value)
    return text.strip()[:MAX_BODY_CHARS]


def _unexpected(what: str, status: int, text: str) -> Exception:
    """400 is SGLang refusing (a precondition); anything else is a failure or a foreign server."""
    reason = _error_message(text)
    if status == 400:
        return SglangRejectedError(f"SGLang refused {what}: {reason}", reason=reason)
    if status == 503:
        return SglangUnavailableError(f"SGLang {what}: HTTP 503: {reason}")
    return SglangResponseError(f"SGLang {what}: HTTP {status}: {_quote(text)}")
