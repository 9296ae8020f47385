"""One node's memory and links: how many KV blocks its GPU (L1) and host memory (L2) hold, and
how fast KV moves between nodes and from host memory.

A node is `Deployment.tp` GPUs; its KV is sharded over them (or, with MLA, a copy on each), and
each GPU moves its own share at the per-GPU bandwidth, so a node's bandwidth is `tp` times it.
The simulator's cluster (`sim.config.SimConfig`) and the simulated engine
(`engines.sim.core.EngineSettings`) both size their nodes from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from evolving_infra.timing.specs import (
    ACTIVATION_RESERVE_PER_GPU,
    DEFAULT_DEPLOYMENT,
    MEM_FRACTION,
    Deployment,
)
from evolving_infra.timing.ttft import DEFAULT_L2_BANDWIDTH, DEFAULT_POOL_BANDWIDTH

# 1 TiB of host memory per 8-GPU server (docs/simulator.md), shared pro rata by its nodes.
HOST_MEMORY_PER_GPU = 2**40 / 8


@dataclass(frozen=True, slots=True)
class NodeHardware:
    """A node of `deployment`: capacities and bandwidths (module docstring).

    Defaults, the TTFT predictor's assumptions (timing/ttft.py): one 200 Gb/s RDMA NIC per GPU
    (~25 GB/s) carries P->D transfers, reads of another node's L1 and of the shared pool (other
    nodes' L2); host memory -> GPU over PCIe Gen5 x16 reaches ~50 GB/s.
    """

    deployment: Deployment = DEFAULT_DEPLOYMENT
    net_bandwidth_per_gpu: float = DEFAULT_POOL_BANDWIDTH
    l2_bandwidth_per_gpu: float = DEFAULT_L2_BANDWIDTH
    host_memory_per_gpu: float = HOST_MEMORY_PER_GPU  # bytes of L2 per GPU (0: no L2)
    mem_fraction: float = MEM_FRACTION
    activation_reserve_per_gpu: float = ACTIVATION_RESERVE_PER_GPU

    def __post_init__(self) -> None:
        if self.l1_bytes <= 0:
            raise ValueError("the model's weights leave no GPU memory for KV")

    @property
    def pd_bandwidth(self) -> float:
        """Bytes/s of a P->D transfer, or of a read of another node's L1."""
        return self.net_bandwidth_per_gpu * self.deployment.tp

    @property
    def pool_bandwidth(self) -> float:
        """Bytes/s of a read from another node's L2 (the shared pool)."""
        return self.net_bandwidth_per_gpu * self.deployment.tp

    @property
    def l2_bandwidth(self) -> float:
        """Bytes/s from the node's own host memory to its GPUs."""
        return self.l2_bandwidth_per_gpu * self.deployment.tp

    @property
    def kv_bytes_per_token(self) -> int:
        """Node memory one cached token takes (`Deployment.kv_bytes_per_token`: MLA's latent
        on every GPU). Capacities divide by it; transfers and host-memory loads move it, each
        GPU its own copy or shard at the per-GPU bandwidth, so a node's time is it over the
        node's bandwidth."""
        return round(self.deployment.kv_bytes_per_token)

    @property
    def l1_bytes(self) -> float:
        return self.deployment.kv_bytes(self.mem_fraction, self.activation_reserve_per_gpu)

    def block_bytes(self, block_size: int) -> int:
        return block_size * self.kv_bytes_per_token

    def l1_blocks(self, block_size: int) -> int:
        return int(self.l1_bytes // self.block_bytes(block_size))

    def l2_blocks(self, block_size: int) -> int:
        return int(self.host_memory_per_gpu * self.deployment.tp // self.block_bytes(block_size))
