"""A small pure-Python reference model of `evolving_infra.KvDirectory` (DESIGN §2).

Written for obviousness, not speed: every query is recomputed from the plain state below
(eviction orders are sorted on every call, refcounts are counted, garbage is swept to a fixed
point). The differential tests drive it and the Rust directory with the same calls and compare.

State:
- `_blocks`: every known block, with its parent (None for a first page).
- `_held`: for each (node, tier), the blocks held there and their last-access time.
- `_branches`: each live branch's context chain and version.

Every public method validates all of its arguments before it changes anything. When a call breaks
several rules at once, the implementation may report any of them; `last_faults` lists the classes
of every rule the last call broke (empty after a call that succeeded), and the error raised is the
first of them.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from evolving_infra import (
    BranchExistsError,
    DuplicateHashError,
    HashRangeError,
    InvalidArgumentError,
    KvDirectoryError,
    ParentMismatchError,
    UnknownBranchError,
    UnknownParentError,
)

Hash = int
Node = int
Tier = str
Branch = str | int
Place = tuple[Node, Tier]

TIERS: tuple[Tier, Tier] = ("L1", "L2")
HASH_MIN = -(2**63)
HASH_MAX = 2**63 - 1
NODE_LIMIT = 2**31 - 1

E = TypeVar("E", bound=KvDirectoryError)


def _error(cls: type[E], message: str, **attributes: object) -> E:
    """An instance of the native error class `cls` carrying the documented attributes."""
    error = cls(message)
    for name, value in attributes.items():
        setattr(error, name, value)
    return error


def reference_block_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """SGLang 0.5.23 page hashes, straight from the formula in DESIGN §2."""
    return [signed for signed, _ in _page_digests(token_ids, page_size)]


def reference_page_digests(token_ids: Sequence[int], page_size: int) -> list[str]:
    """The full SHA-256 hex digest of every full page (what SGLang's `get_hash_str` returns)."""
    return [digest for _, digest in _page_digests(token_ids, page_size)]


def _page_digests(token_ids: Sequence[int], page_size: int) -> list[tuple[int, str]]:
    assert page_size >= 1
    out: list[tuple[int, str]] = []
    prior = b""
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        hasher = hashlib.sha256(prior)
        for token in token_ids[start : start + page_size]:
            hasher.update(token.to_bytes(4, "little", signed=False))
        prior = hasher.digest()
        unsigned = int(prior.hex()[:16], 16)
        out.append((unsigned - 2**64 if unsigned >= 2**63 else unsigned, prior.hex()))
    return out


@dataclass(slots=True)
class _Block:
    parent: Hash | None


@dataclass(slots=True)
class _BranchState:
    chain: tuple[Hash, ...]
    version: int


class ReferenceDirectory:
    """Same semantics as `KvDirectory`, from first principles."""

    def __init__(self) -> None:
        self._blocks: dict[Hash, _Block] = {}
        self._held: dict[Place, dict[Hash, float]] = {}
        self._branches: dict[Branch, _BranchState] = {}
        self.last_faults: tuple[type[KvDirectoryError], ...] = ()

    # ----------------------------------------------------------------------------------------
    # validation helpers: each appends the errors it finds

    @staticmethod
    def _check_node(node: int, faults: list[KvDirectoryError]) -> None:
        if not 0 <= node < NODE_LIMIT:
            faults.append(_error(InvalidArgumentError, f"bad node {node}", argument="node"))

    @staticmethod
    def _check_tier(tier: str, faults: list[KvDirectoryError]) -> None:
        if tier not in TIERS:
            faults.append(_error(InvalidArgumentError, f"bad tier {tier!r}", argument="tier"))

    @staticmethod
    def _check_now(now: float | None, faults: list[KvDirectoryError]) -> None:
        if now is not None and not math.isfinite(now):
            faults.append(_error(InvalidArgumentError, f"bad time {now}", argument="now"))

    @staticmethod
    def _check_hashes(hashes: Iterable[int], faults: list[KvDirectoryError]) -> None:
        for h in hashes:
            if not HASH_MIN <= h <= HASH_MAX:
                faults.append(_error(HashRangeError, f"hash {h} out of range", value=h))

    @staticmethod
    def _check_count(value: int | None, name: str, faults: list[KvDirectoryError]) -> None:
        if value is not None and value < 0:
            faults.append(_error(InvalidArgumentError, f"bad {name} {value}", argument=name))

    def _check_chain(
        self, hashes: Sequence[Hash], parent: Hash | None, faults: list[KvDirectoryError]
    ) -> None:
        """The structural rules of a chain stored (or referenced) under `parent`."""
        if parent is not None and parent not in self._blocks:
            faults.append(_error(UnknownParentError, f"unknown parent {parent}", parent=parent))
        seen: set[Hash] = set() if parent is None else {parent}
        for h in hashes:
            if h in seen:
                faults.append(_error(DuplicateHashError, f"repeated hash {h}", hash=h))
                break
            seen.add(h)
        for i, h in enumerate(hashes):
            expected = parent if i == 0 else hashes[i - 1]
            block = self._blocks.get(h)
            if block is not None and block.parent != expected:
                faults.append(
                    _error(
                        ParentMismatchError,
                        f"hash {h} is known under {block.parent}, not {expected}",
                        hash=h,
                        parent=expected,
                        known_parent=block.parent,
                    )
                )

    def _raise_if(self, faults: list[KvDirectoryError]) -> None:
        # NOTE: bad arguments (a node, tier, time, count or hash out of range) are found while
        # converting them, so they hide whatever a structural check would find.
        arguments: list[KvDirectoryError] = [
            f for f in faults if isinstance(f, InvalidArgumentError | HashRangeError)
        ]
        faults = arguments or faults
        self.last_faults = tuple(type(f) for f in faults)
        if faults:
            raise faults[0]

    # ----------------------------------------------------------------------------------------
    # plain queries over the state

    def _holders(self, h: Hash) -> list[Place]:
        return [place for place, blocks in self._held.items() if h in blocks]

    def _depth(self, h: Hash) -> int:
        depth = 0
        parent = self._blocks[h].parent
        while parent is not None:
            depth += 1
            parent = self._blocks[parent].parent
        return depth

    def _count(self, h: Hash) -> int:
        return sum(1 for state in self._branches.values() if h in state.chain)

    def _valid_prefix(self, hashes: Sequence[Hash]) -> int:
        """Length of the leading query blocks that are known and chained as in the query."""
        for i, h in enumerate(hashes):
            block = self._blocks.get(h)
            expected = hashes[i - 1] if i else None
            if block is None or block.parent != expected:
                return i
        return len(hashes)

    def _place(self, node: Node, tier: Tier) -> dict[Hash, float]:
        return self._held.get((node, tier), {})

    def _candidates(self, node: Node, tier: Tier) -> list[Hash]:
        """Blocks held at (node, tier) with no child held there."""
        held = self._place(node, tier)
        parents_of_held = {self._blocks[h].parent for h in held}
        return [h for h in held if h not in parents_of_held]

    def _order(self, node: Node, tier: Tier) -> list[Hash]:
        held = self._place(node, tier)
        return sorted(
            self._candidates(node, tier),
            key=lambda h: (self._count(h) > 0, held[h], -self._depth(h), h),
        )

    # ----------------------------------------------------------------------------------------
    # plain mutations (no validation)

    def _add_chain(self, hashes: Sequence[Hash], parent: Hash | None) -> None:
        for i, h in enumerate(hashes):
            if h not in self._blocks:
                self._blocks[h] = _Block(parent if i == 0 else hashes[i - 1])

    def _drop_place(self, place: Place, hashes: Iterable[Hash]) -> None:
        held = self._held.get(place)
        if held is None:
            return
        for h in hashes:
            held.pop(h, None)
        if not held:
            del self._held[place]

    def _collect_garbage(self) -> None:
        """Drop every block no node holds, no branch refers to and with no children."""
        held = {h for blocks in self._held.values() for h in blocks}
        referenced = {h for state in self._branches.values() for h in state.chain}
        children = Counter(block.parent for block in self._blocks.values())
        keep = held | referenced
        garbage = [h for h in self._blocks if h not in keep and children[h] == 0]
        while garbage:
            parent = self._blocks.pop(garbage.pop()).parent
            if parent is not None:
                children[parent] -= 1
                if children[parent] == 0 and parent not in keep:
                    garbage.append(parent)

    # ----------------------------------------------------------------------------------------
    # the public API

    def store(
        self,
        node: Node,
        tier: Tier,
        hashes: Sequence[Hash],
        parent: Hash | None = None,
        now: float | None = None,
    ) -> None:
        faults: list[KvDirectoryError] = []
        self._check_node(node, faults)
        self._check_tier(tier, faults)
        self._check_hashes(hashes, faults)
        self._check_hashes([] if parent is None else [parent], faults)
        self._check_now(now, faults)
        self._check_chain(hashes, parent, faults)
        self._raise_if(faults)
        when = time.monotonic() if now is None else float(now)
        self._add_chain(hashes, parent)
        if hashes:
            held = self._held.setdefault((node, tier), {})
            for h in hashes:
                held[h] = when

    def remove(self, node: Node, tier: Tier, hashes: Sequence[Hash]) -> None:
        faults: list[KvDirectoryError] = []
        self._check_node(node, faults)
        self._check_tier(tier, faults)
        self._check_hashes(hashes, faults)
        self._raise_if(faults)
        self._drop_place((node, tier), hashes)
        self._collect_garbage()

    def clear(self, node: Node, tier: Tier | None = None) -> None:
        faults: list[KvDirectoryError] = []
        self._check_node(node, faults)
        if tier is not None:
            self._check_tier(tier, faults)
        self._raise_if(faults)
        for t in TIERS if tier is None else (tier,):
            self._held.pop((node, t), None)
        self._collect_garbage()

    def match(self, hashes: Sequence[Hash]) -> tuple[dict[Node, tuple[int, int]], int, int]:
        """(nodes, pool, cluster) exactly as `PrefixMatch` reports them."""
        faults: list[KvDirectoryError] = []
        self._check_hashes(hashes, faults)
        self._raise_if(faults)
        valid = hashes[: self._valid_prefix(hashes)]

        def leading(members: set[Hash]) -> int:
            count = 0
            for h in valid:
                if h not in members:
                    break
                count += 1
            return count

        nodes: dict[Node, tuple[int, int]] = {}
        for node in sorted({n for n, _ in self._held}):
            in_l1 = set(self._place(node, "L1"))
            in_l2 = set(self._place(node, "L2"))
            l1, l12 = leading(in_l1), leading(in_l1 | in_l2)
            if l12 > 0:
                nodes[node] = (l1, l12)
        pool = leading({h for (_, t), blocks in self._held.items() if t == "L2" for h in blocks})
        cluster = leading({h for blocks in self._held.values() for h in blocks})
        return nodes, pool, cluster

    def touch(self, node: Node, hashes: Sequence[Hash], now: float | None = None) -> None:
        faults: list[KvDirectoryError] = []
        self._check_node(node, faults)
        self._check_hashes(hashes, faults)
        self._check_now(now, faults)
        self._raise_if(faults)
        when = time.monotonic() if now is None else float(now)
        for h in hashes[: self._valid_prefix(hashes)]:
            tiers = [t for t in TIERS if h in self._place(node, t)]
            if not tiers:
                break
            for t in tiers:
                self._held[(node, t)][h] = when

    def branch_set(
        self, branch: Branch, hashes: Sequence[Hash], version: int | None = None
    ) -> bool:
        faults: list[KvDirectoryError] = []
        self._check_hashes(hashes, faults)
        if version is not None and not HASH_MIN <= version <= HASH_MAX:
            faults.append(
                _error(InvalidArgumentError, f"bad version {version}", argument="version")
            )
        self._check_chain(hashes, None, faults)
        self._raise_if(faults)
        current = self._branches.get(branch)
        if current is None:
            new_version = 0 if version is None else version
        elif version is None:
            new_version = current.version + 1
        elif version < current.version:
            return False
        else:
            new_version = version
        self._add_chain(hashes, None)
        self._branches[branch] = _BranchState(tuple(hashes), new_version)
        self._collect_garbage()
        return True

    def branch_fork(self, src: Branch, dst: Branch) -> None:
        faults: list[KvDirectoryError] = []
        if src not in self._branches:
            faults.append(_error(UnknownBranchError, f"unknown branch {src!r}", branch=src))
        if dst in self._branches:
            faults.append(_error(BranchExistsError, f"branch {dst!r} exists", branch=dst))
        self._raise_if(faults)
        source = self._branches[src]
        self._branches[dst] = _BranchState(source.chain, source.version)

    def branch_end(self, branch: Branch) -> bool:
        self.last_faults = ()
        if self._branches.pop(branch, None) is None:
            return False
        self._collect_garbage()
        return True

    def branch_version(self, branch: Branch) -> int | None:
        """Not part of `KvDirectory`'s API: lets tests pick stale and fresh versions."""
        state = self._branches.get(branch)
        return None if state is None else state.version

    def branches(self) -> list[Branch]:
        """Not part of `KvDirectory`'s API: the live branch ids."""
        return list(self._branches)

    def paths(self) -> list[list[Hash]]:
        """Not part of `KvDirectory`'s API: the chain from a first page to each known block."""
        out: list[list[Hash]] = []
        for h in sorted(self._blocks):
            path = [h]
            parent = self._blocks[h].parent
            while parent is not None:
                path.append(parent)
                parent = self._blocks[parent].parent
            out.append(path[::-1])
        return out

    def refcount(self, h: Hash) -> int:
        faults: list[KvDirectoryError] = []
        self._check_hashes([h], faults)
        self._raise_if(faults)
        return self._count(h)

    def eviction_order(self, node: Node, tier: Tier, limit: int | None = None) -> list[Hash]:
        faults: list[KvDirectoryError] = []
        self._check_node(node, faults)
        self._check_tier(tier, faults)
        self._check_count(limit, "limit", faults)
        self._raise_if(faults)
        order = self._order(node, tier)
        return order if limit is None else order[:limit]

    def evict(self, node: Node, tier: Tier, n: int) -> list[Hash]:
        faults: list[KvDirectoryError] = []
        self._check_node(node, faults)
        self._check_tier(tier, faults)
        self._check_count(n, "n", faults)
        self._raise_if(faults)
        removed: list[Hash] = []
        while len(removed) < n:
            order = self._order(node, tier)
            if not order:
                break
            self._drop_place((node, tier), [order[0]])
            self._collect_garbage()
            removed.append(order[0])
        return removed

    def contains(self, h: Hash) -> bool:
        faults: list[KvDirectoryError] = []
        self._check_hashes([h], faults)
        self._raise_if(faults)
        return h in self._blocks

    def __contains__(self, h: object) -> bool:
        assert isinstance(h, int)
        return self.contains(h)

    def __len__(self) -> int:
        return len(self._blocks)

    def stats(self) -> dict[str, int]:
        """Every key of `KvDirectory.stats()` except `memory_bytes`."""
        locations = {t: sum(len(b) for (_, tt), b in self._held.items() if tt == t) for t in TIERS}
        return {
            "blocks": len(self._blocks),
            "placeholders": sum(1 for h in self._blocks if not self._holders(h)),
            "locations": locations["L1"] + locations["L2"],
            "locations_l1": locations["L1"],
            "locations_l2": locations["L2"],
            "nodes": len({n for n, _ in self._held}),
            "branches": len(self._branches),
            "candidates": sum(len(self._candidates(n, t)) for n, t in self._held),
        }
