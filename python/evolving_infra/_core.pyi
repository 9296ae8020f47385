"""Type stubs for the native module `evolving_infra._core` (Rust crate `kvdir-py`).

Hand-written and checked against the built module by `python -m mypy.stubtest`
(`make lint`). The semantics are the contract of DESIGN §2.
"""

from collections.abc import Iterator, Sequence
from typing import Final, Literal, TypeAlias, final, overload

import numpy as np
import numpy.typing as npt

Tier = Literal["L1", "L2"]
Branch = str | int

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
    "PromptText",
    "UnknownBranchError",
    "UnknownParentError",
    "__version__",
    "_fast_int_layout",
    "array_spans",
    "block_hashes",
    "common_prefix",
    "token_ids_valid",
    "trace_chain",
]

__version__: Final[str]

# A chain of block hashes: any sequence of ints, or an `int64` array (read without conversion).
_Hashes: TypeAlias = Sequence[int] | npt.NDArray[np.int64]

def block_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """SGLang 0.5.23 page hashes of every full page of `token_ids` (signed 64-bit ints)."""

def token_ids_valid(token_ids: Sequence[object]) -> bool:
    """Whether every item is an int in [0, 2^32), bools excluded (read in place for lists and
    tuples of ints)."""

def _fast_int_layout() -> str | None:
    """The int layout lists of hashes are read by ("ob_size", "lv_tag"), or None where every item
    goes through the C API (`fastint.rs`). For tests and bug reports."""

def trace_chain(seed: bytes, ids: npt.NDArray[np.int64], person: bytes) -> list[int]:
    """Trace block hashes chained from `seed` (`workloads.blocks.chain_from`): blake2b with an
    8-byte digest and `person` over the previous digest and each id's 8 little-endian bytes."""

def array_spans(
    body: bytes, key: str, resume: tuple[int, int] | None = None, spans: bool = True
) -> tuple[int, int, list[tuple[int, int]]] | None:
    """The top-level array under `key` of a request body: `(open, close, spans)`, the offsets of
    its `[` and `]` and (with `spans`) the `[start, end)` span of each element; or None where
    the body is not an object with exactly one such array, or it cannot be read without
    decoding (a key with an escape). With `resume=(open, at)`, the body is known to hold, up to
    `at`, the array opened at `open` through one of its elements, which ends at `at` (or the
    comma after it begins there): the scan starts there and returns only the elements after it.
    Nothing is validated: decode the body too."""

def common_prefix(a: bytes, b: bytes) -> int:
    """Bytes `a` and `b` start with in common."""

@final
class PromptText:
    """A piece of a `PagedPrompt`'s kept text: a read-only buffer (`memoryview(piece)`)."""

    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __len__(self) -> int: ...
    def __bytes__(self) -> bytes: ...

@final
class PagedPrompt(Sequence[int]):
    """A prompt's token ids and the digests of its full pages (SGLang 0.5.23 page hashes),
    reusing those of `after` for the pages both prompts start with: the router keeps one per
    agent branch so that the next turn hashes only what it adds. The prefix is compared token by
    token, not assumed; the ids' decimal text (the engines' JSON) is kept and reused the same way.
    Raises `InvalidArgumentError` for an id outside [0, 2^32) or a page size of 0. ~10 bytes a
    token (the id, its text) and 32 a page, held in chunks of ~4k ids that the prompts built
    from one another share. A sequence of its ids (registered as one)."""

    def __new__(
        cls, token_ids: Sequence[int], page_size: int, after: PagedPrompt | None = None
    ) -> PagedPrompt: ...
    @staticmethod
    def extend(before: PagedPrompt, keep: int, tail: Sequence[int]) -> PagedPrompt:
        """The first `keep` ids of `before`, then `tail`: only the pages past the kept ones are
        hashed, and no id is compared (the caller verified what it keeps)."""
    def json(self) -> bytes:
        """The ids as the text of a JSON array without spaces."""
    def text(self) -> list[PromptText]:
        """The text between `json()`'s brackets as it is kept, one piece per ~4k ids, each a
        read-only buffer over the native bytes (nothing copied)."""
    @overload
    def __getitem__(self, index: int, /) -> int: ...
    @overload
    def __getitem__(self, index: slice, /) -> list[int]: ...
    def __iter__(self) -> Iterator[int]: ...
    def hashes(self) -> PageHashes:
        """The block hash of every full page (as `block_hashes`), kept native."""
    @property
    def reused(self) -> int:
        """Tokens this prompt shares with `after`, from the start (0 without it)."""
    @property
    def page_size(self) -> int: ...
    @property
    def nbytes(self) -> int:
        """Bytes held (chunks shared with other prompts counted here too)."""
    def __len__(self) -> int: ...

