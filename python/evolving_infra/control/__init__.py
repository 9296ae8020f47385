"""Engine control: the gRPC service every engine node serves (`proto/.../engine.proto`).

Clients (router daemon, planner) use `EngineClient`; engines (simulated engine, SGLang sidecar)
subclass `EngineControlService` and run it with `serve`. Both sides speak the plain records of
`records` and raise or catch the typed errors of `errors`; protobuf stays inside `convert` and
the generated `v1` package.
"""

from evolving_infra.control.client import DEFAULT_TIMEOUT_S, EngineClient
from evolving_infra.control.errors import (
    BadResponseError,
    CapacityError,
    DrainTimeoutError,
    EngineBusyError,
    EngineControlError,
    EngineInternalError,
    EngineTimeoutError,
    EngineUnavailableError,
    InvalidRequestError,
    StaleLeaderError,
    UnauthenticatedError,
    UnknownBlocksError,
    UnsupportedError,
)
from evolving_infra.control.records import (
    MAX_HASHES,
    MAX_HINTS,
    EngineInfo,
    EvictionHints,
    Health,
    HealthState,
    HintsResult,
    IterationSample,
    KvLocation,
    PrefetchRequest,
    PrefetchResult,
    SwitchRequest,
    SwitchResult,
    Tier,
    TransferRequest,
    TransferResult,
)
from evolving_infra.control.server import EngineControlService, handler, serve
from evolving_infra.types import Phase

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_HASHES",
    "MAX_HINTS",
    "BadResponseError",
    "CapacityError",
    "DrainTimeoutError",
    "EngineBusyError",
    "EngineClient",
    "EngineControlError",
    "EngineControlService",
    "EngineInfo",
    "EngineInternalError",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "EvictionHints",
    "Health",
    "HealthState",
    "HintsResult",
    "InvalidRequestError",
    "IterationSample",
    "KvLocation",
    "Phase",
    "PrefetchRequest",
    "PrefetchResult",
    "StaleLeaderError",
    "SwitchRequest",
    "SwitchResult",
    "Tier",
    "TransferRequest",
    "TransferResult",
    "UnauthenticatedError",
    "UnknownBlocksError",
    "UnsupportedError",
    "handler",
    "serve",
]
