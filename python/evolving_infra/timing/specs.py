"""Model configurations and GPU specifications: the numbers the roofline and the prior start from.

Model figures are the architectures' published `config.json` values; GPU figures are NVIDIA's
datasheet peaks (dense tensor-core FLOP/s without sparsity, HBM bandwidth, NVLink bandwidth
per GPU and direction). Peaks are not what kernels reach: the ground truth (`truth.py`) applies
efficiencies, the predictor learns what the hardware really does.

The paper's deployment (issue 25: GB300, mixture-of-experts models, NVFP4 weights, FP8 KV, MTP)
is described here (`GB300`, `KIMI_K2`, `GLM_4_5`, `Deployment.mtp_draft_tokens`; figures and
sources in docs/research/deployment-figures.md). The ground truth and the prior time every model
here: GQA or multi-head latent attention (`KIMI_K2`; `timing/truth_mla.py`), dense or MoE, with
or without MTP speculative decoding.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder-only transformer: GQA attention (Llama) or DeepSeek's multi-head latent
    attention (`kv_lora_rank` > 0), SwiGLU MLPs, dense or mixture-of-experts (`experts` > 0:
    every layer after the first `dense_layers` routes each token to `experts_per_token` of
    `experts` routed experts plus `shared_experts` always-on ones, each of `expert_intermediate`).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the dense layers' MLP
    vocab: int
    bytes_per_param: float = 2  # BF16 weights (the dense parts: attention, dense and shared MLPs)
    bytes_per_kv: float = 2  # BF16 KV cache (FP8: 1)
    # Mixture of experts (0: dense).
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    expert_intermediate: int = 0
    dense_layers: int = 0  # the first layers, with a dense MLP (`first_k_dense_replace`)
    expert_bytes_per_param: float = 2  # routed experts' weights (NVFP4: 4.5 bits = 0.5625)
    # Multi-head latent attention (0: GQA): the KV cache holds one latent of `kv_lora_rank` plus
    # the rotary part `rope_head_dim` per token and layer, shared by every head.
    # `head_dim` is then the per-head non-rotary query/key and value dimension, and queries go
    # through a `q_lora_rank` bottleneck (0: none).
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    q_lora_rank: int = 0
    # The longest context an engine accepts (SGLang's `context_len`, from the model's
    # `max_position_embeddings`): Llama 3.1's 131,072, the version whose context holds the
    # traces' 100k-token prompts (Llama 3.0 had 8,192). Dynamo's planner scales prefill on
    # queued tokens per context length (docs/baselines.md, §1a).
    context_length: int = 131_072

    def __post_init__(self) -> None:
        if self.experts and not 0 < self.experts_per_token <= self.experts:
            raise ValueError(f"{self.name}: need 0 < experts_per_token <= experts")
        if self.experts and not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"{self.name}: need 0 <= dense_layers <= layers")

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def expert_params(self) -> int:
        """One expert's weights in one layer: gate, up and down."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def attention_params_per_layer(self) -> int:
        """Q, K, V and O projections of one layer."""
        h, heads, d = self.hidden, self.heads, self.head_dim
        if not self.kv_lora_rank:
            return 2 * h * heads * d + 2 * h * self.kv_heads * d
        qk = heads * (d + self.rope_head_dim)
        q = self.q_lora_rank * (h + qk) if self.q_lora_rank else h * qk
        kv_a = h * (self.kv_lora_rank + self.rope_head_dim)
        kv_b = self.kv_lora_rank * heads * 2 * d  # non-rotary keys and values
        return q + kv_a + kv_b + heads * d * h

    @property
    def linear_params_per_layer(self) -> int:
        """Weights every token multiplies through in one dense GQA layer: Q, K, V, O and the
        MLP."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        return q_o + k_v + mlp

    @property
    def linear_params(self) -> int:
        return self.layers * self.linear_params_per_layer

    @property
    def active_params(self) -> int:
        """Weights one token multiplies through (the LM head aside): every layer's attention,
        the dense layers' MLP, and in each MoE layer its router, shared experts and the
        `experts_per_token` routed ones. A dense model's `linear_params`."""
        if not self.experts:
            return self.linear_params
        mlp = 3 * self.hidden * self.intermediate
        per_moe = (
            self.hidden * self.experts
            + (self.shared_experts + self.experts_per_token) * self.expert_params
        )
        attention = self.layers * self.attention_params_per_layer
        return attention + self.dense_layers * mlp + self.moe_layers * per_moe

    @property
    def active_weight_bytes(self) -> int:
        """The weights one token alone reads: `weight_bytes` with only `experts_per_token`
        routed experts per MoE layer (the floor of a decode step at batch 1)."""
        if not self.experts:
            return self.weight_bytes
        unread = self.moe_layers * (self.experts - self.experts_per_token) * self.expert_params
        return round(self.weight_bytes - unread * self.expert_bytes_per_param)

    def distinct_experts(self, tokens: float) -> float:
        """Routed experts a batch of `tokens` touches in one MoE layer, expected, with each
        token choosing `experts_per_token` of `experts` uniformly: E(1 - (1 - k/E)^tokens)."""
        if not self.experts or tokens <= 0:
            return 0.0
        e, k = self.experts, self.experts_per_token
        return float(e * (1.0 - (1.0 - k / e) ** tokens))

    @property
    def head_params(self) -> int:
        """The LM head (vocab projection), run once per sequence in prefill, per token in decode."""
        return self.hidden * self.vocab

    @property
    def weight_bytes(self) -> int:
        """What one iteration may read of the weights: every layer and the LM head (the
        embedding table is a lookup, a row per token, not read whole). A mixture of experts
        counts each MoE layer's shared experts and router and all its routed experts, at their
        own precision, in place of the dense MLP."""
        if not self.experts:
            return round((self.linear_params + self.head_params) * self.bytes_per_param)
        mlp = 3 * self.hidden * self.intermediate
        attention = self.attention_params_per_layer
        dense = self.layers * attention + self.dense_layers * mlp + self.head_params
        shared = self.moe_layers * (self.shared_experts * self.expert_params)
        router = self.moe_layers * self.hidden * self.experts
        routed = self.moe_layers * self.experts * self.expert_params
        return round(
            (dense + shared + router) * self.bytes_per_param + routed * self.expert_bytes_per_param
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """The KV cache of one token over all layers: K and V per KV head (GQA), or one latent
        and its rotary part shared by every head (MLA: what SGLang's `MLATokenToKVPool`
        holds)."""
        if self.kv_lora_rank:
            return round(self.layers * (self.kv_lora_rank + self.rope_head_dim) * self.bytes_per_kv)
        return round(2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_kv)

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
    fp8_flops: float = 0.0  # dense FP8 peak (0: no FP8 tensor cores)
    fp4_flops: float = 0.0  # dense NVFP4 peak (0: none)


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
    # Multi-token prediction (speculative decoding with the model's MTP layer, SGLang's
    # `--speculative-algorithm EAGLE` on an MTP checkpoint): `mtp_draft_tokens` drafted per
    # step and verified in one target pass; `mtp_accepted` the mean tokens a request gains per
    # decode step, the bonus token included (1 without MTP; at most `mtp_draft_tokens` + 1).
    mtp_draft_tokens: int = 0
    mtp_accepted: float = 1.0

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tensor parallelism must be >= 1, got {self.tp}")
        if self.mtp_draft_tokens < 0:
            raise ValueError(f"mtp_draft_tokens must be >= 0, got {self.mtp_draft_tokens}")
        if not 1.0 <= self.mtp_accepted <= self.mtp_draft_tokens + 1:
            raise ValueError(
                f"mtp_accepted must be in [1, draft tokens + 1 = {self.mtp_draft_tokens + 1}],"
                f" got {self.mtp_accepted}"
            )

    @property
    def kv_bytes_per_token(self) -> float:
        """GPU memory one cached token takes on the whole node: the model's KV times the
        copies tensor parallelism keeps. GQA shards the KV heads over the `tp` GPUs (a head is
        replicated when there are fewer heads than GPUs); MLA's latent is shared by every head,
        so each GPU keeps all of it (SGLang's `MLATokenToKVPool` on every TP rank, without DP
        attention). What capacities divide by, and what a node's transfers move, each GPU its
        own shard or copy at its own bandwidth."""
        m = self.model
        copies = float(self.tp) if m.kv_lora_rank else max(self.tp, m.kv_heads) / m.kv_heads
        return m.kv_bytes_per_token * copies

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
# H100/H200 dense FP8 1,978.9 TFLOP/s (the datasheets' 3,958 is with sparsity).
H100 = GpuSpec("h100-sxm", 989.4e12, 3.35e12, 80e9, 450e9, fp8_flops=1978.9e12)
H200 = GpuSpec("h200-sxm", 989.4e12, 4.8e12, 141e9, 450e9, fp8_flops=1978.9e12)
A100 = GpuSpec("a100-sxm-80gb", 312e12, 2.039e12, 80e9, 300e9)
# GB300 (Blackwell Ultra), per GPU: 15 PFLOP/s dense NVFP4 (NVIDIA's Blackwell Ultra blog),
# 288 GB of HBM3e at 8 TB/s, NVLink 5 at 1.8 TB/s both ways (900 GB/s each); dense FP8 5 and
# BF16 2.5 PFLOP/s are third-party tables (the rack's 720 PF sparse FP8 / 72 / 2), not found in
# an NVIDIA datasheet (docs/research/deployment-figures.md).
GB300 = GpuSpec("gb300", 2.5e15, 8e12, 288e9, 900e9, fp8_flops=5e15, fp4_flops=15e15)

# The MoE models closest to the paper's (GLM-5.2, Kimi K2.6), as their NVFP4 checkpoints serve
# them: routed experts in NVFP4 (4.5 bits a weight), the rest BF16, FP8 KV. Kimi K2 (MoonshotAI
# README, K2-family configs): 61 layers (1 dense), 7168 hidden, 64 heads, MLA (latent 512,
# rotary 64, head 128), 384 experts of 2048, 8 per token, 1 shared. GLM-4.5 (zai-org README,
# NVIDIA Megatron-Bridge): 92 layers (3 dense), 5120 hidden, 96 heads, 8 KV heads of 128, 160
# experts of 1536, 8 per token, 1 shared.
NVFP4 = 0.5625
KIMI_K2 = ModelConfig(
    name="kimi-k2",
    layers=61,
    hidden=7168,
    heads=64,
    kv_heads=64,
    head_dim=128,
    intermediate=18432,
    vocab=163840,
    bytes_per_kv=1,
    experts=384,
    experts_per_token=8,
    shared_experts=1,
    expert_intermediate=2048,
    dense_layers=1,
    expert_bytes_per_param=NVFP4,
    kv_lora_rank=512,
    rope_head_dim=64,
    q_lora_rank=1536,
)
GLM_4_5 = ModelConfig(
    name="glm-4.5",
    layers=92,
    hidden=5120,
    heads=96,
    kv_heads=8,
    head_dim=128,
    intermediate=12288,
    vocab=151552,
    bytes_per_kv=1,
    experts=160,
    experts_per_token=8,
    shared_experts=1,
    expert_intermediate=1536,
    dense_layers=3,
    expert_bytes_per_param=NVFP4,
)


MODELS = {m.name: m for m in (LLAMA3_70B, LLAMA3_8B, GLM_4_5, KIMI_K2)}
GPUS = {g.name: g for g in (H100, H200, A100, GB300)}

# The simulator's long-standing setting: Llama-3-70B at TP4 on H100s.
DEFAULT_DEPLOYMENT = Deployment(LLAMA3_70B, H100, tp=4)
# The paper's (issue 25): 9 nodes of 4 GB300 serving a Kimi-K2-class MLA mixture of experts
# with NVFP4 experts and an FP8 KV cache, and speculative decoding of 3 draft tokens of which
# 2.5 are accepted per step, bonus token included (Kimi K2.5's EAGLE3 head reaches 2.88 at 3
# draft tokens with thinking on, GLM-5.2's MTP 2.99: docs/research/deployment-figures.md;
# 2.5 leaves room for chat-like turns that accept less).
PAPER_DEPLOYMENT = Deployment(KIMI_K2, GB300, tp=4, mtp_draft_tokens=3, mtp_accepted=2.5)
DEPLOYMENTS = {"h100-llama": DEFAULT_DEPLOYMENT, "paper": PAPER_DEPLOYMENT}


def deployment_name(d: Deployment) -> str:
    """`d`'s name in `DEPLOYMENTS`, or one spelled from its parts."""
    for name, known in DEPLOYMENTS.items():
        if known == d:
            return name
    mtp = f", MTP {d.mtp_draft_tokens}/{d.mtp_accepted:g}" if d.mtp_draft_tokens else ""
    return f"{d.model.name} on {d.tp} x {d.gpu.name}{mtp}"
