"""Typed engine-control errors, and the one place they convert to and from gRPC statuses.

An engine raises these from its `EngineControlService` methods; the server turns each into a
gRPC status (code + message + an `ErrorDetail` in the trailing metadata), and the client turns
the status back into the same class, so callers catch `UnknownBlocksError` and read `.hashes`
instead of parsing messages. Transport failures (engine unreachable, deadline passed) arrive as
statuses too and map to `EngineUnavailableError` / `EngineTimeoutError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import grpc
from google.protobuf.message import DecodeError

from evolving_infra.control.v1 import engine_pb2 as pb

# "-bin" suffix: gRPC carries the value as raw bytes (base64 on the wire for HTTP/2 headers).
DETAIL_KEY = "evolving-infra-error-bin"
# Trailing metadata is limited (8 KiB by default in gRPC): list at most this many hashes.
MAX_DETAIL_HASHES = 256
MAX_MESSAGE_CHARS = 2048  # the status message travels in the same trailers


class EngineControlError(Exception):
    """Base of every engine-control error; `code` is the gRPC status it travels as."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:  # a status with no class of its own keeps its real code
            self.code = code


class InvalidRequestError(EngineControlError, ValueError):
    """Malformed or out-of-range input: unknown enum value, empty or oversized list, bad number."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UnknownBlocksError(EngineControlError):
    """The source holds none or only part of the requested blocks (and partial was not allowed).

    `hashes` lists the missing blocks (at most `MAX_DETAIL_HASHES` of them: the rest are named
    only by the count in the message).
    """

    code = grpc.StatusCode.NOT_FOUND

    def __init__(self, message: str, hashes: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.hashes = tuple(hashes)


class EngineBusyError(EngineControlError):
    """The engine cannot do this now (e.g. a phase switch is already in progress)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleLeaderError(EngineControlError):
    """A `SwitchPhase` from a router replica whose leader lease was superseded: the engine has
    seen a higher epoch (`SwitchRequest.leader_epoch`) since."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class DrainTimeoutError(EngineControlError):
    """Running requests did not finish within the drain timeout; the phase did not change."""

    code = grpc.StatusCode.ABORTED


class CapacityError(EngineControlError):
    """The destination tier cannot hold the blocks."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnsupportedError(EngineControlError):
    """This engine does not offer the call."""

    code = grpc.StatusCode.UNIMPLEMENTED


class EngineUnavailableError(EngineControlError):
    """The engine cannot be reached (nothing listening, connection lost, shutting down)."""

    code = grpc.StatusCode.UNAVAILABLE


class EngineTimeoutError(EngineControlError):
    """The call's deadline passed before the engine answered."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnauthenticatedError(EngineControlError):
    """The call carried no control API key, or the wrong one (the engine's
    `--control-api-key`)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class EngineInternalError(EngineControlError):
    """The engine failed in a way it did not anticipate (a bug); the message says what it raised."""

    code = grpc.StatusCode.INTERNAL


class BadResponseError(EngineControlError):
    """The engine answered with a message this client cannot use (e.g. an unknown phase)."""

    code = grpc.StatusCode.INTERNAL


_CLASSES: tuple[type[EngineControlError], ...] = (
    InvalidRequestError,
    UnknownBlocksError,
    EngineBusyError,
    StaleLeaderError,
    DrainTimeoutError,
    CapacityError,
    UnsupportedError,
    EngineUnavailableError,
    EngineTimeoutError,
    UnauthenticatedError,
    EngineInternalError,
)
_BY_KIND = {cls.__name__: cls for cls in _CLASSES}
# The default class of a status code when the detail does not name one (transport errors,
# a server that is not ours). UNKNOWN is what grpc reports for an exception escaping a handler.
_BY_CODE: dict[grpc.StatusCode, type[EngineControlError]] = {
    cls.code: cls for cls in _CLASSES if cls is not StaleLeaderError
}
_BY_CODE[grpc.StatusCode.UNKNOWN] = EngineInternalError
_BY_CODE[grpc.StatusCode.DATA_LOSS] = EngineInternalError


def to_status(error: EngineControlError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, bytes]]]:
    """The status code, message and trailing metadata that carry `error` to the client."""
    detail = pb.ErrorDetail(kind=type(error).__name__)
    if isinstance(error, UnknownBlocksError):
        detail.hashes.extend(error.hashes[:MAX_DETAIL_HASHES])
    message = error.message
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return error.code, message, ((DETAIL_KEY, detail.SerializeToString()),)


def from_status(
    code: grpc.StatusCode, message: str, trailing: Iterable[tuple[str, str | bytes]] = ()
) -> EngineControlError:
    """The typed error for a failed call: by the detail's kind when it agrees with the code."""
    detail = pb.ErrorDetail()
    for key, value in trailing:
        if key == DETAIL_KEY and isinstance(value, bytes):
            # A garbled detail still leaves the status code to go by.
            with contextlib.suppress(DecodeError):
                detail = pb.ErrorDetail.FromString(value)
            break
    cls = _BY_KIND.get(detail.kind)
    if cls is None or cls.code != code:
        cls = _BY_CODE.get(code, EngineControlError)
    if cls is UnknownBlocksError:
        return UnknownBlocksError(message, tuple(detail.hashes))
    if cls is EngineControlError:
        return EngineControlError(message, code=code)
    return cls(message)


def from_rpc_error(error: grpc.aio.AioRpcError, address: str) -> EngineControlError:
    """The typed error for a failed client call to the engine at `address`."""
    message = error.details() or error.code().name
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        message = f"engine at {address}: {message}"  # transport errors do not say where
    trailing = error.trailing_metadata() or ()
    return from_status(error.code(), message, trailing)
