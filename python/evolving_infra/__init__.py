"""evolving-infra: an agent-adaptive control plane for PD-disaggregated LLM serving.

The KV directory (DESIGN §2) is implemented in Rust (`rust/kvdir`) and exposed through the
private native module `evolving_infra._core`; this package re-exports its public names.
"""

from evolving_infra._core import (
    BranchExistsError,
    DuplicateHashError,
    EventDecodeError,
    HashRangeError,
    InvalidArgumentError,
    KvDirectory,
    KvDirectoryError,
    ParentMismatchError,
    PrefixMatch,
    UnknownBranchError,
    UnknownParentError,
    __version__,
    block_hashes,
)

__all__ = [
    "BranchExistsError",
    "DuplicateHashError",
    "EventDecodeError",
    "HashRangeError",
    "InvalidArgumentError",
    "KvDirectory",
    "KvDirectoryError",
    "ParentMismatchError",
    "PrefixMatch",
    "UnknownBranchError",
    "UnknownParentError",
    "__version__",
    "block_hashes",
]
