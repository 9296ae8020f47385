"""Model configurations and GPU specifications: the numbers the roofline and the prior start from.

Model figures are the architectures' published `config.json` values; GPU figures are NVIDIA's
datasheet peaks (dense BF16 tensor-core FLOP/s without sparsity, HBM bandwidth, NVLink bandwidth
per GPU and direction). Peaks are not what kernels reach: the ground truth (`truth.py`) applies
efficiencies, the predictor learns what the hardware really does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder-only transformer (Llama architecture: GQA attention, SwiGLU MLP)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    bytes_per_param: int = 2  # BF16 weights
    bytes_per_kv: int = 2  # BF16 KV cache
    # The longest context an engine accepts (SGLang's `context_len`, from the model's
    # `max_position_embeddings`): Llama 3.1's 131,072, the version whose context holds the
    # traces' 100k-token prompts (Llama 3.0 had 8,192). Dynamo's planner scales prefill on
    # queued tokens per context length (docs/baselines.md, §1a).
    context_length: int = 131_072

    @property
    def linear_params_per_layer(self) -> int:
        """Weights every token multiplies through in one layer: Q, K, V, O and the MLP."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        return q_o + k_v + mlp

    @property
    def linear_params(self) -> int:
        return self.layers * self.linear_params_per_layer

    @property
    def head_params(self) -> int:
        """The LM head (vocab projection), run once per sequence in prefill, per token in decode."""
        return self.hidden * self.vocab

    @property
    def weight_bytes(self) -> int:
        # The embedding table is a lookup (a row per token), not read whole per iteration.
        return (self.linear_params + self.head_params) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_kv

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs per query-key pair over all layers: QK^T and PV, 2 FLOPs per multiply-add."""
        return 4 * self.layers * self.heads * self.head_dim


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    flops: float  # dense BF16 tensor-core peak, FLOP/s
    hbm_bandwidth: float  # bytes/s
    memory: float  # bytes of HBM
    link_bandwidth: float  # NVLink bytes/s per GPU and direction


# SGLang's `mem_fraction_static` default (0.9 of HBM for weights and KV) and a few GiB per GPU for
# activations and CUDA graphs: what is left is KV. The planners size decode batches and the
# simulator sizes nodes with these same figures, so the policies' view of capacity is the sim's.
MEM_FRACTION = 0.9
ACTIVATION_RESERVE_PER_GPU = 4 * 2**30


@dataclass(frozen=True, slots=True)
class Deployment:
    """A model served on `tp` GPUs of one kind with tensor parallelism."""

    model: ModelConfig
    gpu: GpuSpec
    tp: int = 1

    def kv_bytes(
        self,
        mem_fraction: float = MEM_FRACTION,
        activation_reserve_per_gpu: float = ACTIVATION_RESERVE_PER_GPU,
    ) -> float:
        """GPU memory of one node left for KV: tp x (HBM x fraction - reserve) - weights."""
        per_gpu = self.gpu.memory * mem_fraction - activation_reserve_per_gpu
        return self.tp * per_gpu - self.model.weight_bytes


# Meta's Llama 3 / 3.1 configs (Hugging Face `config.json`).
LLAMA3_70B = ModelConfig(
    name="llama-3-70b",
    layers=80,
    hidden=8192,
    heads=64,
    kv_heads=8,
    head_dim=128,
    intermediate=28672,
    vocab=128256,
)
LLAMA3_8B = ModelConfig(
    name="llama-3-8b",
    layers=32,
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=14336,
    vocab=128256,
)

# NVIDIA datasheets: H100 SXM5 989.4 TFLOP/s dense BF16, 3.35 TB/s, 80 GB, NVLink 900 GB/s
# (450 GB/s each way); H200 SXM the same compute with 4.8 TB/s and 141 GB; A100 SXM 80 GB
# 312 TFLOP/s, 2.039 TB/s, NVLink 600 GB/s.
H100 = GpuSpec("h100-sxm", 989.4e12, 3.35e12, 80e9, 450e9)
H200 = GpuSpec("h200-sxm", 989.4e12, 4.8e12, 141e9, 450e9)
A100 = GpuSpec("a100-sxm-80gb", 312e12, 2.039e12, 80e9, 300e9)

MODELS = {m.name: m for m in (LLAMA3_70B, LLAMA3_8B)}
GPUS = {g.name: g for g in (H100, H200, A100)}

# The paper's main setting: Llama-3-70B at TP4 on H100s.
DEFAULT_DEPLOYMENT = Deployment(LLAMA3_70B, H100, tp=4)
