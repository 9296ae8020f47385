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

The engine answers the pull once the move has begun (`answer_when_started`): the blocks are
held there from then on, and a prefill there waits until they are in. The router sends the
prefill right after, so the move overlaps the prefill's wait in the engine's queue, as the
simulator's fetch overlaps it. (Before, the router awaited the whole move and only then sent
the prefill: a pulled request waited for the move and then for the queue, ~0.1 s more than
the simulator at the median TTFT of parity's workload.)

A pull is asked for only when it pays: its predicted seconds (`ControlPuller.cost_s`, a line
a + b x blocks fitted online to the pulls so far: the call's round trip and the move), less
the prefill's predicted wait in the queue, which the move overlaps, must be under the prefill
seconds it saves. The simulator's fetch has no round trip; here one costs ~15 ms on a loaded
machine, more than computing the few blocks of a previous answer that the decode node alone
holds (most pulls before this rule: parity, 2-core VM).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
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
# The pull-time fit: its weights decay by this much a pull (it follows the machine's load), and
# it predicts only once this many pulls have been seen (before that every pull is asked for).
COST_DECAY = 0.98
COST_MIN_PULLS = 5


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

    def cost_s(self, blocks: int) -> float | None:
        """Predicted seconds of a pull of `blocks` new blocks; None while unknown."""
        ...

    def skipped(self) -> None:
        """A pull was not asked for: it would have cost more than it saves."""
        ...


@dataclass
class PullCost:
    """Seconds of a pull as a + b x blocks, least squares over the pulls seen, older ones
    weighing less (`COST_DECAY`)."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    seen: int = 0

    def add(self, blocks: int, seconds: float) -> None:
        d = COST_DECAY
        self.n = self.n * d + 1
        self.sx = self.sx * d + blocks
        self.sy = self.sy * d + seconds
        self.sxx = self.sxx * d + blocks * blocks
        self.sxy = self.sxy * d + blocks * seconds
        self.seen += 1

    def predict(self, blocks: int) -> float | None:
        if self.seen < COST_MIN_PULLS:
            return None
        mean_x, mean_y = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mean_x * mean_x
        # All pulls of one size so far, or a slope the noise made negative: the mean.
        slope = max((self.sxy / self.n - mean_x * mean_y) / var, 0.0) if var > 1e-9 else 0.0
        return max(mean_y + slope * (blocks - mean_x), 0.0)


@dataclass
class ControlPuller:
    """`KvPuller` over the engines' EngineControl clients (node -> client, the daemon's map, which
    grows as engines join). Never raises: a failed pull is counted and logged."""

    clients: Mapping[int, EngineClient]
    # A node's KV transfer address ("host:port", its PD bootstrap address), named in the
    # request so that the engine can ask the source itself (`KvLocation.address`).
    address: Callable[[int], str] = lambda node: ""
    timeout_s: float = PULL_TIMEOUT_S
    counts: dict[str, int] = field(
        default_factory=lambda: {"ok": 0, "failed": 0, "skipped": 0, "blocks": 0}
    )
    cost: PullCost = field(default_factory=PullCost)

    def cost_s(self, blocks: int) -> float | None:
        return self.cost.predict(blocks)

    def skipped(self) -> None:
        self.counts["skipped"] += 1

    async def pull(self, dest: int, pull: Pull, hashes: Sequence[int]) -> int:
        client = self.clients.get(dest)
        if client is None:
            self.counts["failed"] += 1
            return 0
        started = time.monotonic()
        try:
            result = await client.transfer_kv(
                KvLocation(pull.tier, pull.source, self.address(pull.source)),
                KvLocation("L1", dest),
                hashes[: pull.blocks],
                allow_partial=True,
                # The prefill is sent once the move has begun and waits for it at the engine,
                # so the move overlaps its wait in the queue, as the simulator's fetch does.
                answer_when_started=True,
                timeout=self.timeout_s,
            )
        except EngineControlError as e:
            self.counts["failed"] += 1
            log.debug("kv_pull_failed", dest=dest, source=pull.source, error=str(e))
            return 0
        self.counts["ok"] += 1
        self.counts["blocks"] += result.blocks_moved
        # The pull's seconds: the call, and the move the engine reported it would take.
        self.cost.add(result.blocks_moved, time.monotonic() - started + result.seconds)
        return result.blocks_moved
