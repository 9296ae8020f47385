"""Typed engine-control errors survive the trip through a gRPC status (no server needed)."""

from __future__ import annotations

import grpc
import pytest

from evolving_infra.control import errors
from evolving_infra.control.errors import (
    CapacityError,
    DrainTimeoutError,
    EngineBusyError,
    EngineControlError,
    EngineInternalError,
    EngineTimeoutError,
    EngineUnavailableError,
    InvalidRequestError,
    UnknownBlocksError,
    UnsupportedError,
    from_status,
    to_status,
)

SIMPLE = (
    InvalidRequestError,
    EngineBusyError,
    DrainTimeoutError,
    CapacityError,
    UnsupportedError,
    EngineUnavailableError,
    EngineTimeoutError,
    EngineInternalError,
)


@pytest.mark.parametrize("cls", SIMPLE)
def test_each_error_round_trips(cls: type[EngineControlError]) -> None:
    back = from_status(*to_status(cls("what happened")))
    assert type(back) is cls
    assert back.message == "what happened"
    assert back.code == cls.code


def test_unknown_blocks_carry_their_hashes_up_to_the_limit() -> None:
    hashes = list(range(-5, errors.MAX_DETAIL_HASHES + 10))
    back = from_status(*to_status(UnknownBlocksError("missing", hashes)))
    assert isinstance(back, UnknownBlocksError)
    assert back.code == grpc.StatusCode.NOT_FOUND
    assert back.hashes == tuple(hashes[: errors.MAX_DETAIL_HASHES])


def test_codes_alone_map_to_classes_and_odd_details_are_ignored() -> None:
    assert type(from_status(grpc.StatusCode.UNAVAILABLE, "refused")) is EngineUnavailableError
    assert type(from_status(grpc.StatusCode.UNKNOWN, "boom")) is EngineInternalError
    # a detail naming a class whose code disagrees: the code wins
    _, _, trailing = to_status(CapacityError("full"))
    assert type(from_status(grpc.StatusCode.ABORTED, "x", trailing)) is DrainTimeoutError
    garbled = ((errors.DETAIL_KEY, b"\xff\xff"),)
    assert type(from_status(grpc.StatusCode.NOT_FOUND, "x", garbled)) is UnknownBlocksError
    other = from_status(grpc.StatusCode.PERMISSION_DENIED, "no")
    assert type(other) is EngineControlError
    assert other.code == grpc.StatusCode.PERMISSION_DENIED


def test_invalid_request_is_a_value_error() -> None:
    assert issubclass(InvalidRequestError, ValueError)


def test_long_messages_are_cut_to_fit_the_trailers() -> None:
    _, message, _ = to_status(EngineBusyError("x" * 10_000))
    assert len(message) == errors.MAX_MESSAGE_CHARS
    assert message.endswith("...")
