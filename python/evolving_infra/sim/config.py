"""The simulator's parameters, with their defaults and where each figure comes from.

Capacities follow docs/simulator.md ("Nodes and KV"): a node of `tp` GPUs keeps
`tp · HBM · mem_fraction - weights - tp · activation reserve` bytes of KV in GPU memory (L1), in
pages of `block_size` tokens (the trace's block size, as SGLang's page), and `host_memory_per_gpu
· tp` bytes in host memory (L2). Bandwidths are given per GPU and scale with `tp`. Every figure
marked "assumption" is one: the comparisons between policies hold them fixed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from evolving_infra.nodemodel.hardware import HOST_MEMORY_PER_GPU, NodeHardware
from evolving_infra.planner import options
from evolving_infra.planner.base import Split
from evolving_infra.planner.options import Option
from evolving_infra.timing.specs import (
    ACTIVATION_RESERVE_PER_GPU,
    DEFAULT_DEPLOYMENT,
    MEM_FRACTION,
    Deployment,
    deployment_name,
)
from evolving_infra.timing.ttft import DEFAULT_L2_BANDWIDTH, DEFAULT_POOL_BANDWIDTH

DecodeAllocation = Literal["prefill_complete", "early"]
DECODE_ALLOCATIONS: tuple[DecodeAllocation, ...] = ("prefill_complete", "early")


# The paper's figures for a phase switch: 6.2 s in place, ~700 s for Dynamo's restart. The
# restart is the high end: Dynamo's docs give ~60 s for a cold start and ~10 s for a restore from
# a snapshot (docs/baselines.md, §5); `sim --restart-s` sets it.
SWITCH_IN_PLACE_S = 6.2
SWITCH_RESTART_S = 700.0


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated cluster; `nodes = gpus / tp`."""

    gpus: int = 36
    deployment: Deployment = DEFAULT_DEPLOYMENT  # model, GPU and tp (tp: GPUs per node)
    block_size: int | None = None  # tokens per KV page; None: the trace's block size
    # SGLang's default `chunked_prefill_size`: the token budget of one prefill iteration.
    chunk_tokens: int = 8192
    # KV transfers, bytes/s per GPU; a node's figure is `tp` times these (`NodeHardware`,
    # whose defaults these are).
    net_bandwidth_per_gpu: float = DEFAULT_POOL_BANDWIDTH
    l2_bandwidth_per_gpu: float = DEFAULT_L2_BANDWIDTH
    transfer_latency: float = 1e-3  # seconds per KV transfer: RDMA setup and handshake
    host_memory_per_gpu: float = HOST_MEMORY_PER_GPU  # bytes of L2 per GPU (0: no L2)
    # The shared pool (policies with one) as a key-value store keeping one copy of a block: a
    # node demoting a block another node's L2 holds keeps none (`NodeKv.pooled`). Off: every
    # node's L2 keeps its copies, which the others read (HiCache's per-node host tier). A
    # sensitivity, not a default: docs/scenarios.md, "one copy in the pool".
    pool_one_copy: bool = False
    mem_fraction: float = MEM_FRACTION
    activation_reserve_per_gpu: float = ACTIVATION_RESERVE_PER_GPU
    # Phase switches (docs/simulator.md): in place 6.2 s, a restart 700 s.
    switch_in_place_s: float = SWITCH_IN_PLACE_S
    switch_restart_s: float = SWITCH_RESTART_S
    # When a decode node reserves a request's KV (SGLang's `--disaggregation-decode-allocation-
    # policy`): "prefill_complete" once the prefill is done, which keeps the prompt's KV pinned
    # on the prefill node until a decode node has room; "early" (SGLang 0.5.23's default) at
    # dispatch, and the prefill waits for it (SGLang's bootstrap queue), so a saturated decode
    # side leaves prefill nodes idle rather than their caches full of pinned KV. The engines
    # of the live system run SGLang's default, hence the default here (docs/scenarios.md,
    # cc-high, for what the choice changes).
    decode_allocation: DecodeAllocation = "early"
    planner_interval: float | None = None  # None: the planner's own `interval`
    planner_window_s: float = 600.0  # slices handed to the planner: those of this past
    # The evolving planner's settings (`planner.options`: `sim --planner-option NAME=VALUE`);
    # a `window_s` longer than `planner_window_s` is handed that many slices.
    planner_options: tuple[Option, ...] = ()
    metrics_interval: float = 60.0  # one timeline point per simulated minute
    sample_interval: float = 1.0  # node state (batch, queue, KV use) is sampled this often
    decode_span_cap: int = 64  # iterations a decode span may cover at most
    # The policies' iteration model keeps ~2,000 samples over 10 minutes (timing/model.py):
    # observing more than a few iterations per second per phase only churns its window, and
    # each observation costs ~0.1 ms, so iterations are observed at most this often.
    observe_per_s: float = 2.0
    noise: float = 0.02  # lognormal sigma of the ground truth's iteration times
    initial_split: Split | None = None  # None: half the nodes prefill (rounded down, >= 1)
    # A request whose prompt and output exceed this many tokens is rejected, as the live router
    # answers `400 context_length_exceeded` past the model's context length. None: only a
    # node's KV bounds a request (what the scenarios' results were made with).
    context_length: int | None = None
    seed: int = 0
    duration: float | None = None  # simulated seconds; None: until every request completes
    # Safety net when `duration` is None: a run never goes past this simulated time.
    max_time: float = 30 * 24 * 3600.0
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes kept in results

    def __post_init__(self) -> None:
        tp = self.deployment.tp
        if self.gpus < 2 * tp or self.gpus % tp:
            raise ValueError(f"gpus ({self.gpus}) must be a multiple of tp ({tp}), >= 2 nodes")
        if self.decode_allocation not in DECODE_ALLOCATIONS:
            raise ValueError(
                f"decode_allocation must be one of {', '.join(DECODE_ALLOCATIONS)},"
                f" got {self.decode_allocation!r}"
            )
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {self.context_length}")
        if self.chunk_tokens < 1 or self.decode_span_cap < 1:
            raise ValueError("chunk_tokens and decode_span_cap must be >= 1")
        for name in ("net_bandwidth_per_gpu", "l2_bandwidth_per_gpu", "sample_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.duration is not None and not (self.duration > 0 and math.isfinite(self.duration)):
            raise ValueError(
                f"duration must be a finite number of seconds > 0, got {self.duration}"
            )
        if self.initial_split is not None:
            s = self.initial_split
            if s.prefill < 1 or s.decode < 1 or s.prefill + s.decode != self.nodes:
                raise ValueError(f"initial split {s} is not a split of {self.nodes} nodes")
        _ = self.hardware  # `NodeHardware` raises when the weights leave no memory for KV
        if self.planner_options:
            try:  # the planner's checks, before a run
                options.settings(self.planner_options, self.nodes)
            except ValueError as e:
                raise ValueError(f"the evolving planner refuses its options: {e}") from None

    @property
    def evolving_options(self) -> dict[str, Any]:
        """`planner_options` as the evolving planner's keyword arguments."""
        return options.check(self.planner_options)

    @property
    def slices_window_s(self) -> float:
        """How far back the slices handed to a planner reach."""
        window = self.evolving_options.get("window_s")
        return max(self.planner_window_s, window or 0.0)

    @property
    def nodes(self) -> int:
        return self.gpus // self.deployment.tp

    @property
    def hardware(self) -> NodeHardware:
        """Each node's capacities and bandwidths (`nodemodel.hardware`)."""
        return NodeHardware(
            deployment=self.deployment,
            net_bandwidth_per_gpu=self.net_bandwidth_per_gpu,
            l2_bandwidth_per_gpu=self.l2_bandwidth_per_gpu,
            host_memory_per_gpu=self.host_memory_per_gpu,
            mem_fraction=self.mem_fraction,
            activation_reserve_per_gpu=self.activation_reserve_per_gpu,
        )

    # The node figures the simulator reads (`NodeHardware`'s).
    @property
    def pd_bandwidth(self) -> float:
        return self.hardware.pd_bandwidth

    @property
    def pool_bandwidth(self) -> float:
        return self.hardware.pool_bandwidth

    @property
    def l2_bandwidth(self) -> float:
        return self.hardware.l2_bandwidth

    @property
    def kv_bytes_per_token(self) -> int:
        return self.hardware.kv_bytes_per_token

    @property
    def l1_bytes(self) -> float:
        return self.hardware.l1_bytes

    def block_bytes(self, block_size: int) -> int:
        return self.hardware.block_bytes(block_size)

    def l1_blocks(self, block_size: int) -> int:
        return self.hardware.l1_blocks(block_size)

    def l2_blocks(self, block_size: int) -> int:
        return self.hardware.l2_blocks(block_size)

    def split(self) -> Split:
        if self.initial_split is not None:
            return self.initial_split
        p = max(1, self.nodes // 2)
        return Split(p, self.nodes - p)

    def to_dict(self, block_size: int) -> dict[str, Any]:
        """JSON-ready parameters, with the derived capacities for `block_size`."""
        out = asdict(self)
        d = self.deployment
        out["deployment"] = {
            "name": deployment_name(d),
            "model": d.model.name,
            "gpu": d.gpu.name,
            "tp": d.tp,
            "mtp_draft_tokens": d.mtp_draft_tokens,
            "mtp_accepted": d.mtp_accepted,
        }
        out["initial_split"] = str(self.split())
        out["planner_options"] = self.evolving_options
        out["block_size"] = block_size
        out["nodes"] = self.nodes
        out["l1_blocks_per_node"] = self.l1_blocks(block_size)
        out["l2_blocks_per_node"] = self.l2_blocks(block_size)
        out["pd_bandwidth"] = self.pd_bandwidth
        out["pool_bandwidth"] = self.pool_bandwidth
        out["l2_bandwidth"] = self.l2_bandwidth
        return out
