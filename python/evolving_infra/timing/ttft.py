"""Predicted time to first token of a request on every candidate node (DESIGN §3).

TTFT on node n = max(queue_n, fetch_n) + prefill(uncached_n, cached_n):
- `queue_n`: the predicted drain time of the prefill work already queued on n (the caller keeps
  it up to date from the same iteration-time model);
- the cached prefix is what the directory's match says: blocks in n's L1 are free; blocks in
  n's L2 (host memory) and blocks n lacks but the shared pool holds (some node's L2) must be
  fetched into GPU memory first, which overlaps the queue wait — hence the max;
- `prefill` is the fitted `IterationModel` for one request with that cached prefix.

Fetch bandwidths start from stated defaults and follow measured transfers (an exponential moving
average of observed bytes/seconds). Blocks held only in other nodes' L1 are not counted: moving
them is a KV transfer the router decides separately.

`predict` and `choose` evaluate every candidate in one native call (`PrefixMatch.ttft`, Rust
`kvdir::scoring`): a decision for 64 nodes costs about a microsecond beyond the match.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from evolving_infra._core import PrefixMatch
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.samples import TimingError

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# Assumptions until transfers are measured: host memory to GPU over PCIe Gen5 x16 reaches ~50 GB/s
# per GPU in practice; the shared pool comes over a 200 Gb/s RDMA NIC (~25 GB/s), as Mooncake runs.
DEFAULT_L2_BANDWIDTH = 50e9
DEFAULT_POOL_BANDWIDTH = 25e9
# Weight of a new bandwidth measurement in the moving average.
BANDWIDTH_EWMA = 0.2


def observe_bandwidth(
    bandwidth: dict[str, float], path: Literal["l2", "pool"], nbytes: int, seconds: float
) -> None:
    """Moves the estimate of `path` in `bandwidth` toward one measured transfer (an EWMA)."""
    if path not in bandwidth:
        raise TimingError(f"unknown fetch path {path!r} (l2 or pool)")
    if nbytes <= 0 or not math.isfinite(seconds) or seconds <= 0:
        raise TimingError(f"a transfer needs bytes > 0 and seconds > 0, got {nbytes}, {seconds}")
    bw = bandwidth[path]
    bandwidth[path] = (1 - BANDWIDTH_EWMA) * bw + BANDWIDTH_EWMA * (nbytes / seconds)


class TTFTPredictor:
    """Per-node TTFT for a request, from a directory match, queue drain times and the model."""

    def __init__(
        self,
        model: IterationModel,
        nodes: Sequence[int],
        *,
        block_size: int,
        kv_bytes_per_token: int,
        l2_bandwidth: float = DEFAULT_L2_BANDWIDTH,
        pool_bandwidth: float = DEFAULT_POOL_BANDWIDTH,
    ) -> None:
        if not nodes:
            raise TimingError("a TTFT predictor needs at least one candidate node")
        if len(set(nodes)) != len(nodes) or min(nodes) < 0:
            raise TimingError("candidate nodes must be distinct ints >= 0")
        if block_size <= 0 or kv_bytes_per_token <= 0:
            raise TimingError("block_size and kv_bytes_per_token must be > 0")
        self.model = model
        self.nodes: IntArray = np.asarray(nodes, dtype=np.int64)
        self.block_size = block_size
        self.block_bytes = float(block_size * kv_bytes_per_token)
        self.bandwidth = {"l2": float(l2_bandwidth), "pool": float(pool_bandwidth)}
        # Seconds of queued prefill per candidate, aligned with `nodes`; the router sets it.
        self.queue: FloatArray = np.zeros(len(nodes))
        self._out: FloatArray = np.empty(len(nodes))
        # Node id -> position in `nodes`; matched nodes that are not candidates (decode nodes)
        # land on a sentinel slot past the end, whose queue is infinite.
        self._slot: IntArray = np.full(int(self.nodes.max()) + 1, len(nodes), dtype=np.int64)
        self._slot[self.nodes] = np.arange(len(nodes))

    def set_queue(self, node: int, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            raise TimingError(f"queue drain time must be finite and >= 0, got {seconds}")
        self.queue[self._index(node)] = seconds

    def observe_fetch(self, path: Literal["l2", "pool"], nbytes: int, seconds: float) -> None:
        """A measured transfer of `nbytes` from L2 (`l2`) or the shared pool (`pool`) to GPU."""
        observe_bandwidth(self.bandwidth, path, nbytes, seconds)

    def predict(self, match: PrefixMatch, prompt_tokens: int) -> FloatArray:
        """Predicted TTFT in seconds on each candidate node, aligned with `nodes`."""
        self._score(match, prompt_tokens)
        return self._out.copy()

    def choose(self, match: PrefixMatch, prompt_tokens: int) -> tuple[int, float]:
        """The candidate with the least predicted TTFT (ties: the first listed), and that TTFT."""
        k = self._score(match, prompt_tokens)
        return int(self.nodes[k]), float(self._out[k])

    def _score(self, match: PrefixMatch, prompt_tokens: int) -> int:
        if prompt_tokens <= 0:
            raise TimingError(f"a request has at least one prompt token, got {prompt_tokens}")
        # NOTE: the arithmetic runs in Rust (`kvdir::scoring`) over every node in one call: as
        # numpy expressions it took ~20 array operations of a microsecond each per decision.
        return match.ttft(
            prompt_tokens,
            self.block_size,
            self.model.prefill_form(),
            self.block_bytes / self.bandwidth["l2"],
            self.block_bytes / self.bandwidth["pool"],
            self._slot,
            self.queue,
            self._out,
        )

    def _index(self, node: int) -> int:
        if not 0 <= node < len(self._slot) or self._slot[node] == len(self.nodes):
            raise TimingError(f"node {node} is not a candidate")
        return int(self._slot[node])
