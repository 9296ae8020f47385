"""`SglangSidecar`: the EngineControl service of one SGLang 0.5.23 engine (DESIGN §4).

The sidecar runs next to a (patched) SGLang server and serves the same gRPC service as the
simulated engine by driving SGLang's own HTTP endpoints (`sglang_http.py`) and ZMQ streams
(`streams.py`), so the router and the planner cannot tell the two backends apart:

- `GetInfo`: static facts from `/server_info` (read once, then cached), phase and occupancy live
  (`/v1/loads` for the phase, KV events for the blocks held). ZMQ endpoints SGLang binds on a
  wildcard host are advertised with the sidecar's `advertise_host`.
- `Health`: SGLang's `/health`, asked at most once at a time and answered within `health_wait_s`
  (SGLang's own probe can take seconds); draining/switching while a switch runs; down, with the
  reason, when SGLang cannot be reached or a failed switch left it unusable.
- `SwitchPhase`: drain, `POST /pd_role_switch`, then `POST /flush_cache` if the KV is not kept.
  SGLang has no admission switch: the drain relies on the router, which stops sending to a node
  once it asks it to switch (and on `Health` saying "draining" meanwhile), and waits until
  `/v1/loads` shows no running, waiting, PD-queued or grammar-compiling request.
  `/pause_generation` is no drain: `in_place` freezes running requests (they never finish),
  `retract` moves them back to the waiting queue and `abort` kills them. A request that slips in
  between the drain and the switch makes SGLang refuse ("not idle"); the sidecar then drains
  again until the deadline.
- `SetEvictionHints`: forwarded to the patched scheduler (`streams.HintsPusher`).
- `StreamIterationSamples`: SGLang's forward-pass metrics (`streams.FpmFanout`).
- `TransferKV`, `Prefetch`: UNIMPLEMENTED. SGLang 0.5.23 moves KV itself: PD hand-offs through
  its Mooncake KV manager (the decode engine pulls from the prefill engine's bootstrap server),
  L3 prefetches through HiCache; neither has an endpoint to start one from outside.

Errors: SGLang unreachable → UNAVAILABLE; an SGLang endpoint past its timeout →
DEADLINE_EXCEEDED; SGLang refusing (HTTP 400) → FAILED_PRECONDITION with SGLang's message; a
drain past its timeout → ABORTED (nothing changed); an answer not in 0.5.23's shape → INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import structlog
import zmq
import zmq.asyncio

from evolving_infra.control.errors import (
    DrainTimeoutError,
    EngineBusyError,
    EngineControlError,
    EngineUnavailableError,
    UnsupportedError,
)
from evolving_infra.control.records import (
    PHASES,
    EngineInfo,
    EvictionHints,
    Health,
    HealthState,
    HintsResult,
    IterationSample,
    PrefetchRequest,
    PrefetchResult,
    SwitchRequest,
    SwitchResult,
    TransferRequest,
    TransferResult,
)
from evolving_infra.control.server import EngineControlService
from evolving_infra.engines.sglang.server_info import StaticFacts, bracket, parse_server_info, tcp
from evolving_infra.engines.sglang.sglang_http import (
    Loads,
    SglangHttp,
    SglangRejectedError,
    SglangResponseError,
    SglangTimeoutError,
    SglangUnavailableError,
)
from evolving_infra.engines.sglang.streams import (
    HINTS_ENDPOINT_ENV,
    FpmFanout,
    HintsPusher,
    KvOccupancy,
    follow_kv_events,
)
from evolving_infra.types import Phase

log = structlog.get_logger("evolving_infra.engines.sglang")

_KV_MOVES = (
    "SGLang 0.5.23 moves KV itself: PD hand-offs through its Mooncake KV manager (the decode"
    " engine pulls from the prefill engine's bootstrap server), L3 prefetches through HiCache"
)


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    """One sidecar. Times are seconds; `sglang_url` is where the sidecar reaches SGLang, and
    `advertise_host` where the router does (its data URL, ZMQ streams and bootstrap server)."""

    node_id: int
    sglang_url: str  # e.g. "http://127.0.0.1:30000"
    advertise_host: str  # e.g. "10.0.0.2"
    phase: Phase = "prefill"  # until SGLang's /v1/loads says otherwise
    hints_endpoint: str = ""  # "": the EVOLVING_INFRA_HINTS_ENDPOINT environment variable
    samples_relay: str = ""  # bind a TCP PUB republishing the pass metrics here ("": none)
    api_key: str = ""  # SGLang's --admin-api-key (or --api-key), for its admin endpoints
    drain_timeout_s: float = 300.0  # when a SwitchPhase gives none
    drain_poll_s: float = 0.1
    http_timeout_s: float = 10.0  # every SGLang call but the two below
    switch_timeout_s: float = 600.0  # /pd_role_switch may capture decode CUDA graphs
    flush_timeout_s: float = 60.0
    health_wait_s: float = 0.5  # Health answers within this; SGLang's probe may take longer
    health_timeout_s: float = 30.0  # SGLang's own generation probe gives up after 20 s
    # Sent with a switch to decode: GPU memory SGLang must find free before capturing decode
    # CUDA graphs (a decode peer's `internal_states[0].decode_cuda_graph_memory_gb`). 0: no
    # check; SGLang's capture is best effort and a failed one falls back to eager decode.
    decode_graph_memory_gb: float = 0.0
    # After a switch, time for the KV events it caused (a cache reset, if any) to arrive
    # before the blocks kept are counted.
    events_settle_s: float = 0.2


class SglangSidecar(EngineControlService):
    """Build inside the event loop that serves it; `await start()` first, `await close()` after."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.http = SglangHttp(
            config.sglang_url, timeout_s=config.http_timeout_s, api_key=config.api_key
        )
        self._local_host = urlsplit(config.sglang_url).hostname or "127.0.0.1"
        self._phase: Phase = config.phase
        self._switching: Literal["draining", "switching"] | None = None
        self._target: Phase | None = None
        self._broken = ""  # why SGLang is unusable (a failed switch), "" while it is not
        self._closed = False
        self._facts: StaticFacts | None = None
        self._facts_lock = asyncio.Lock()
        self._probe: asyncio.Task[tuple[HealthState, str]] | None = None
        self._last_probe: tuple[HealthState, str] = ("down", "SGLang /health not asked yet")
        self._zmq = zmq.asyncio.Context()
        self._zmq_sync: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(self._zmq)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.occupancy = KvOccupancy()
        self.fanout = FpmFanout(lambda: self._phase)
        self._relay: zmq.Socket[bytes] | None = None
        self.samples_relay_endpoint = ""  # the relay's bound endpoint, advertised host
        self._hints: HintsPusher | None = None

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Binds the samples relay (raises `zmq.ZMQError` when it cannot) and reads SGLang's
        facts if SGLang is up already (else on the first call that needs them)."""
        if self.config.samples_relay:
            relay = self._zmq_sync.socket(zmq.PUB)
            try:
                relay.bind(self.config.samples_relay)
            except zmq.ZMQError:
                relay.close(linger=0)
                raise
            self._relay = relay
            bound = urlsplit(relay.getsockopt_string(zmq.LAST_ENDPOINT))
            host = bound.hostname or ""
            self.samples_relay_endpoint = tcp(host, bound.port or 0, self.config.advertise_host)
        try:
            await self.facts()
        except EngineControlError as e:  # GetInfo will say it again, to whoever asks
            log.warning("sglang_facts_unavailable", node=self.config.node_id, error=e.message)

    async def close(self) -> None:
        """Ends sample streams, stops the ZMQ loops and releases sockets and the HTTP session."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.fanout.end()
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._relay is not None:
            self._relay.close(linger=0)
        if self._hints is not None:
            self._hints.close()
        self._zmq.destroy(linger=0)
        await self.http.close()

    async def facts(self) -> StaticFacts:
        """SGLang's static facts, read from `/server_info` on first use; the first success also
        starts following its KV events and pass metrics."""
        async with self._facts_lock:
            if self._facts is None:
                info = await self.http.server_info()
                facts = parse_server_info(
                    info, advertise=self.config.advertise_host, local=self._local_host
                )
                self._facts = facts
                self._follow(facts)
                log.info("sglang_found", node=self.config.node_id, model=facts.model,
                         page_size=facts.page_size, l1_blocks=facts.l1_capacity_blocks,
                         l2_blocks=facts.l2_capacity_blocks, kv_events=facts.kv_events_endpoint,
                         samples=facts.fpm_endpoint)  # fmt: skip
            return self._facts

    def _follow(self, facts: StaticFacts) -> None:
        if self._closed:
            return
        if facts.kv_events_local:
            self._tasks.append(
                asyncio.create_task(
                    follow_kv_events(self._zmq, facts.kv_events_local, self.occupancy, self._stop),
                    name="sglang-kv-events",
                )
            )
        if facts.fpm_endpoint:
            self._tasks.append(
                asyncio.create_task(
                    self.fanout.run(self._zmq, facts.fpm_endpoint, self._relay, self._stop),
                    name="sglang-fpm",
                )
            )

    # -- what the node is -------------------------------------------------------------------

    def _phase_of(self, loads: Loads) -> Phase:
        for phase in PHASES:
            if loads.mode == phase:
                return phase
        raise SglangResponseError(
            f"SGLang runs in disaggregation mode {loads.mode!r}, not as a PD engine: launch it"
            " with --disaggregation-mode prefill or decode (and --enable-pd-role-switch)"
        )

    def _blocks(self, facts: StaticFacts, loads: Loads) -> tuple[int, int]:
        """(L1, L2) blocks held: counted from KV events when SGLang publishes them; without
        events only the pages requests hold are known (`/v1/loads`), and no host tier."""
        if facts.kv_events_local:
            return self.occupancy.l1, self.occupancy.l2
        return -(-loads.used_tokens // facts.page_size), 0

    async def get_info(self) -> EngineInfo:
        facts = await self.facts()
        loads = await self.http.loads()
        if self._switching is None:  # during a switch the old phase holds until it is done
            self._phase = self._phase_of(loads)
        l1, l2 = self._blocks(facts, loads)
        port = urlsplit(self.config.sglang_url).port or 80
        return EngineInfo(
            node_id=self.config.node_id,
            model=facts.model,
            backend="sglang",
            phase=self._phase,
            page_size=facts.page_size,
            l1_capacity_blocks=facts.l1_capacity_blocks,
            l2_capacity_blocks=facts.l2_capacity_blocks,
            l1_used_blocks=l1,
            l2_used_blocks=l2,
            http_url=f"http://{bracket(self.config.advertise_host)}:{port}",
            kv_events_endpoint=facts.kv_events_endpoint,
            kv_replay_endpoint=facts.kv_replay_endpoint,
            # Without a relay, SGLang's own endpoint: an ipc:// path, usable on this host only.
            samples_endpoint=self.samples_relay_endpoint or facts.fpm_endpoint,
            version=facts.version,
            bootstrap_port=facts.bootstrap_port,
        )

    async def health(self) -> Health:
        phase = self._phase
        if self._closed:
            return Health("down", phase, "the sidecar is shutting down")
        if self._broken:
            return Health("down", phase, self._broken)
        if self._switching == "draining":
            return Health("draining", phase, f"draining for a switch to {self._target}")
        if self._switching == "switching":
            return Health("switching", phase, f"switching to {self._target}")
        # One /health at a time: a slow one (SGLang's generation probe) is shared by the polls
        # that arrive meanwhile, which get the previous answer after `health_wait_s`.
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._ask_health(), name="sglang-health")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._probe), self.config.health_wait_s)
        state, reason = self._last_probe
        return Health(state, self._phase, reason)

    async def _ask_health(self) -> tuple[HealthState, str]:
        try:
            status, body = await self.http.health(timeout_s=self.config.health_timeout_s)
        except (SglangUnavailableError, SglangTimeoutError) as e:
            answer: tuple[HealthState, str] = ("down", e.message)
        else:
            if status == 200:
                answer = ("serving", "")
            else:
                detail = f": {body.strip()[:200]}" if body.strip() else ""
                answer = ("down", f"SGLang /health answered HTTP {status}{detail}")
        if answer != self._last_probe:
            log.info("sglang_health", node=self.config.node_id, state=answer[0], reason=answer[1])
        self._last_probe = answer
        return answer

    # -- phase switch -----------------------------------------------------------------------

    async def switch_phase(self, request: SwitchRequest) -> SwitchResult:
        if self._broken:
            raise EngineUnavailableError(self._broken)
        if self._switching is not None:
            raise EngineBusyError("a phase switch is already in progress")
        self._switching, self._target = "draining", request.target  # before any await
        try:
            return await self._switch(request)
        finally:
            self._switching = self._target = None

    async def _switch(self, request: SwitchRequest) -> SwitchResult:
        cfg, loop, target = self.config, asyncio.get_running_loop(), request.target
        started = loop.time()
        facts = await self.facts()
        loads = await self.http.loads()
        previous = self._phase = self._phase_of(loads)
        if target == previous:
            return SwitchResult(target, previous, 0.0, 0.0, 0.0, *self._blocks(facts, loads))
        timeout = request.drain_timeout_s or cfg.drain_timeout_s
        deadline = started + timeout
        log.info("switch_draining", node=cfg.node_id, to=target, previous=previous,
                 load=loads.describe())  # fmt: skip
        while True:
            while not loads.idle:
                if loop.time() >= deadline:
                    raise DrainTimeoutError(
                        f"drain did not finish within {timeout:g} s ({loads.describe()});"
                        f" the node still serves {previous}"
                    )
                await asyncio.sleep(min(cfg.drain_poll_s, max(deadline - loop.time(), 0.0)))
                loads = await self.http.loads()
            drained = loop.time()
            self._switching = "switching"
            graph_gb = cfg.decode_graph_memory_gb if target == "decode" else None
            outcome = await self.http.role_switch(
                target, decode_graph_memory_gb=graph_gb, timeout_s=cfg.switch_timeout_s
            )
            if outcome.success:
                break
            if not outcome.safe_to_restore:
                self._broken = f"SGLang's role switch failed; restart required: {outcome.message}"
                log.error("switch_broke_engine", node=cfg.node_id, reason=outcome.message)
                raise SglangRejectedError(
                    self._broken, reason=outcome.message, safe_to_restore=False
                )
            loads = await self.http.loads()
            if loads.idle or loop.time() >= deadline:
                raise SglangRejectedError(
                    f"SGLang refused the switch to {target}: {outcome.message}",
                    reason=outcome.message,
                )
            # A request arrived between the drain and the switch: drain again.
            log.info("switch_redrain", node=cfg.node_id, reason=outcome.message)
            self._switching = "draining"
        self._phase = target
        if not request.keep_kv:
            try:
                await self.http.flush_cache(timeout_s=cfg.flush_timeout_s)
            except SglangRejectedError as e:  # a request came in first: the KV stays
                raise SglangRejectedError(
                    f"switched to {target}, but the KV was not dropped: {e.message}",
                    reason=e.reason,
                ) from None
        end = loop.time()
        if facts.kv_events_local:
            await asyncio.sleep(cfg.events_settle_s)
        l1, l2 = self._blocks(facts, await self.http.loads())
        log.info("phase_switched", node=cfg.node_id, phase=target, previous=previous,
                 drain_s=round(drained - started, 3), switch_s=round(end - drained, 3),
                 l1_kept=l1, l2_kept=l2)  # fmt: skip
        return SwitchResult(
            target, previous, drained - started, end - drained, end - started, l1, l2
        )

    # -- KV calls SGLang does not take from outside ------------------------------------------

    async def transfer_kv(self, request: TransferRequest) -> TransferResult:
        raise UnsupportedError(f"TransferKV: {_KV_MOVES}")

    async def prefetch(self, request: PrefetchRequest) -> PrefetchResult:
        raise UnsupportedError(f"Prefetch: {_KV_MOVES}")

    # -- eviction hints and samples ---------------------------------------------------------

    async def set_eviction_hints(self, request: EvictionHints) -> HintsResult:
        """Forwards the hints to the patched scheduler. NOTE: the sidecar cannot see which
        blocks the scheduler's tree holds; every forwarded hint counts as applied."""
        if self._hints is None:
            endpoint = self.config.hints_endpoint or os.environ.get(HINTS_ENDPOINT_ENV, "")
            if not endpoint:
                raise UnsupportedError(
                    f"no eviction-hint receiver: set {HINTS_ENDPOINT_ENV} (the patched"
                    " scheduler's PULL endpoint)"
                )
            self._hints = HintsPusher(endpoint, self._zmq_sync)
        self._hints.send(request)
        return HintsResult(applied=len(request.hints), ignored=0)

    async def iteration_samples(self) -> AsyncGenerator[IterationSample, None]:
        facts = await self.facts()
        if not facts.fpm_endpoint:
            raise UnsupportedError(
                "SGLang runs without --enable-forward-pass-metrics: no samples to stream"
            )
        if self._closed:
            return
        q = self.fanout.subscribe()
        try:
            while (item := await q.get()) is not None:
                yield item
        finally:
            self.fanout.unsubscribe(q)
