"""The `least-loaded` router (the `arrow` policy's routing): cache-blind load balancing.

Arrow (Wu et al. 2025, "Arrow: Adaptive Scheduling Mechanisms for Disaggregated LLM Inference
Architecture", arXiv 2505.11916) schedules requests by instance load without a KV-aware
router; the simulator's reading of that (docs/simulator.md, policies table):

- prefill: the accepting prefill node with the fewest queued uncached prompt tokens (the work
  it still has to do), ties to the lowest id;
- decode: the accepting decode node with the fewest running requests among those whose free
  KV blocks can hold the request (prompt + expected output), ties by fewer used blocks, then
  lowest id; if none can, the one with the most free blocks. The capacity filter is an
  assumption: any engine's admission control refuses a request whose KV does not fit, so a
  router that ignored it would only queue the request on a full node.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from evolving_infra.routing.base import NodeLoad, Placement, RouteRequest
from evolving_infra.routing.common import candidates, decode_blocks_needed, free_blocks
from evolving_infra.routing.index import NO_KEY, SHIFT, LoadIndex, keys, most_free_key
from evolving_infra.types import Phase


class LeastLoadedRouter:
    """Fewest queued prefill tokens for prefill; fewest running requests (that fit) for decode."""

    name = "least-loaded"

    def __init__(self, *, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self.block_size = block_size

    def choose_prefill(self, request: RouteRequest, nodes: Sequence[NodeLoad]) -> Placement:
        best = min(candidates(nodes, "prefill"), key=lambda n: (n.queued_prefill_tokens, n.node))
        return Placement.on(request, best.node)

    def choose_decode(self, request: RouteRequest, nodes: Sequence[NodeLoad]) -> int:
        cands = candidates(nodes, "decode")
        need = decode_blocks_needed(request, self.block_size)
        fitting = [n for n in cands if free_blocks(n) >= need]
        if not fitting:
            return min(cands, key=lambda n: (-free_blocks(n), n.decode_requests, n.node)).node
        best = min(fitting, key=lambda n: (n.decode_requests, n.kv_used_blocks, n.node))
        return best.node

    def index(self) -> LeastLoadedIndex:
        return LeastLoadedIndex(self)


class LeastLoadedIndex(LoadIndex):
    """`LeastLoadedRouter`'s choices kept up to date per node (`routing.index`): argmin of the
    queued tokens for prefill; for decode, free blocks per node, the packed `(requests, used)`
    key among the nodes that fit, and the packed `(-free, requests)` key when none does."""

    def __init__(self, router: LeastLoadedRouter) -> None:
        super().__init__()
        self.router = router
        self._queued = keys(0)
        self._free = keys(0)
        self._fit = keys(0)
        self._most_free = keys(0)

    def _rebuild(self, phase: Phase, loads: list[NodeLoad]) -> None:
        n = len(loads)
        if phase == "prefill":
            self._queued = keys(n)
        else:
            self._free, self._fit, self._most_free = keys(n), keys(n), keys(n)
        for k, x in enumerate(loads):
            self._write(phase, k, x)

    def _write(self, phase: Phase, slot: int, load: NodeLoad) -> None:
        if phase == "prefill":
            self._queued[slot] = load.queued_prefill_tokens
            return
        self._free[slot] = free_blocks(load)
        self._fit[slot] = load.decode_requests * SHIFT + load.kv_used_blocks
        self._most_free[slot] = most_free_key(load)

    def choose_prefill(self, request: RouteRequest) -> Placement:
        return Placement.on(request, self._need("prefill")[int(self._queued.argmin())])

    def choose_decode(self, request: RouteRequest) -> int:
        ids = self._need("decode")
        need = decode_blocks_needed(request, self.router.block_size)
        fits = self._free >= need
        if not fits.any():
            return ids[int(self._most_free.argmin())]
        return ids[int(np.where(fits, self._fit, NO_KEY).argmin())]
