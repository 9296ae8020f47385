"""Typed errors of the shared L2 pool: callers branch on class and attributes, never on text.

Mooncake reports failures as negative integer codes (`mooncake-store/include/types.h`); the
worker hands the code through, and `error_for_code` maps it here, in one place.
"""

from __future__ import annotations

# Mooncake `ErrorCode` values this package reacts to (types.h in 0.3.13).
NO_AVAILABLE_HANDLE = -200  # allocation failed: no segment has room
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706  # a reader holds the object's lease; a non-forced remove must wait
TRANSFER_FAIL = -800
RPC_FAIL = -900

INSTALL_HINT = (
    "apt-get install -y libibverbs1 libnuma1 libcurl4 && "
    "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1"
)


class PoolError(RuntimeError):
    """Base class of every error the L2 pool raises."""


class MooncakeMissingError(PoolError):
    """The Mooncake wheel or one of the system libraries it links against is not installed."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(f"Mooncake is not usable here ({detail}); install it with: {INSTALL_HINT}")


class MasterStartError(PoolError):
    """`mooncake_master` exited or did not listen in time; `log_tail` holds its last log lines."""

    def __init__(self, reason: str, log_tail: str = "", returncode: int | None = None) -> None:
        self.reason = reason
        self.log_tail = log_tail
        self.returncode = returncode
        tail = f"\n--- master log tail ---\n{log_tail}" if log_tail else ""
        super().__init__(f"mooncake_master failed to start: {reason}{tail}")


class PoolUnavailableError(PoolError):
    """The store worker died, timed out or could not reach the master; this client is closed.

    Create a new `PoolClient` to continue. `returncode` is the worker's exit status when it died.
    """

    def __init__(self, reason: str, returncode: int | None = None, log_tail: str = "") -> None:
        self.reason = reason
        self.returncode = returncode
        self.log_tail = log_tail
        tail = f"\n--- worker log tail ---\n{log_tail}" if log_tail else ""
        super().__init__(f"L2 pool unavailable: {reason}{tail}")


class MasterUnreachableError(PoolUnavailableError):
    """Nothing listens at the master's address: raised before a worker is started.

    Without this check Mooncake's own setup retries for ~90 s (20 tries of ~4.4 s).
    """


class PoolTimeoutError(PoolUnavailableError):
    """A pool call exceeded its deadline; the worker was killed so no late reply can be mistaken."""


class PoolFullError(PoolError):
    """No segment of the pool has room for the rejected blocks; nothing already stored was lost.

    `stored` are the block hashes of this call that did go in (a batch can fill up midway),
    `rejected` those that did not.
    """

    def __init__(self, stored: list[int], rejected: list[int]) -> None:
        self.stored = stored
        self.rejected = rejected
        super().__init__(f"L2 pool full: {len(rejected)} block(s) rejected, {len(stored)} stored")


class PoolOperationError(PoolError):
    """Mooncake returned an error code this package does not expect for the operation."""

    def __init__(self, op: str, code: int) -> None:
        self.op = op
        self.code = code
        super().__init__(f"{op} failed with Mooncake error code {code}")
