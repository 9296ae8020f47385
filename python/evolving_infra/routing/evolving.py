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

from evolving_infra._core import KvDirectory
from evolving_infra.routing.base import NodeLoad, RouteRequest
from evolving_infra.routing.common import candidates, most_free_decode
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.ttft import (
    DEFAULT_L2_BANDWIDTH,
    DEFAULT_POOL_BANDWIDTH,
    TTFTPredictor,
    observe_bandwidth,
)

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

    def predict_prefill(
        self, request: RouteRequest, nodes: Sequence[NodeLoad], directory: KvDirectory
    ) -> tuple[int, float]:
        """The accepting prefill node with the least predicted TTFT, and that TTFT in seconds
        (ties: lowest node id)."""
        cands = candidates(nodes, "prefill")
        pred = self._predictor(tuple(n.node for n in cands))
        # NOTE: written straight into the predictor's array (aligned with the sorted ids) rather
        # than through `set_queue`, which validates and looks up one node at a time.
        q = pred.queue
        for k, n in enumerate(cands):
            q[k] = n.queued_prefill_s if n.queued_prefill_s > 0 else 0.0
        return pred.choose(directory.match(request.hashes), max(request.prompt_tokens, 1))

    def choose_prefill(
        self, request: RouteRequest, nodes: Sequence[NodeLoad], directory: KvDirectory
    ) -> int:
        return self.predict_prefill(request, nodes, directory)[0]

    def observe_fetch(self, path: Literal["l2", "pool"], nbytes: int, seconds: float) -> None:
        """A measured L2 (`l2`) or shared-pool (`pool`) to GPU transfer: same moving average as
        `TTFTPredictor.observe_fetch`, applied to the estimate every predictor shares."""
        observe_bandwidth(self.bandwidth, path, nbytes, seconds)

    def _predictor(self, key: tuple[int, ...]) -> TTFTPredictor:
        pred = self._predictors.get(key)
        if pred is None:
            pred = TTFTPredictor(
                self.model,
                key,
                block_size=self.block_size,
                kv_bytes_per_token=self.kv_bytes_per_token,
            )
            pred.bandwidth = self.bandwidth
            self._predictors[key] = pred
            if len(self._predictors) > PREDICTOR_CACHE:
                self._predictors.popitem(last=False)
        else:
            self._predictors.move_to_end(key)
        return pred

    # -- decode -------------------------------------------------------------------------------

    def choose_decode(
        self, request: RouteRequest, nodes: Sequence[NodeLoad], directory: KvDirectory
    ) -> int:
        return most_free_decode(request, nodes, self.block_size)
