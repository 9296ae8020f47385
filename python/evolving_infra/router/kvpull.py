"""Moving a prompt's cached prefix to the prefill engine chosen for it, from the node that holds
more of it (EngineControl `TransferKV`, DESIGN §1).

The simulator's prefill nodes use whatever prefix the cluster holds: their own L1/L2, the shared
pool, and other nodes' L1/L2 over the network, fetched while the request waits
(`nodemodel.node.Node.reach`). A live engine sees only its own tiers and, with a pool, what is in
Mooncake: another node's GPU memory is reached only if someone moves it. The router's directory
knows where every block is, so before it dispatches a prefill it asks the chosen engine to pull
the longest prefix another node holds, when that is longer than the engine's own (`best_source`).
Without this the live system recomputed whole prompts the simulator found cached (a branch's
next turn on the other prefill node: 21k of 29k tokens recomputed), and its TTFT and lost reuse
lagged the simulator's on the same workload (`evolving-infra parity`).

A pull that fails (an engine without TransferKV, such as the SGLang backend, a timeout, blocks
gone meanwhile) costs only its time: the prefill then computes what it lacks, as it would have.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from evolving_infra._core import PrefixMatch
from evolving_infra.control.client import EngineClient
from evolving_infra.control.errors import EngineControlError
from evolving_infra.control.records import KvLocation
from evolving_infra.nodemodel.kv import KvTier

log = structlog.get_logger("evolving_infra.router.kvpull")

PULL_TIMEOUT_S = 10.0  # a pull slower than this is not worth waiting for: the prefill computes


@dataclass(frozen=True, slots=True)
class Pull:
    """Where to pull a prompt's prefix from: `blocks` leading blocks held in `tier` of `source`."""

    source: int
    tier: KvTier  # "L1" (GPU memory) or "L2" (host memory)
    blocks: int


def best_source(match: PrefixMatch, dest: int, own: int) -> Pull | None:
    """The node (not `dest`) holding the longest leading run of the prompt, if longer than the
    `own` blocks `dest` holds already; from its GPU memory when that holds all of it."""
    best: Pull | None = None
    for node, (l1, l12) in match.nodes.items():
        if node != dest and l12 > own and (best is None or l12 > best.blocks):
            best = Pull(node, "L1" if l1 >= l12 else "L2", l12)
    return best


class KvPuller(Protocol):
    """Moves `pull.blocks` leading blocks of `hashes` into `dest`'s L1; returns blocks moved."""

    async def pull(self, dest: int, pull: Pull, hashes: Sequence[int]) -> int: ...


@dataclass
class ControlPuller:
    """`KvPuller` over the engines' EngineControl clients (node -> client, the daemon's map, which
    grows as engines join). Never raises: a failed pull is counted and logged."""

    clients: Mapping[int, EngineClient]
    timeout_s: float = PULL_TIMEOUT_S
    counts: dict[str, int] = field(default_factory=lambda: {"ok": 0, "failed": 0, "blocks": 0})

    async def pull(self, dest: int, pull: Pull, hashes: Sequence[int]) -> int:
        client = self.clients.get(dest)
        if client is None:
            self.counts["failed"] += 1
            return 0
        try:
            result = await client.transfer_kv(
                KvLocation(pull.tier, pull.source),
                KvLocation("L1", dest),
                hashes[: pull.blocks],
                allow_partial=True,
                timeout=self.timeout_s,
            )
        except EngineControlError as e:
            self.counts["failed"] += 1
            log.debug("kv_pull_failed", dest=dest, source=pull.source, error=str(e))
            return 0
        self.counts["ok"] += 1
        self.counts["blocks"] += result.blocks_moved
        return result.blocks_moved
