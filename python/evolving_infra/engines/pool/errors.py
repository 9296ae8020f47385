"""Typed errors of the shared L2 pool: callers branch on class and attributes, never on text.

Mooncake reports failures as negative integer codes (`mooncake-store/include/types.h`); the
worker hands the code through, and `error_for_code` maps it here, in one place.
"""

from __future__ import annotations

import re

from evolving_infra.errors import CommandError

# Mooncake `ErrorCode` values this package reacts to (types.h in 0.3.13).
NO_AVAILABLE_HANDLE = -200  # allocation failed: no segment has room
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706  # a reader holds the object's lease; a non-forced remove must wait
TRANSFER_FAIL = -800
RPC_FAIL = -900

# What the pool needs: the wheel (the `pool` extra), and the system libraries it links against.
PIP_HINT = "pip install 'evolving-infra[pool]'"
DEBIAN_PACKAGES = "libibverbs1 libnuma1 libcurl4"
APT_HINT = f"apt-get install -y {DEBIAN_PACKAGES}"
INSTALL_HINT = f"{APT_HINT} && {PIP_HINT}"

PACKAGE_NOT_FOUND = "Python package `mooncake` not found"
_LIBRARY = re.compile(r"([\w+.-]+\.so(?:\.\d+)*): cannot open shared object file")


class PoolError(RuntimeError):
    """Base class of every error the L2 pool raises."""


class MooncakeMissingError(PoolError, CommandError):
    """The Mooncake wheel or one of the system libraries it links against is not installed.

    `library` is the missing shared library (`libibverbs.so.1`), None when the Python package
    itself is missing; the message says which and what installs it. A caller that can do without
    the pool adds its way around: `raise e.otherwise("run with --no-pool")`.
    """

    def __init__(self, detail: str) -> None:
        self.detail = detail
        found = _LIBRARY.search(detail)  # the loader's and ImportError's wording
        self.library = found.group(1) if found else None
        if self.library is None:
            missing = detail.startswith(PACKAGE_NOT_FOUND) or "No module named" in detail
            what = "the shared L2 pool needs Mooncake" + ("" if missing else f" ({detail})")
            CommandError.__init__(self, what, PIP_HINT)
        else:
            CommandError.__init__(
                self,
                f"the shared L2 pool needs Mooncake, which needs the system library"
                f" {self.library} (Debian packages {DEBIAN_PACKAGES})",
                APT_HINT,
            )


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
