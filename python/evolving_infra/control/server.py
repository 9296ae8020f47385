"""The server side of engine control: an engine subclasses `EngineControlService`, `serve` runs it.

Engine code implements plain async methods over `records` and raises `errors`; it never sees
protobuf or gRPC. The servicer between them decodes each request itself (handlers take raw bytes,
so malformed bytes become INVALID_ARGUMENT with a message rather than grpc's generic failure),
validates it, calls the engine, and turns every exception into a status: a typed error into its
own code, anything else into INTERNAL with the exception named and logged. No exception from
an engine method ever reaches grpc, so one bad call cannot take the server down.
"""

from __future__ import annotations

import abc
import hmac
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
import structlog
from google.protobuf.message import DecodeError, Message

from evolving_infra.control import convert
from evolving_infra.control.errors import (
    EngineControlError,
    EngineInternalError,
    InvalidRequestError,
    StaleLeaderError,
    UnauthenticatedError,
    UnsupportedError,
    to_status,
)
from evolving_infra.control.records import (
    EngineInfo,
    EvictionHints,
    Health,
    HintsResult,
    IterationSample,
    PrefetchRequest,
    PrefetchResult,
    SwitchRequest,
    SwitchResult,
    TransferRequest,
    TransferResult,
)
from evolving_infra.control.v1 import engine_pb2 as pb

SERVICE_NAME = "evolving_infra.v1.EngineControl"
# The control API key's environment variable, read by engines and by the router.
CONTROL_API_KEY_ENV = "EVOLVING_INFRA_CONTROL_API_KEY"
# Block lists of up to 2^18 hashes with priorities exceed gRPC's default 4 MiB message limit.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)

log = structlog.get_logger("evolving_infra.control")

_Req = TypeVar("_Req", bound=Message)


class EngineControlService(abc.ABC):
    """What an engine implements to serve `EngineControl` (`proto/evolving_infra/v1/engine.proto`).

    Requests arrive validated (see `records`). Raise `InvalidRequestError` for what only the
    engine can judge (e.g. a transfer that involves neither this node nor the pool),
    `UnknownBlocksError` for blocks the source lacks when partial moves are not allowed,
    `EngineBusyError` while a switch is in progress, `DrainTimeoutError`, `CapacityError`.
    The calls an engine does not offer answer UNIMPLEMENTED by default.
    """

    @abc.abstractmethod
    async def get_info(self) -> EngineInfo: ...

    @abc.abstractmethod
    async def health(self) -> Health: ...

    async def switch_phase(self, request: SwitchRequest) -> SwitchResult:
        raise UnsupportedError("this engine cannot switch phase")

    async def transfer_kv(self, request: TransferRequest) -> TransferResult:
        raise UnsupportedError("this engine cannot transfer KV")

    async def prefetch(self, request: PrefetchRequest) -> PrefetchResult:
        raise UnsupportedError("this engine cannot prefetch")

    async def set_eviction_hints(self, request: EvictionHints) -> HintsResult:
        raise UnsupportedError("this engine takes no eviction hints")

    def iteration_samples(self) -> AsyncIterator[IterationSample]:
        """One sample per forward pass from now on; the iterator ends when the engine stops.

        Called once per subscriber; each call must give an independent iterator (the server
        closes it when the client goes away).
        """
        raise UnsupportedError("this engine streams no iteration samples")


