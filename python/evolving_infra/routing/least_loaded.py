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

from evolving_infra._core import KvDirectory
from evolving_infra.routing.base import NodeLoad, RouteRequest
from evolving_infra.routing.common import candidates, decode_blocks_needed, free_blocks


class LeastLoadedRouter:
    """Fewest queued prefill tokens for prefill; fewest running requests (that fit) for decode."""

    name = "least-loaded"

    def __init__(self, *, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self.block_size = block_size

    def choose_prefill(
        self, request: RouteRequest, nodes: Sequence[NodeLoad], directory: KvDirectory
    ) -> int:
        best = min(candidates(nodes, "prefill"), key=lambda n: (n.queued_prefill_tokens, n.node))
        return best.node

    def choose_decode(
        self, request: RouteRequest, nodes: Sequence[NodeLoad], directory: KvDirectory
    ) -> int:
        cands = candidates(nodes, "decode")
        need = decode_blocks_needed(request, self.block_size)
        fitting = [n for n in cands if free_blocks(n) >= need]
        if not fitting:
            return min(cands, key=lambda n: (-free_blocks(n), n.decode_requests, n.node)).node
        best = min(fitting, key=lambda n: (n.decode_requests, n.kv_used_blocks, n.node))
        return best.node
