"""Directory block hashes for trace prompts.

Trace block ids are scoped to a namespace and name a block only given its prefix, so they cannot
be directory hashes as they are. Like an SGLang page hash, the hash of block i digests the whole
chain before it: digest_i = blake2b(digest_{i-1} || id_i), 8 bytes, read as a little-endian
signed 64-bit int. The chain starts from a seed:
- a namespace's seed is blake2b(namespace): two namespaces never share a block;
- a shared prefix `name` of n blocks is the chain of ids 0..n-1 from the seed blake2b("prefix/" +
  name), the same for every agent;
- a prompt's own blocks after `shared` prefix blocks chain from blake2b(prefix digest_{shared-1}
  || namespace seed): they depend on both the prefix and the namespace.
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Sequence
from typing import cast

import numpy as np

from evolving_infra._core import trace_chain
from evolving_infra.types import BlockHash
from evolving_infra.workloads.model import (
    Agent,
    AgentId,
    BlockIds,
    Blocks,
    Branch,
    BranchId,
    Request,
    Trace,
)

# NOTE: the person string separates these digests from any other use of blake2b; changing it
# changes every block hash derived from a trace (it dates from the first, Claude Code, importer).
_PERSON = b"evinfra-cc-v1"


# Copying a keyed-up hasher costs half of building one from keyword arguments (~1 µs a block
# in `chain_from`, which the simulator runs on every new prompt block).
_BLANK = hashlib.blake2b(digest_size=8, person=_PERSON)


def _digest(data: bytes) -> bytes:
    h = _BLANK.copy()
    h.update(data)
    return h.digest()


def namespace_seed(namespace: str) -> bytes:
    return _digest(namespace.encode())


def chain_from(seed: bytes, ids: Sequence[int], known: Sequence[BlockHash] = ()) -> list[BlockHash]:
    """Hashes of `ids` chained from `seed`; `known` holds the already computed leading ones.

    The chain is computed natively (`_core.trace_chain`, the blake2b above): the simulator
    hashes every new prompt block, and a Python loop over them (~1.4 µs a block) was an eighth
    of a 3,072-GPU run's time."""
    k = len(known)
    digest = int.to_bytes(known[-1], 8, "little", signed=True) if known else seed
    if isinstance(ids, BlockIds):
        # A view of the branch's id array: no copy, no Python int per id.
        arr = np.frombuffer(ids.base, dtype=np.int64, count=len(ids))[k:]
    else:
        arr = np.fromiter(ids[k:], dtype=np.int64)
    out: list[int] = list(known)
    out.extend(trace_chain(digest, arr, _PERSON))
    return cast(list[BlockHash], out)


def chain_hashes(
    namespace: str, ids: Sequence[int], prefix: Sequence[BlockHash] = ()
) -> tuple[BlockHash, ...]:
    """Hashes of a prompt of namespace ids with no shared prefix; `prefix`: known leading hashes."""
    return tuple(chain_from(namespace_seed(namespace), ids, prefix))


def known_prefix(chain: Sequence[int], known: Container[int]) -> int:
    """How many leading blocks of `chain` are in `known`, when `known` is prefix-closed for it
    (chain hashes: holding a block means holding every block before it), by bisection."""
    lo, hi = 0, len(chain)
    while lo < hi:
        mid = (lo + hi) // 2
        if chain[mid] in known:
            lo = mid + 1
        else:
            hi = mid
    return lo


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if isinstance(a, BlockIds) and a.shares_base(b):
        return n  # views of one array: the shorter is a prefix of the longer
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PromptHasher:
    """Block hashes of a trace's prompts, computed incrementally.

    A branch's next prompt usually extends its previous one, so only the new blocks are hashed:
    the hasher keeps each branch's last prompt (ids and hashes) and each prefix's chain.
    """

    def __init__(self, trace: Trace) -> None:
        self.prefix_sizes = trace.prefixes
        self._prefixes: dict[str, list[BlockHash]] = {}
        self._last: dict[tuple[AgentId, BranchId], tuple[bytes, Blocks, list[BlockHash]]]
        self._last = {}

    def prefix(self, name: str) -> list[BlockHash]:
        if name not in self._prefixes:
            seed = _digest(f"prefix/{name}".encode())
            self._prefixes[name] = chain_from(seed, range(self.prefix_sizes[name]))
        return self._prefixes[name]

    def hashes(self, agent: Agent, branch: Branch, request: Request) -> list[BlockHash]:
        """The request's whole prompt: shared prefix blocks, then its own."""
        seed = namespace_seed(agent.namespace)
        head: list[BlockHash] = []
        if request.shared:
            assert agent.prefix is not None, "validated: a request with shared blocks has a prefix"
            head = self.prefix(agent.prefix)[: request.shared]
            seed = _digest(int.to_bytes(head[-1], 8, "little", signed=True) + seed)
        key = (agent.id, branch.id)
        known: list[BlockHash] = []
        last = self._last.get(key)
        if last is not None and last[0] == seed:
            k = common_prefix(last[1], request.blocks)
            known = last[2][:k]
        own = chain_from(seed, request.blocks, known)
        self._last[key] = (seed, request.blocks, own)
        return head + own