@final
class PageHashes(Sequence[int]):
    """A prompt's page hashes (`PagedPrompt.hashes`): an immutable sequence of ints that the
    directory's calls read without converting them; equal to any sequence of the same ints."""

    @overload
    def __getitem__(self, index: int, /) -> int: ...
    @overload
    def __getitem__(self, index: slice, /) -> list[int]: ...
    def __iter__(self) -> Iterator[int]: ...
    def __len__(self) -> int: ...
    def __eq__(self, other: object, /) -> bool: ...

class KvDirectoryError(ValueError):
    """Base of every error the directory raises; the directory is unchanged when it is raised."""

class UnknownParentError(KvDirectoryError):
    """`parent` is not a block the directory knows."""

    parent: int

class ParentMismatchError(KvDirectoryError):
    """`hash` is known under `known_parent` but the call gives it `parent` (None: a first page)."""

    hash: int
    parent: int | None
    known_parent: int | None

class DuplicateHashError(KvDirectoryError):
    """A chain repeats `hash` (or contains its own parent)."""

    hash: int

class HashRangeError(KvDirectoryError):
    """`value` is outside the signed 64-bit range of block hashes."""

    value: int

class UnknownBranchError(KvDirectoryError):
    """`branch_fork` from a branch that does not exist."""

    branch: Branch

class BranchExistsError(KvDirectoryError):
    """`branch_fork` onto a branch that already exists."""

    branch: Branch

class InvalidArgumentError(KvDirectoryError):
    """A bad tier, node, time, page size or limit; `argument` names it."""

    argument: str

class EventDecodeError(KvDirectoryError):
    """Bytes that are not a valid SGLang `KVEventBatch`; `offset` is where decoding stopped."""

    offset: int

@final
class PrefixMatch:
    """Result of `KvDirectory.match`: how much of a query chain each place holds."""

    @property
    def nodes(self) -> dict[int, tuple[int, int]]:
        """{node: (l1, l12)} for every node with l12 > 0."""

    @property
    def pool(self) -> int:
        """Leading query blocks each held in the L2 of at least one node."""

    @property
    def cluster(self) -> int:
        """Leading query blocks each held somewhere."""

    def node(self, node: int) -> tuple[int, int]:
        """(l1, l12) of one node, (0, 0) if it holds none of the query (`nodes.get(node,
        (0, 0))` without building the map)."""

    @property
    def node_ids(self) -> npt.NDArray[np.int64]:
        """Nodes with l12 > 0, ascending."""

    @property
    def l1(self) -> npt.NDArray[np.int64]:
        """Leading query blocks in each node's L1, aligned with `node_ids`."""

    @property
    def l12(self) -> npt.NDArray[np.int64]:
        """Leading query blocks in each node's L1 or L2, aligned with `node_ids`."""

    def ttft(
        self,
        prompt_tokens: int,
        block_size: int,
        form: tuple[float, float, float, float, float, float],
        l2_seconds_per_block: float,
        pool_seconds_per_block: float,
        slot: npt.NDArray[np.int64],
        queue: npt.NDArray[np.float64],
        out: npt.NDArray[np.float64],
    ) -> int:
        """Each candidate's predicted TTFT into `out`; returns the index of the least. `form`:
        the model's `timing.model.PrefillForm` (intercept, uncached, hinge, attention, cached,
        knee)."""

    def __len__(self) -> int:
        """Number of nodes with l12 > 0."""

@final
class KvDirectory:
    """Cluster-wide directory of KV blocks: holders per tier, branch counts, eviction order."""

    def __init__(self) -> None: ...
    def store(
        self,
        node: int,
        tier: Tier,
        hashes: _Hashes,
        parent: int | None = None,
        now: float | None = None,
    ) -> None: ...
    def remove(self, node: int, tier: Tier, hashes: _Hashes) -> None: ...
    def clear(self, node: int, tier: Tier | None = None) -> None: ...
    def match(self, hashes: _Hashes) -> PrefixMatch: ...
    def touch(self, node: int, hashes: _Hashes, now: float | None = None) -> None: ...
    def branch_set(self, branch: Branch, hashes: _Hashes, version: int | None = None) -> bool: ...
    def branch_fork(self, src: Branch, dst: Branch) -> None: ...
    def branch_end(self, branch: Branch) -> bool: ...
    def refcount(self, h: int) -> int: ...
    def held_elsewhere(self, node: int, tier: Tier, hashes: _Hashes) -> list[int]: ...
    def held(self, node: int, tier: Tier | None = None) -> int: ...
    def eviction_order(self, node: int, tier: Tier, limit: int | None = None) -> list[int]: ...
    def evict(self, node: int, tier: Tier, n: int) -> list[int]: ...
    def demote(
        self, node: int, n: int, now: float | None = None
    ) -> tuple[list[int], list[int | None]]:
        """Evicts up to `n` blocks from `node`'s L1 in eviction order and holds each in its L2
        (last access `now`): `(hashes, parents)` in the order evicted, children first."""
    def apply_events(self, node: int, payload: bytes, now: float | None = None) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def __len__(self) -> int:
        """Number of known blocks (held or referenced by a branch)."""

    def __contains__(self, h: int, /) -> bool: ...
