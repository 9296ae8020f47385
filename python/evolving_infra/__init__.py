"""evolving-infra: an agent-adaptive control plane for PD-disaggregated LLM serving.

The KV directory (DESIGN §2) is implemented in Rust (`rust/kvdir`) and exposed through the
private native module `evolving_infra._core`; this package re-exports its public names.
"""

from collections.abc import Sequence

# First: pins OpenBLAS's kernels before anything loads numpy (reproducible simulations, blas.py).
from evolving_infra import blas as _blas  # noqa: F401  (isort: skip)
from evolving_infra._core import (
    BranchExistsError,
    DuplicateHashError,
    EventDecodeError,
    HashRangeError,
    InvalidArgumentError,
    KvDirectory,
    KvDirectoryError,
    PagedPrompt,
    PageHashes,
    ParentMismatchError,
    PrefixMatch,
    UnknownBranchError,
    UnknownParentError,
    __version__,
    block_hashes,
)

# Sequences to `isinstance` too (the router passes them where token ids and hashes go).
Sequence.register(PagedPrompt)
Sequence.register(PageHashes)

__all__ = [
    "BranchExistsError",
    "DuplicateHashError",
    "EventDecodeError",
    "HashRangeError",
    "InvalidArgumentError",
    "KvDirectory",
    "KvDirectoryError",
    "PageHashes",
    "PagedPrompt",
    "ParentMismatchError",
    "PrefixMatch",
    "UnknownBranchError",
    "UnknownParentError",
    "__version__",
    "block_hashes",
]
