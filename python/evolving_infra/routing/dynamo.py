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
    decode_blocks           = active_blocks + ceil(prompt_tokens / block_size)
    cost = prefill_load_scale · adjusted_prefill_blocks + decode_blocks

`active_blocks` is Dynamo's own load unit (`NodeLoad.active_blocks`): the prompt blocks of the
requests the router sent to the worker and has not seen leave, generated tokens not counted
(`router_track_output_blocks=false`, dynamo-kv-router 1.6.1 `src/scheduling/config.rs:828-831`;
`potential_decode_blocks`, `selector/mod.rs:256`). NOTE: with `router_assume_kv_reuse` Dynamo
does not count the request's blocks already active on the worker twice; here the request's
blocks are always added whole (a shared prefix of two branches in flight on one worker counts
twice), which can only make its prefill choice a little less sticky.

Device overlap is the leading prompt blocks in the node's L1, host overlap the further leading
blocks in its L2 (`l12 - l1`). Dynamo ships with no shared cache (`shared_cache_type` none,
docs/baselines.md §1b), so `count_shared_cache` is off by default; `dynamo-hicache` turns it on
(HiCache with a Mooncake store): shared blocks are the pool's leading blocks beyond the node's
own (`pool - l12`), credited x 0.5.
Disk tiers (x 0.25) do not exist in the simulator. `router_temperature` is 0 (Dynamo's
default): the argmin, equal costs broken uniformly at random (`selector/reference.rs:527-545`,
reservoir sampling with `fastrand`): here `random.Random(seed)` draws among the tied nodes
(sorted by id) whenever there is more than one, so a run is reproducible and the stateless
method and the index draw alike (`pick`).

Decode: disaggregated decode routing forces the overlap credit to 0, no KV reuse and no prefill
tracking (dynamo-llm 1.6.1 `src/kv_router/prefill_router/mod.rs:746-763`), so the cost reduces
to `decode_blocks` — the decode worker with the fewest active blocks once the request is added,
ties at random. Dynamo has no capacity filter by default (`active_decode_blocks_threshold` is
None), and none is applied here.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import numpy as np

from evolving_infra.routing.base import NodeLoad, Placement, RouteRequest
from evolving_infra.routing.common import candidates
from evolving_infra.routing.index import LoadIndex, keys, minima
from evolving_infra.types import Phase, blocks_for


def pick(tied: Sequence[int], rng: random.Random) -> int:
    """One of the tied nodes (ascending ids), uniformly; no draw when there is one."""
    return tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]


def cheapest(costs: Mapping[int, float], rng: random.Random) -> int:
    """The node of least cost, equal costs drawn among (`pick`, in id order)."""
    best = min(costs.values())
    return pick(sorted(n for n, c in costs.items() if c == best), rng)


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
        seed: int = 0,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self.block_size = block_size
        self.prefill_load_scale = prefill_load_scale
        self.overlap_score_credit = overlap_score_credit
        self.host_credit = host_credit
        self.shared_cache_multiplier = shared_cache_multiplier
        self.count_shared_cache = count_shared_cache
        self.rng = random.Random(seed)  # ties (router_temperature 0)

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
        decode = node.active_blocks + blocks_for(request.prompt_tokens, bs)
        return self.prefill_load_scale * adjusted + decode

    def costs(self, request: RouteRequest, nodes: Sequence[NodeLoad]) -> dict[int, float]:
        """Cost per accepting prefill node (what `choose_prefill` minimises)."""
        match = request.prefix()
        held = match.nodes
        pool = match.pool
        out: dict[int, float] = {}
        for n in candidates(nodes, "prefill"):
            l1, l12 = held.get(n.node, (0, 0))
            out[n.node] = self.cost(request, n, l1, l12, pool)
        return out

    def choose_prefill(self, request: RouteRequest, nodes: Sequence[NodeLoad]) -> Placement:
        return Placement.on(request, cheapest(self.costs(request, nodes), self.rng))

    def choose_decode(self, request: RouteRequest, nodes: Sequence[NodeLoad]) -> int:
        # The request's own blocks add the same to every worker: the fewest active blocks win.
        cands = candidates(nodes, "decode")
        best = min(n.active_blocks for n in cands)
        return pick([n.node for n in cands if n.active_blocks == best], self.rng)

    def index(self) -> DynamoIndex:
        return DynamoIndex(self)


class DynamoIndex(LoadIndex):
    """`DynamoRouter`'s choices kept up to date per node (`routing.index`).

    Prefill: a node that holds none of the prompt earns no credit, so its cost is
    `scale·(queued + prompt)/bs + active + ceil(prompt/bs)`. With scale 1, a power-of-two block
    size and no shared-cache credit that float is exact, `(queued + bs·active + ...)/bs`, so
    among such nodes the cost orders as the integer `queued + bs·active` does, whatever the
    prompt, and equal keys are equal costs: the best of them are the minima of a column, with the
    nodes the match names left out; those few get the formula (`DynamoRouter.cost`). The nodes
    at the least cost, in id order, are drawn from as in `choose_prefill`. Any other setting
    scans the views with the stateless method. Decode: the minima of the `active` column.
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
            return load.queued_prefill_tokens + self.router.block_size * load.active_blocks
        return load.active_blocks

    def _rebuild(self, phase: Phase, loads: list[NodeLoad]) -> None:
        col = np.array([self._key(phase, x) for x in loads], dtype=np.int64)
        if phase == "prefill":
            self._prefill = col
        else:
            self._decode = col

    def _write(self, phase: Phase, slot: int, load: NodeLoad) -> None:
        (self._prefill if phase == "prefill" else self._decode)[slot] = self._key(phase, load)

    def choose_prefill(self, request: RouteRequest) -> Placement:
        ids = self._need("prefill")
        r = self.router
        if not self.exact:
            return r.choose_prefill(request, self.members("prefill"))
        match = request.prefix()
        pool = match.pool
        slot = self._slot["prefill"]
        costs: dict[int, float] = {}
        held: list[int] = []
        for node, (l1, l12) in match.nodes.items():
            k = slot.get(node)
            if k is not None:
                held.append(k)
                costs[node] = r.cost(request, self.loads[node], l1, l12, pool)
        rest = minima(self._prefill, held)
        if rest:
            cost = r.cost(request, self.loads[ids[rest[0]]], 0, 0, pool)
            costs.update((ids[k], cost) for k in rest)
        return Placement.on(request, cheapest(costs, r.rng))

    def choose_decode(self, request: RouteRequest) -> int:
        ids = self._need("decode")
        return pick([ids[k] for k in minima(self._decode, [])], self.router.rng)
