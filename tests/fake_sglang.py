"""A stand-in for an SGLang 0.5.23 server: its control endpoints on real HTTP, its real ZMQ streams.

A real SGLang server cannot start on a CPU-only machine (it needs a GPU to load and run a
model), so the sidecar's tests drive this instead. Only what the sidecar reads is here, in the
shapes of the 0.5.23 source: `GET /health` (`entrypoints/http_server.py::health_generate`),
`GET /server_info` (`utils/common.py::build_server_info`: flat resolved server args, the
scheduler's `max_total_num_tokens`, `kv_events` from `runtime_context.py::
describe_kv_events_publisher`, `internal_states`, `version`), `GET /v1/loads`
(`entrypoints/v1_loads.py`, `managers/load_snapshot.py::LoadSnapshot.to_dict`),
`POST /pd_role_switch` (`disaggregation/role_switch.py::handle_pd_role_switch` and the
tokenizer's check of `--enable-pd-role-switch`; `PdRoleSwitchReqOutput` as
`msgspec_to_builtins` writes it) and `POST /flush_cache`. KV events go out through the project's
wire-compatible `KvEventPublisher` (bound on a wildcard host, as `tcp://*:5557` is), pass
metrics through `ForwardPassMetricsPublisher` on `ipc://…/fpm.0`, named only in the scheduler's
internal state as SGLang does when it picks the path itself.

Requests are not served: a test says how many run and when they finish (`run_requests`).
Run as a script, it is a stand-in child for the launcher (`python tests/fake_sglang.py
SGLANG_FLAGS...`); it then also binds the eviction-hint PULL at `EVOLVING_INFRA_HINTS_ENDPOINT`
as the patched scheduler does, and `GET /_fake/state` reports what it received.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from aiohttp import web

from evolving_infra.engines.events import AllBlocksCleared, BlockStored, KvEventPublisher, Medium
from evolving_infra.engines.samples import ForwardPassMetricsPublisher

HINTS_ENV = "EVOLVING_INFRA_HINTS_ENDPOINT"


class FakeSglang:
    """One fake server; `await start()`, then drive its state, `await stop()` at the end."""

    def __init__(
        self,
        *,
        mode: str = "prefill",
        page_size: int = 4,
        max_total_num_tokens: int = 4096,
        bootstrap_port: int = 18998,
        host: str = "127.0.0.1",
        port: int = 0,
        kv_events_endpoint: str | None = "tcp://*:*",
        kv_replay_endpoint: str | None = "tcp://*:*",
        fpm_base: str | None = None,  # "ipc://.../fpm": pass metrics on `{base}.0`
        hicache_ratio: float | None = 2.0,  # None: no HiCache
        enable_pd_role_switch: bool = True,
        served_model_name: str = "fake-llama",
        hints_endpoint: str | None = None,
    ) -> None:
        self.mode = mode
        self.page_size = page_size
        self.max_total_num_tokens = max_total_num_tokens
        self.bootstrap_port = bootstrap_port
        self.host, self.port = host, port
        self.hicache_ratio = hicache_ratio
        self.enable_pd_role_switch = enable_pd_role_switch
        self.served_model_name = served_model_name
        self._kv_endpoints = (kv_events_endpoint, kv_replay_endpoint)
        self._fpm_base = fpm_base
        self._hints_endpoint = hints_endpoint
        # What a test sets:
        self.running = 0
        self.waiting = 0
        self.used_tokens = 0
        self.health_status = 200
        self.health_delay_s = 0.0
        self.switch_delay_s = 0.0
        self.reset_on_switch = False  # upstream 0.5.23: a switch resets the tree (and says so)
        self.fail_next_switch: tuple[str, bool] | None = None  # (message, safe_to_restore)
        self.arrive_on_switch_s: float | None = None  # a request slips in as the switch comes
        # What the fake saw:
        self.calls: list[tuple[str, str, Any]] = []
        self.flushes = 0
        self.hints: list[Any] = []
        self.kv: KvEventPublisher | None = None
        self.fpm: ForwardPassMetricsPublisher | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._zmq: zmq.asyncio.Context | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        events, replay = self._kv_endpoints
        if events is not None:
            self.kv = KvEventPublisher(events, replay, bind=True)
            self.kv.publish([AllBlocksCleared()])  # SGLang's cache announces itself empty
        if self._fpm_base is not None:
            self.fpm = ForwardPassMetricsPublisher(f"{self._fpm_base}.0")
        if self._hints_endpoint is not None:
            self._zmq = zmq.asyncio.Context()
            self._spawn(self._receive_hints(self._hints_endpoint))
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/v1/loads", self._loads)
        app.router.add_post("/pd_role_switch", self._role_switch)
        app.router.add_route("*", "/flush_cache", self._flush_cache)
        app.router.add_get("/_fake/state", self._state)
        app.router.add_post("/_fake/exit", self._exit)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Stops answering (connections are then refused) and closes the streams."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for publisher in (self.kv, self.fpm):
            if publisher is not None:
                publisher.close()
        self.kv = self.fpm = None
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- what a test drives ------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0

    def run_requests(self, n: int, seconds: float | None) -> None:
        """`n` requests run now and finish after `seconds` (None: never)."""
        self.running += n
        if seconds is not None:
            self._spawn(self._finish(n, seconds))

    async def _finish(self, n: int, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self.running -= n

    def store(self, hashes: Sequence[int], medium: str = Medium.GPU) -> None:
        assert self.kv is not None
        chain = list(hashes)
        tokens = list(range(len(chain) * self.page_size))
        self.kv.publish([BlockStored(chain, None, tokens, self.page_size, medium=medium)])

    def switch_calls(self) -> list[Any]:
        return [body for method, path, body in self.calls if path == "/pd_role_switch"]

    # -- endpoints ---------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        self.calls.append(("GET", "/health", None))
        await asyncio.sleep(self.health_delay_s)
        return web.Response(status=self.health_status)

    def _kv_descriptor(self) -> dict[str, Any] | None:
        if self.kv is None:
            return None
        configured = self._kv_endpoints[0] or ""
        out: dict[str, Any] = {
            "publisher": "zmq",
            "endpoint_host": configured.split("://", 1)[-1].rsplit(":", 1)[0],  # e.g. "*"
            "endpoint_port_base": int(self.kv.endpoint.rsplit(":", 1)[1]),
            "topic": "",
            "block_size": self.page_size,
            "dp_size": 1,
        }
        if self.kv.replay_endpoint is not None:
            out["replay_endpoint_port_base"] = int(self.kv.replay_endpoint.rsplit(":", 1)[1])
        return out

    async def _server_info(self, request: web.Request) -> web.Response:
        self.calls.append(("GET", "/server_info", None))
        info = {
            # resolved server args (a few of SGLang's ~400, flat)
            "model_path": "/models/fake-llama",
            "served_model_name": self.served_model_name,
            "host": self.host,
            "port": self.port,
            "page_size": self.page_size,
            "disaggregation_mode": self.mode,  # the launch value: not updated by a switch
            "disaggregation_transfer_backend": "mooncake",
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "enable_pd_role_switch": self.enable_pd_role_switch,
            "kv_events_config": None,
            "enable_forward_pass_metrics": self._fpm_base is not None,
            "forward_pass_metrics_ipc_name": None,  # picked by the scheduler: see below
            "enable_hierarchical_cache": self.hicache_ratio is not None,
            "hicache_ratio": self.hicache_ratio,
            "hicache_size": 0,
            "hicache_host_memory_mode": "cache",
            "radix_eviction_policy": "priority",
            "launch_command": "python -m sglang.launch_server ...",
            # scheduler info
            "status": "ready",
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_input_len": self.max_total_num_tokens - 1,
            "startup_time": 1.0,
            "kv_events": self._kv_descriptor(),
            "internal_states": [
                {
                    "disaggregation_mode": self.mode,
                    "forward_pass_metrics_ipc_name": self._fpm_base,
                    "memory_usage": {"kvcache": 1.0, "token_capacity": self.max_total_num_tokens},
                    "decode_cuda_graph_bs": [],
                    "decode_cuda_graph_memory_gb": 0.0,
                }
            ],
            "version": "0.5.23",
            "frontend": "python",
        }
        return web.json_response(info)

    async def _loads(self, request: web.Request) -> web.Response:
        self.calls.append(("GET", "/v1/loads", None))
        load = {
            "timestamp": 1.0,
            "dp_rank": 0,
            "num_running_reqs": self.running,
            "num_waiting_reqs": self.waiting,
            "num_waiting_uncached_tokens": 0,
            "num_used_tokens": self.used_tokens,
            "num_total_tokens": self.used_tokens,
            "num_active_tokens": self.used_tokens,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": 256,
            "token_usage": round(self.used_tokens / self.max_total_num_tokens, 4),
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": 0.0,
            "total_prefill_uncached_tokens": 0,
            "total_prefill_busy_us": 0,
            "decode_moments": None,
            "disaggregation": {
                "mode": self.mode,
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": 0,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": 0,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            },
            "queues": {
                "waiting": self.waiting,
                "grammar": 0,
                "paused": 0,
                "retracted": 0,
                "prealloc_ready": 0,
            },
        }
        body = {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": "0.5.23",
            "accelerator": None,
            "num_accelerators": 1,
            "loads": [load],
        }
        return web.json_response(body)

    def _switch_answer(self, status: int, success: bool, message: str, new: str,
                       safe: bool = False, old: str | None = None) -> web.Response:  # fmt: skip
        body = {
            "rid": None,
            "http_worker_ipc": None,
            "success": success,
            "message": message,
            "old_role": self.mode if old is None else old,
            "new_role": new,
            "safe_to_restore": safe,
        }
        return web.json_response(body, status=status)

    async def _role_switch(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("POST", "/pd_role_switch", body))
        new = str(body.get("new_role", "")).lower()
        if not self.enable_pd_role_switch:  # the tokenizer's check, before any scheduler
            return self._switch_answer(
                400, False, "--enable-pd-role-switch is not set on this server", new, True
            )
        if new not in ("prefill", "decode"):
            return self._switch_answer(400, False, f"invalid new_role={new!r}", new, True)
        if new == self.mode:
            return self._switch_answer(200, True, "already in target role", new)
        if self.arrive_on_switch_s is not None:
            self.run_requests(1, self.arrive_on_switch_s)
            self.arrive_on_switch_s = None
        if not self.idle:
            message = "instance is not idle; drain all requests before switching"
            return self._switch_answer(400, False, message, new, True)
        if new == "decode" and body.get("decode_cuda_graph_memory_gb") is None:
            message = "decode_cuda_graph_memory_gb is required before capturing decode graphs"
            return self._switch_answer(400, False, message, new, True)
        if self.fail_next_switch is not None:
            message, safe = self.fail_next_switch
            self.fail_next_switch = None
            return self._switch_answer(400, False, message, new, safe)
        await asyncio.sleep(self.switch_delay_s)
        old, self.mode = self.mode, new
        if self.reset_on_switch and self.kv is not None:
            self.kv.publish([AllBlocksCleared()])
        return self._switch_answer(200, True, "ok", new, old=old)

    async def _flush_cache(self, request: web.Request) -> web.Response:
        self.calls.append((request.method, "/flush_cache", dict(request.query)))
        if not self.idle:
            return web.Response(status=400, text="Flush cache failed.\n")
        self.flushes += 1
        if self.kv is not None:
            self.kv.publish([AllBlocksCleared()])
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are"
            " running or waiting requests, the operation will not be performed.)\n"
        )

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response({"mode": self.mode, "hints": self.hints, "pid": os.getpid()})

    async def _exit(self, request: web.Request) -> web.Response:
        code = int(request.query.get("code", "3"))
        print(f"fake sglang: exiting with {code}", flush=True)
        asyncio.get_running_loop().call_later(0.05, os._exit, code)
        return web.Response(text="bye")

    async def _receive_hints(self, endpoint: str) -> None:
        assert self._zmq is not None
        pull = self._zmq.socket(zmq.PULL)
        try:
            pull.bind(endpoint)
            while True:
                self.hints.append(msgpack.unpackb(await pull.recv()))
        finally:
            pull.close(linger=0)


# -- script mode: a stand-in child for the launcher ----------------------------------------------


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fake_sglang")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--disaggregation-mode", default="prefill")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--kv-events-config", default=None)
    p.add_argument("--forward-pass-metrics-ipc-name", default=None)
    p.add_argument("--served-model-name", default="fake-llama")
    p.add_argument("--fake-ignore-sigterm", action="store_true")
    p.add_argument("--fake-exit-at-start", type=int, default=None)
    args, _ = p.parse_known_args(argv)  # every other SGLang flag is accepted and ignored
    return args


async def _main(argv: Sequence[str]) -> int:
    args = _parse(argv)
    print(f"fake sglang: argv {json.dumps(list(argv))}", flush=True)
    if args.fake_exit_at_start is not None:
        print("fake sglang: failing at start", flush=True)
        return int(args.fake_exit_at_start)
    if args.fake_ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    events = replay = None
    if args.kv_events_config:
        config = json.loads(args.kv_events_config)
        events, replay = config.get("endpoint"), config.get("replay_endpoint")
    fake = FakeSglang(
        mode=args.disaggregation_mode, page_size=args.page_size, host=args.host,
        port=args.port, bootstrap_port=args.disaggregation_bootstrap_port,
        kv_events_endpoint=events, kv_replay_endpoint=replay,
        fpm_base=args.forward_pass_metrics_ipc_name, served_model_name=args.served_model_name,
        hints_endpoint=os.environ.get(HINTS_ENV),
    )  # fmt: skip
    await fake.start()
    print(f"fake sglang: serving on {fake.url}", flush=True)
    stop = asyncio.Event()
    if not args.fake_ignore_sigterm:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await fake.stop()
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(asyncio.run(_main(sys.argv[1:])))