class _Servicer:
    """Bytes in, bytes out: one method per RPC, each wrapped by `_unary` or the stream loop."""

    def __init__(self, service: EngineControlService, api_key: str | None = None) -> None:
        self.service = service
        self._key = None if api_key is None else f"Bearer {api_key}".encode()
        self.leader_epoch = 0  # the highest `SwitchRequest.leader_epoch` seen

    def _authorize(self, rpc: str, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        """Raises `UnauthenticatedError` unless the call carries the control API key (when the
        engine has one): whoever reaches the port could otherwise switch phases or drop KV."""
        if self._key is None:
            return
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        raw = given.encode() if isinstance(given, str) else given
        if not hmac.compare_digest(raw, self._key):
            raise UnauthenticatedError(
                f"{rpc}: this engine needs its control API key"
                " (metadata 'authorization: Bearer KEY')"
            )

    async def _fail(
        self,
        context: grpc.aio.ServicerContext[bytes, bytes],
        rpc: str,
        error: EngineControlError,
        started: float,
    ) -> NoReturn:
        code, message, trailing = to_status(error)
        log.warning(
            "control_rpc_failed",
            rpc=rpc,
            code=code.name,
            error=message,
            ms=round((time.perf_counter() - started) * 1e3, 3),
        )
        await context.abort(code, message, trailing_metadata=trailing)

    async def _unary(
        self,
        rpc: str,
        raw: bytes,
        context: grpc.aio.ServicerContext[bytes, bytes],
        message: type[_Req],
        handle: Callable[[_Req], Awaitable[Message]],
    ) -> bytes:
        started = time.perf_counter()
        try:
            self._authorize(rpc, context)
            reply = await handle(_parse(rpc, message, raw))
            return reply.SerializeToString()
        except EngineControlError as e:
            error: EngineControlError = e
        except Exception as e:  # the engine's bug: report it, keep serving
            log.exception("control_rpc_crashed", rpc=rpc)
            error = EngineInternalError(f"{rpc}: engine raised {type(e).__name__}: {e}")
        # Outside the except blocks: abort raises grpc's own exception, which must escape.
        await self._fail(context, rpc, error, started)

    async def get_info(self, raw: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        async def handle(_: pb.GetInfoRequest) -> Message:
            return convert.info_to_pb(await self.service.get_info())

        return await self._unary("GetInfo", raw, context, pb.GetInfoRequest, handle)

    async def switch_phase(
        self, raw: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        async def handle(m: pb.SwitchPhaseRequest) -> Message:
            request = convert.switch_from_pb(m)
            # Fencing: checked and raised with no await between, so two calls cannot both pass
            # on the same epoch check; the engine never sees a deposed leader's switch.
            if request.leader_epoch < self.leader_epoch:
                raise StaleLeaderError(
                    f"SwitchPhase: leader epoch {request.leader_epoch} is stale: this engine"
                    f" has seen epoch {self.leader_epoch} (another router replica leads)"
                )
            self.leader_epoch = request.leader_epoch
            result = await self.service.switch_phase(request)
            return convert.switch_result_to_pb(result)

        return await self._unary("SwitchPhase", raw, context, pb.SwitchPhaseRequest, handle)

    async def transfer_kv(
        self, raw: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        async def handle(m: pb.TransferKVRequest) -> Message:
            result = await self.service.transfer_kv(convert.transfer_from_pb(m))
            return convert.transfer_result_to_pb(result)

        return await self._unary("TransferKV", raw, context, pb.TransferKVRequest, handle)

    async def prefetch(self, raw: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        async def handle(m: pb.PrefetchRequest) -> Message:
            result = await self.service.prefetch(convert.prefetch_from_pb(m))
            return convert.prefetch_result_to_pb(result)

        return await self._unary("Prefetch", raw, context, pb.PrefetchRequest, handle)

    async def set_eviction_hints(
        self, raw: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> bytes:
        async def handle(m: pb.SetEvictionHintsRequest) -> Message:
            result = await self.service.set_eviction_hints(convert.hints_from_pb(m))
            return convert.hints_result_to_pb(result)

        return await self._unary(
            "SetEvictionHints", raw, context, pb.SetEvictionHintsRequest, handle
        )

    async def health(self, raw: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        async def handle(_: pb.HealthRequest) -> Message:
            return convert.health_to_pb(await self.service.health())

        return await self._unary("Health", raw, context, pb.HealthRequest, handle)

    async def stream_samples(
        self, raw: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        rpc, started = "StreamIterationSamples", time.perf_counter()
        samples: AsyncIterator[IterationSample] | None = None
        error: EngineControlError | None = None
        try:
            self._authorize(rpc, context)
            _parse(rpc, pb.StreamIterationSamplesRequest, raw)
            samples = self.service.iteration_samples()
            async for sample in samples:
                yield convert.sample_to_pb(sample).SerializeToString()
        except EngineControlError as e:
            error = e
        except Exception as e:
            log.exception("control_rpc_crashed", rpc=rpc)
            error = EngineInternalError(f"{rpc}: engine raised {type(e).__name__}: {e}")
        finally:
            # The client may go away mid-stream (the generator is closed): let the engine
            # release whatever it holds for this subscriber.
            if isinstance(samples, AsyncGenerator):
                await samples.aclose()
        if error is not None:
            await self._fail(context, rpc, error, started)


def _parse(rpc: str, message: type[_Req], raw: bytes) -> _Req:
    try:
        return message.FromString(raw)
    except DecodeError as e:
        raise InvalidRequestError(f"{rpc}: malformed {message.__name__} ({e})") from None


def handler(service: EngineControlService, api_key: str | None = None) -> grpc.GenericRpcHandler:
    """The gRPC handler of `EngineControl` backed by `service` (for a server you build yourself);
    with `api_key`, every call must carry it (`authorization: Bearer KEY` metadata)."""
    s = _Servicer(service, api_key)
    unary = grpc.unary_unary_rpc_method_handler  # no (de)serializers: raw bytes both ways
    methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "GetInfo": unary(s.get_info),
        "SwitchPhase": unary(s.switch_phase),
        "TransferKV": unary(s.transfer_kv),
        "Prefetch": unary(s.prefetch),
        "SetEvictionHints": unary(s.set_eviction_hints),
        "StreamIterationSamples": grpc.unary_stream_rpc_method_handler(s.stream_samples),
        "Health": unary(s.health),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


async def serve(
    service: EngineControlService,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start serving `service` on host:port (0: any free port); returns the server and its port.
    With `api_key`, calls without it fail with UNAUTHENTICATED.

    Stop it with `await server.stop(grace)`; open sample streams are cancelled after the grace.
    """
    # No SO_REUSEPORT (grpc's default on Linux): a second engine on a taken port must fail, not
    # silently share the port with the first.
    server = grpc.aio.server(options=(*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)))
    server.add_generic_rpc_handlers((handler(service, api_key),))
    address = _host_port(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:  # grpc reports a failed bind this way
        raise OSError(f"engine control cannot listen on {address}: {e}") from None
    if bound == 0:  # older grpc versions report a failed bind as port 0
        raise OSError(f"engine control cannot listen on {address}")
    await server.start()
    log.info("control_serving", address=_host_port(host, bound))
    return server, bound
