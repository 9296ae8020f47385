"""The client side of engine control: `EngineClient`, used by the router daemon and the planner.

Every call has a deadline (the client's default unless given) and raises the typed errors of
`errors` (an unreachable engine: `EngineUnavailableError` at once, not at the deadline, since
calls do not wait for the channel to become ready). Create and use a client inside the event loop
that runs it; `async with EngineClient(addr) as engine:` closes the channel.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Literal, TypeVar

import grpc

from evolving_infra.control import convert
from evolving_infra.control.errors import from_rpc_error
from evolving_infra.control.records import (
    EngineInfo,
    EvictionHints,
    Health,
    HintsResult,
    IterationSample,
    KvLocation,
    PrefetchRequest,
    PrefetchResult,
    SwitchRequest,
    SwitchResult,
    TransferRequest,
    TransferResult,
)
from evolving_infra.control.server import CHANNEL_OPTIONS
from evolving_infra.control.v1 import engine_pb2 as pb
from evolving_infra.control.v1.engine_pb2_grpc import EngineControlStub
from evolving_infra.types import Phase

DEFAULT_TIMEOUT_S = 10.0

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


class EngineClient:
    """Typed async calls to one engine's `EngineControl` service at `address` ("host:port")."""

    def __init__(
        self, address: str, *, timeout: float = DEFAULT_TIMEOUT_S, api_key: str | None = None
    ) -> None:
        """`api_key`: the engine's control API key (`--control-api-key`), sent with every call."""
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.address = address
        self.timeout = timeout
        self._metadata = None if api_key is None else (("authorization", f"Bearer {api_key}"),)
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = EngineControlStub(self._channel)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def _call(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp],
        request: _Req,
        timeout: float | None,
    ) -> _Resp:
        try:
            return await method(
                request,
                timeout=self.timeout if timeout is None else timeout,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, self.address) from e

    async def get_info(self, *, timeout: float | None = None) -> EngineInfo:
        """What the node is, its phase and occupancy, and where its other endpoints are."""
        return convert.info_from_pb(
            await self._call(self._stub.GetInfo, pb.GetInfoRequest(), timeout)
        )

    async def health(self, *, timeout: float | None = None) -> Health:
        return convert.health_from_pb(
            await self._call(self._stub.Health, pb.HealthRequest(), timeout)
        )

    async def switch_phase(
        self,
        target: Phase,
        *,
        drain_timeout_s: float = 0.0,
        keep_kv: bool = True,
        leader_epoch: int = 0,
        timeout: float | None = None,
    ) -> SwitchResult:
        """Drain, switch to `target` in place, keep the KV unless told not to.

        `timeout` (the call's deadline) should exceed `drain_timeout_s` plus the switch itself.
        `leader_epoch`: the caller's leader lease epoch (`router.replicas`); an engine that has
        seen a higher one refuses with `StaleLeaderError`.
        """
        record = SwitchRequest(target, drain_timeout_s, keep_kv, leader_epoch)
        request = convert.switch_to_pb(record)
        reply = await self._call(self._stub.SwitchPhase, request, timeout)
        return convert.switch_result_from_pb(reply)

    async def transfer_kv(
        self,
        source: KvLocation,
        destination: KvLocation,
        hashes: Sequence[int],
        *,
        allow_partial: bool = False,
        answer_when_started: bool = False,
        timeout: float | None = None,
    ) -> TransferResult:
        """Copy the block chain `hashes` from `source` to `destination`; with
        `answer_when_started`, answer once the move has begun (the proto says how)."""
        record = TransferRequest(
            source, destination, tuple(hashes), allow_partial, answer_when_started
        )
        reply = await self._call(self._stub.TransferKV, convert.transfer_to_pb(record), timeout)
        return convert.transfer_result_from_pb(reply)

    async def prefetch(
        self,
        request_id: str,
        hashes: Sequence[int],
        *,
        source: Literal["L2", "pool"] = "L2",
        wait: bool = False,
        allow_partial: bool = False,
        timeout: float | None = None,
    ) -> PrefetchResult:
        """Load a queued request's blocks into the node's L1 from its L2 or the pool."""
        record = PrefetchRequest(request_id, tuple(hashes), source, wait, allow_partial)
        reply = await self._call(self._stub.Prefetch, convert.prefetch_to_pb(record), timeout)
        return convert.prefetch_result_from_pb(reply)

    async def set_eviction_hints(
        self,
        hints: Mapping[int, int] | Iterable[tuple[int, int]],
        *,
        replace: bool = False,
        timeout: float | None = None,
    ) -> HintsResult:
        """Block priorities (hash -> priority, higher kept longer), merged or replacing."""
        pairs = tuple(hints.items()) if isinstance(hints, Mapping) else tuple(hints)
        request = convert.hints_to_pb(EvictionHints(pairs, replace))
        reply = await self._call(self._stub.SetEvictionHints, request, timeout)
        return convert.hints_result_from_pb(reply)

    async def iteration_samples(
        self, *, timeout: float | None = None
    ) -> AsyncGenerator[IterationSample, None]:
        """One sample per forward pass of the engine, until it stops or the iterator is closed.

        `timeout` bounds the whole stream (default: none, unlike the other calls). Leaving the
        `async for` early (break, exception) cancels the stream on the server.
        """
        call = self._stub.StreamIterationSamples(
            pb.StreamIterationSamplesRequest(), timeout=timeout, metadata=self._metadata
        )
        try:
            async for message in call:
                yield convert.sample_from_pb(message)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, self.address) from e
        finally:
            call.cancel()
