"""The `dynamo` router: NVIDIA Dynamo's KV-router cost, lowest wins (temperature 0).

Source: ai-dynamo/dynamo `docs/components/router/router-concepts.md` (commit 03037af0…) and the
1.6.1 wheel's `KvRouterConfig` defaults (the project's notes on Dynamo's router, §2.7), with
the block arithmetic of `lib/kv-router/src/scheduling/selector.rs` (prefill load in tokens
divided by the block size as a float; the request's own blocks rounded up, `isl.div_ceil`):

    raw_prefill_blocks      = (active_prefill_tokens + prompt_tokens) / block_size
    overlap_credit_blocks   = device_overlap · overlap_score_credit (1.0)
                            + host_overlap · host_credit (0.75)
                            + shared_beyond · shared_cache_multiplier (0.5)
    adjusted_prefill_blocks = max(raw_prefill_blocks - overlap_credit_blocks, 0)
    decode_blocks           = active_decode_blocks + ceil(prompt_tokens / block_size)
    cost = prefill_load_scale · adjusted_prefill_blocks + decode_blocks

Device overlap is the leading prompt blocks in the node's L1, host overlap the further leading
blocks in its L2 (`l12 - l1`). Dynamo's `dynamo` policy in the simulator has no shared cache
(its KVBM tiers are per worker, docs/simulator.md), so `count_shared_cache` is off by default;
when on, shared blocks are the pool's leading blocks beyond the node's own (`pool - l12`).
Disk tiers (x 0.25) do not exist in the simulator. `router_temperature` is 0 (Dynamo's
default): argmin, ties to the lowest node id, no sampling.

Decode: in disaggregated serving the decode worker computes no prefill (the KV arrives by
transfer), so the prefill term carries no information there and overlap earns no credit; the
cost reduces to `decode_blocks` — the decode worker with the fewest active blocks once the
request is added, i.e. Dynamo's least-loaded decode worker in its own load unit (ties: fewer
running requests, then lowest id). Dynamo has no capacity filter by default
(`active_decode_blocks_threshold` is None), and none is applied here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from evolving_infra._core import KvDirectory, PrefixMatch
from evolving_infra.routing.base import NodeLoad, Phase, RouteRequest
from evolving_infra.routing.common import blocks_for, candidates
from evolving_infra.routing.index import SHIFT, LoadIndex, first_masked, keys


class DynamoRouter:
    """Dynamo's linear KV-router cost over accepting prefill nodes; fewest blocks for decode."""

    name = "dynamo"

    def __init__(
        self,
        *,
        block_size: int,
        prefill_load_scale: float = 1.0,
        overlap_score_credit: float = 1.0,
        host_credit: float = 0.75,
        shared_cache_multiplier: float = 0.5,
        count_shared_cache: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self.block_size = block_size
        self.prefill_load_scale = prefill_load_scale
        self.overlap_score_credit = overlap_score_credit
        self.host_credit = host_credit
        self.shared_cache_multiplier = shared_cache_multiplier
        self.count_shared_cache = count_shared_cache

    def cost(
        self, request: RouteRequest, node: NodeLoad, l1: int, l12: int, pool: int = 0
    ) -> float:
        """Dynamo's cost of placing `request` on `node`, which holds `l1` leading prompt blocks
        in device memory and `l12` in device or host memory (`pool`: leading blocks in the
        shared cache, credited only with `count_shared_cache`)."""
        bs = self.block_size
        raw = (node.queued_prefill_tokens + request.prompt_tokens) / bs
        credit = l1 * self.overlap_score_credit + (l12 - l1) * self.host_credit
        if self.count_shared_cache:
            credit += max(pool - l12, 0) * self.shared_cache_multiplier
        adjusted = max(raw - credit, 0.0)
        decode = node.kv_used_blocks + blocks_for(request.prompt_tokens, bs)
        return self.prefill_load_scale * adjusted + decode

    def costs(
        self, request: RouteRequest, nodes: Sequence[NodeLoad], directory: KvDirectory
    ) -> dict[int, float]:
        """Cost per accepting prefill node (what `choose_prefill` minimises)."""
        match = directory.match(request.hashes)
        held = match.nodes
        pool = match.pool
        out: dict[int, float] = {}
        for n in candidates(nodes, "prefill"):
            l1, l12 = held.get(n.node, (0, 0))
            out[n.node] = self.cost(request, n, l1, l12, pool)
        return out

    def choose_prefill(
        self, request: RouteRequest, nodes: Sequence[NodeLoad], directory: KvDirectory
    ) -> int:
        costs = self.costs(request, nodes, directory)
        return min(costs, key=lambda node: (costs[node], node))

    def choose_decode(
        self, request: RouteRequest, nodes: Sequence[NodeLoad], directory: KvDirectory
    ) -> int:
        incoming = blocks_for(request.prompt_tokens, self.block_size)
        best = min(
            candidates(nodes, "decode"),
            key=lambda n: (n.kv_used_blocks + incoming, n.decode_requests, n.node),
        )
        return best.node

    def index(self) -> DynamoIndex:
        return DynamoIndex(self)


class DynamoIndex(LoadIndex):
    """`DynamoRouter`'s choices kept up to date per node (`routing.index`).

    Prefill: a node that holds none of the prompt earns no credit, so its cost is
    `scale·(queued + prompt)/bs + used + ceil(prompt/bs)`. With scale 1, a power-of-two block
    size and no shared-cache credit that float is exact, `(queued + bs·used + ...)/bs`, so among
    such nodes the cost orders as the integer `queued + bs·used` does, whatever the prompt: the
    best of them is an argmin over a column, with the nodes the match names left out; those few
    get the formula (`DynamoRouter.cost`), and the least `(cost, node)` wins as in `costs`. Any
    other setting scans the views with the stateless method. Decode: argmin of the packed
    `(used, requests)` key (the request's own blocks add the same to every node).
    """

    def __init__(self, router: DynamoRouter) -> None:
        super().__init__()
        self.router = router
        bs = router.block_size
        self.exact = (
            router.prefill_load_scale == 1.0
            and not router.count_shared_cache
            and bs & (bs - 1) == 0
        )
        self._prefill = keys(0)
        self._decode = keys(0)

    def _key(self, phase: Phase, load: NodeLoad) -> int:
        if phase == "prefill":
            assert load.queued_prefill_tokens >= 0, "queued tokens are a count"
            return load.queued_prefill_tokens + self.router.block_size * load.kv_used_blocks
        return load.kv_used_blocks * SHIFT + load.decode_requests

    def _rebuild(self, phase: Phase, loads: list[NodeLoad]) -> None:
        col = np.array([self._key(phase, x) for x in loads], dtype=np.int64)
        if phase == "prefill":
            self._prefill = col
        else:
            self._decode = col

    def _write(self, phase: Phase, slot: int, load: NodeLoad) -> None:
        (self._prefill if phase == "prefill" else self._decode)[slot] = self._key(phase, load)

    def choose_prefill(
        self, request: RouteRequest, directory: KvDirectory, match: PrefixMatch | None = None
    ) -> int:
        ids = self._need("prefill")
        r = self.router
        if not self.exact:
            return r.choose_prefill(request, self.members("prefill"), directory)
        if match is None:
            match = directory.match(request.hashes)
        pool = match.pool
        slot = self._slot["prefill"]
        best: tuple[float, int] | None = None
        held: list[int] = []
        for node, (l1, l12) in match.nodes.items():
            k = slot.get(node)
            if k is not None:
                held.append(k)
                c = (r.cost(request, self.loads[node], l1, l12, pool), node)
                best = c if best is None or c < best else best
        k = first_masked(self._prefill, held) if held else int(self._prefill.argmin())
        if k >= 0:
            node = ids[k]
            c = (r.cost(request, self.loads[node], 0, 0, pool), node)
            best = c if best is None or c < best else best
        assert best is not None
        return best[1]

    def choose_decode(self, request: RouteRequest, directory: KvDirectory) -> int:
        return self._need("decode")[int(self._decode.argmin())]
