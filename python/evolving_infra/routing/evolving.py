"""The `evolving` router: least predicted TTFT for prefill, most KV headroom for decode.

Prefill (DESIGN §3, "TTFT prediction and routing"): each accepting prefill node's TTFT is
`max(queue, fetch) + prefill(uncached, cached)` with the cached prefix the directory says the
node holds (L1 free; L2 and shared-pool blocks fetched while the request waits in the queue),
from `timing.TTFTPredictor`. The request goes to the least, not to the node with the longest
prefix: cache-greedy routing piles agents that share a prefix onto one node (P95 TTFT of
27-34 s in the paper, DESIGN §3), while the TTFT balance sends a request elsewhere as soon as
the cached node's queue costs more than the prefix saves.

Decode: the accepting decode node with the most free KV blocks that can hold the request
(prompt + expected output); see `common.most_free_decode`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

import numpy as np

from evolving_infra.routing.base import NodeLoad, Placement, RouteRequest
from evolving_infra.routing.common import candidates, most_free_decode
from evolving_infra.routing.index import LoadIndex, keys, most_free_key
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.ttft import (
    DEFAULT_L2_BANDWIDTH,
    DEFAULT_POOL_BANDWIDTH,
    TTFTPredictor,
    observe_bandwidth,
)
from evolving_infra.types import Phase

# Distinct prefill node sets kept: the set changes only at a phase switch or a node going down,
# so a handful covers a run; the bound only stops a pathological driver from leaking memory.
PREDICTOR_CACHE = 64


class EvolvingRouter:
    """Prefill by least predicted TTFT (`TTFTPredictor`), decode by most free KV blocks."""

    name = "evolving"

    def __init__(
        self,
        model: IterationModel,
        *,
        block_size: int,
        kv_bytes_per_token: int,
        l2_bandwidth: float = DEFAULT_L2_BANDWIDTH,
        pool_bandwidth: float = DEFAULT_POOL_BANDWIDTH,
    ) -> None:
        if block_size <= 0 or kv_bytes_per_token <= 0:
            raise ValueError("block_size and kv_bytes_per_token must be > 0")
        self.model = model
        self.block_size = block_size
        self.kv_bytes_per_token = kv_bytes_per_token
        # One bandwidth estimate for the whole cluster, shared by every predictor (they keep a
        # reference to this dict), so a measured fetch informs decisions on any node set.
        self.bandwidth: dict[str, float] = {
            "l2": float(l2_bandwidth),
            "pool": float(pool_bandwidth),
        }
        self._predictors: OrderedDict[tuple[int, ...], TTFTPredictor] = OrderedDict()

    # -- prefill ------------------------------------------------------------------------------

    def choose_prefill(self, request: RouteRequest, nodes: Sequence[NodeLoad]) -> Placement:
        """The accepting prefill node with the least predicted TTFT, and that TTFT in seconds
        (ties: lowest node id)."""
        cands = candidates(nodes, "prefill")
        pred = self._predictor(tuple(n.node for n in cands))
        # NOTE: written straight into the predictor's array (aligned with the sorted ids) rather
        # than through `set_queue`, which validates and looks up one node at a time.
        q = pred.queue
        for k, n in enumerate(cands):
            q[k] = n.queued_prefill_s if n.queued_prefill_s > 0 else 0.0
        node, ttft = pred.choose(request.prefix(), max(request.prompt_tokens, 1))
        return Placement.on(request, node, ttft)

    def observe_fetch(self, path: Literal["l2", "pool"], nbytes: int, seconds: float) -> None:
        """A measured L2 (`l2`) or shared-pool (`pool`) to GPU transfer: same moving average as
        `TTFTPredictor.observe_fetch`, applied to the estimate every predictor shares."""
        observe_bandwidth(self.bandwidth, path, nbytes, seconds)

    def _predictor(self, key: tuple[int, ...]) -> TTFTPredictor:
        pred = self._predictors.get(key)
        if pred is None:
            pred = self.new_predictor(key)
            self._predictors[key] = pred
            if len(self._predictors) > PREDICTOR_CACHE:
                self._predictors.popitem(last=False)
        else:
            self._predictors.move_to_end(key)
        return pred

    def new_predictor(self, nodes: Sequence[int]) -> TTFTPredictor:
        """A predictor over `nodes` that shares this router's bandwidth estimate."""
        pred = TTFTPredictor(
            self.model,
            nodes,
            block_size=self.block_size,
            kv_bytes_per_token=self.kv_bytes_per_token,
        )
        pred.bandwidth = self.bandwidth
        return pred

    # -- decode -------------------------------------------------------------------------------

    def choose_decode(self, request: RouteRequest, nodes: Sequence[NodeLoad]) -> int:
        return most_free_decode(request, nodes, self.block_size)

    def index(self) -> EvolvingIndex:
        return EvolvingIndex(self)


class EvolvingIndex(LoadIndex):
    """`EvolvingRouter`'s choices kept up to date per node (`routing.index`).

    Prefill: a predictor over the accepting prefill nodes whose queue array is written in place
    when a node's queue changes, so a choice is the match and one native TTFT scan (the same
    inputs as the stateless path, hence the same node). Decode: `most_free_decode` filters the
    nodes that fit and takes the most free, ties by fewer requests; but if any node fits, the
    most free one does, so the choice is the argmin of the packed `(-free, requests)` key over
    every accepting decode node.
    """

    def __init__(self, router: EvolvingRouter) -> None:
        super().__init__()
        self.router = router
        self._pred: TTFTPredictor | None = None
        self._decode = keys(0)

    def _rebuild(self, phase: Phase, loads: list[NodeLoad]) -> None:
        if phase == "prefill":
            self._pred = self.router.new_predictor([x.node for x in loads]) if loads else None
            for k, x in enumerate(loads):
                self._write(phase, k, x)
        else:
            self._decode = np.array([most_free_key(x) for x in loads], dtype=np.int64)

    def _write(self, phase: Phase, slot: int, load: NodeLoad) -> None:
        if phase == "prefill":
            assert self._pred is not None
            q = load.queued_prefill_s
            self._pred.queue[slot] = q if q > 0 else 0.0
        else:
            self._decode[slot] = most_free_key(load)

    def choose_prefill(self, request: RouteRequest) -> Placement:
        self._need("prefill")
        assert self._pred is not None
        node, ttft = self._pred.choose(request.prefix(), max(request.prompt_tokens, 1))
        return Placement.on(request, node, ttft)

    def choose_decode(self, request: RouteRequest) -> int:
        return self._need("decode")[int(self._decode.argmin())]
