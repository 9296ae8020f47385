"""The hidden ground-truth iteration time: a per-operation roofline of a real model on a real GPU.

The simulated engine and the cluster simulator run on `RooflineTruth`; policies never see it. They
see only the online-fitted `IterationModel`, whose prefill features are `1, Σt_uc, ΣA, Σt_c` (with
A = t_uc·t_c + t_uc(t_uc+1)/2) and decode features `1, B, C`. The truth deliberately does not
share that form: every kernel is `max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth)`, GEMM
and attention efficiencies grow with the number of rows, and the kernels of an iteration run one
after another (their times add). A purely linear model therefore cannot match it exactly (see
`tests/test_timing_truth.py`), which is why the predictor needs its own roofline handling.

Modelled per iteration, per GPU under tensor parallelism `tp` (weights, heads and the MLP sharded):
the Q/K/V, O, gate/up and down GEMMs of every layer; the LM head (once per sequence in prefill,
since SGLang computes logits for the last position only; once per token in decode); attention per
request (prefill) or over the whole batch's KV (decode); the fused element-wise kernels (residual
add + RMSNorm twice, SiLU-and-mul); two all-reduces per layer; a fixed per-iteration and a
per-request overhead. Not modelled: the logits gather, rotary embedding, KV-cache writes beyond
the attention read, kernel overlap, and thermal or clock variation (the lognormal noise stands in).
A mixture of experts runs its router, shared experts and each routed expert the batch touches
(`_moe_terms`). Multi-head latent attention (DeepSeek-V3, Kimi K2) has its own projections and
kernels, part of them replicated on every GPU, the latent cache read whole by each
(`truth_mla.py`, which lists its assumptions).

Multi-token prediction (`Deployment.mtp_draft_tokens` d > 0, speculative decoding with one draft
layer): a decode iteration of B requests is d draft steps at B rows (each one dense layer of the
target's attention and hidden size and the LM head, over the whole context: `truth_mla.
draft_model`) plus one verify pass of the target over B·(1 + d) rows (every GEMM and the LM head
at B·(1 + d) rows, so a mixture touches more experts; attention with 1 + d queries a sequence,
the KV read once); breakdown key "draft". `decode_time` is that whole iteration; the simulator
credits `mtp_accepted` tokens a request per iteration. A prefill adds the draft's one layer over
its tokens (the draft extend), key "draft". Assumptions: the draft pass runs inside the target's
iteration (no overhead of its own: SGLang replays its steps from a CUDA graph); the draft extend
after a verify is one of the d steps; a request's d + 1 verified tokens route to experts
independently.

Sanity figures, default deployment (Llama-3-70B, TP4, H100 SXM), noise-free:
decode B=1 with 2k context ≈ 15.1 ms (weight-read bound: 34.7 GB per GPU at 0.85 x 3.35 TB/s is
12.2 ms, plus 1.3 ms of all-reduce latency and 1.5 ms overhead); B=64 with 8k context each ≈ 33 ms
(KV reads now dominate). A single 8k-token prefill ≈ 0.55 s, i.e. ≈ 14.9k tokens/s per 4-GPU node
(GEMMs 70%, all-reduce 15%, element-wise 7%, attention 7%); 32k tokens ≈ 2.6 s (attention 23%).
The GEMM roofline knee is ≈ 130 tokens per iteration, but fixed costs (overheads, all-reduce
latency) keep the time per token falling until a few thousand tokens.

The paper's deployment, 4 x GB300 (NVFP4 experts, FP8 KV), noise-free; plain / MTP with d = 3:

| | Kimi K2 (MLA) | GLM-4.5 (GQA) |
|---|---|---|
| decode B=1, 2k context | 3.97 / 5.68 ms | 4.56 / 5.82 ms |
| decode B=64, 8k each | 23.5 / 31.5 ms | 16.3 / 18.9 ms |
| decode B=256, 8k each | 42.6 / 53.1 ms | 33.2 / 43.2 ms |
| prefill 8k tokens | 124 / 126 ms | 133 / 135 ms |

Kimi K2 at B=1 reads ~9.9 GB a GPU (attention, shared experts and LM head in BF16, 8 NVFP4
experts a layer, q_a/kv_a whole on each GPU): 1.5 ms at 0.85 x 8 TB/s, plus 1.0 ms of all-reduce
latency and 1.5 ms overhead. At B=64 x 8k it touches 284 of 384 experts a layer (experts 15.7
ms) and reads 18.4 GB of latents a GPU (attention 2.7 ms, the same at any `tp`). With MTP at
accept length 2.5 a request gains 2.5 tokens an iteration: x1.75 tokens/s at B=1 (the verify's 4
rows touch 4x the experts; x1.2 at B=8), x1.9 at B=64, x2.0 at B=256 (the experts are read whole
anyway); less once the GEMMs are compute-bound (x1.45 at B=2048 with 1k contexts). An 8k Kimi
prefill runs at ~66k tokens/s a node (experts 32%, all-reduce 23%, attention 11%).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from evolving_infra.timing import truth_mla
from evolving_infra.timing.samples import PrefillBatch, Sample, TimingError
from evolving_infra.timing.specs import DEFAULT_DEPLOYMENT, Deployment


class TruthInputError(TimingError):
    """A batch the ground truth cannot time (negative tokens, empty batch, bad configuration)."""


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fractions of peak the kernels reach, and fixed costs. All are assumptions unless sourced."""

    # GEMM compute efficiency at large N: cuBLAS BF16 GEMMs of these shapes measure ~700-750
    # TFLOP/s on H100 SXM (0.7-0.75 of the 989 TFLOP/s dense peak). Assumption, from public GEMM
    # benchmarks; the upper end, since prefill GEMMs here are large (N in the thousands).
    gemm_max: float = 0.75
    # Tokens at which a GEMM reaches half of `gemm_max`: eff(N) = gemm_max·N/(N + gemm_half).
    # Small N leaves most 128-row tensor-core tiles empty. Assumption (one tile height).
    gemm_half: float = 128.0
    # Fraction of HBM bandwidth streaming kernels reach (weight reads, KV reads, element-wise);
    # GEMV/decode kernels measure 80-90% of the datasheet figure. Assumption.
    memory: float = 0.85
    # FlashAttention-style prefill efficiency on long queries: FA2/FA3 report 50-70% of peak on
    # H100 for long sequences. Assumption: 0.6.
    attention_max: float = 0.6
    # Query tokens at which prefill attention reaches half of `attention_max`: short query blocks
    # fill few tiles even against a long cached prefix. Assumption.
    attention_half: float = 128.0
    # Decode attention compute efficiency (one query per sequence; GQA packs the query heads of a
    # KV head into one tile). Memory-bound anyway, so the value barely matters. Assumption.
    decode_attention: float = 0.3
    # Fraction of NVLink per-direction bandwidth a ring all-reduce reaches (nccl-tests bus
    # bandwidth on H100 NVLink is ~360-400 of 450 GB/s). Assumption: 0.85.
    link: float = 0.85
    # Fixed latency of one all-reduce: NCCL / custom all-reduce small-message latency on NVLink
    # is 5-10 µs. Assumption: 8 µs.
    all_reduce_latency: float = 8e-6
    # Per-iteration CPU scheduling, batch preparation and kernel launches. Prefill runs eagerly
    # (no CUDA graphs): assumption 3 ms. Decode replays a CUDA graph: assumption 1.5 ms.
    prefill_overhead: float = 3e-3
    decode_overhead: float = 1.5e-3
    # Per request in the batch: sampling, detokenisation hand-off, batch bookkeeping. Assumption.
    per_request: float = 20e-6
    # Absorbed MLA decode attention (one latent head shared by a rank's query heads): FlashMLA
    # reaches 580-660 TFLOP/s compute-bound on an H800 of 990 peak (deepseek-ai/FlashMLA README
    # and its 2025-04-22 deep dive). Assumption: 0.6 of the BF16 peak (truth_mla.py).
    mla_decode_attention: float = 0.6


DENSE_MEMO = 1 << 16  # ~40 MB of memoised terms at most


class RooflineTruth:
    """Implements `Timing`. Expected times are noise-free; `*_time` multiply a lognormal noise."""

    def __init__(
        self,
        deployment: Deployment = DEFAULT_DEPLOYMENT,
        *,
        noise: float = 0.02,
        seed: int = 0,
        efficiency: Efficiency = Efficiency(),
    ) -> None:
        if not math.isfinite(noise) or noise < 0:
            raise TruthInputError(f"noise must be a finite sigma >= 0, got {noise}")
        self.deployment = deployment
        self.noise = noise
        self.efficiency = efficiency
        self._rng = random.Random(seed)
        # `_dense` by (tokens, lm_rows): a pure function of two ints that the simulator asks for
        # once per decode span and prefill iteration, mostly with values seen before (decode
        # batch sizes; full prefill chunks). Emptied when it reaches `DENSE_MEMO` pairs.
        self._dense_memo: dict[tuple[int, int], dict[str, float]] = {}
        # The MTP draft (one dense layer and the LM head, `truth_mla.draft_model`), timed as a
        # model of its own on the same GPUs; None without MTP.
        self._draft: RooflineTruth | None = None
        if deployment.mtp_draft_tokens:
            draft = Deployment(
                truth_mla.draft_model(deployment.model), deployment.gpu, deployment.tp
            )
            self._draft = RooflineTruth(draft, noise=0.0, efficiency=efficiency)

    # -- public API -----------------------------------------------------------------------------

    def breakdown_prefill(self, batch: PrefillBatch) -> dict[str, float]:
        """Seconds per operation of one prefill iteration (noise-free)."""
        if not batch:
            raise TruthInputError("a prefill batch needs at least one request")
        for u, c in batch:
            if u < 0 or c < 0:
                raise TruthInputError(f"token counts must be >= 0, got ({u}, {c})")
        tokens = sum(u for u, _ in batch)
        out = self._dense(tokens, lm_rows=len(batch))
        if self.deployment.model.kv_lora_rank:
            # The new tokens' latents and the cached prefixes' re-expanded (MHA_CHUNKED_KV).
            out["kv_b"] = truth_mla.kv_b(self, tokens + sum(c for u, c in batch if u > 0))
        out["attention"] = sum(self._prefill_attention(u, c) for u, c in batch)
        e = self.efficiency
        out["overhead"] = e.prefill_overhead + e.per_request * len(batch)
        if self._draft is not None:  # the draft extend: its one layer over the same tokens
            out["draft"] = _without_overhead(self._draft.breakdown_prefill(batch))
        return out

    def breakdown_decode(self, batch_size: int, context_tokens: int) -> dict[str, float]:
        """Seconds per operation of one decode iteration (noise-free); C is the batch's total KV."""
        if batch_size <= 0:
            raise TruthInputError(f"a decode batch needs batch_size > 0, got {batch_size}")
        if context_tokens < 0:
            raise TruthInputError(f"context tokens must be >= 0, got {context_tokens}")
        e, d = self.efficiency, self.deployment.mtp_draft_tokens
        # With MTP the target verifies 1 + d tokens per request in one pass: every GEMM runs
        # (and the LM head scores) B·(1 + d) rows, the attention 1 + d queries per sequence.
        rows = batch_size * (1 + d)
        out = self._dense(rows, lm_rows=rows)
        if self.deployment.model.kv_lora_rank:
            out["mla_absorb"] = truth_mla.absorb(self, rows)
        out["attention"] = self._decode_attention(context_tokens, 1 + d)
        out["overhead"] = e.decode_overhead + e.per_request * batch_size
        if self._draft is not None:  # d draft steps at B rows, each over the whole context
            out["draft"] = d * _without_overhead(
                self._draft.breakdown_decode(batch_size, context_tokens)
            )
        return out

    def expected_prefill_time(self, batch: PrefillBatch) -> float:
        return sum(self.breakdown_prefill(batch).values())

    def expected_decode_time(self, batch_size: int, context_tokens: int) -> float:
        return sum(self.breakdown_decode(batch_size, context_tokens).values())

    def prefill_time(self, batch: PrefillBatch) -> float:
        return self.expected_prefill_time(batch) * self._noise()

    def decode_time(self, batch_size: int, context_tokens: int) -> float:
        return self.expected_decode_time(batch_size, context_tokens) * self._noise()

    def sample_prefill(self, batch: PrefillBatch) -> Sample:
        return Sample("prefill", self.prefill_time(batch), batch=tuple((u, c) for u, c in batch))

    def sample_decode(self, batch_size: int, context_tokens: int) -> Sample:
        seconds = self.decode_time(batch_size, context_tokens)
        return Sample("decode", seconds, batch_size=batch_size, context_tokens=context_tokens)

    # -- operations -----------------------------------------------------------------------------

    def _noise(self) -> float:
        # Lognormal with a zero-mean log: the median iteration is the expected one.
        return math.exp(self._rng.gauss(0.0, self.noise)) if self.noise > 0 else 1.0

    def _roofline(
        self, flops: float, compute_eff: float, nbytes: float, peak: float | None = None
    ) -> float:
        gpu, e = self.deployment.gpu, self.efficiency
        top = gpu.flops if peak is None else peak
        compute = flops / (top * compute_eff) if flops > 0 else 0.0
        return max(compute, nbytes / (gpu.hbm_bandwidth * e.memory))

    def _gemm(
        self,
        rows: float,
        d_in: float,
        d_out: float,
        bpp: float | None = None,
        peak: float | None = None,
    ) -> float:
        """One GEMM of `rows` tokens by a (d_in x d_out) weight shard: weights read once, at
        `bpp` bytes a weight (default: the model's) and the `peak` FLOP/s of their precision."""
        if rows == 0:
            return 0.0
        e = self.efficiency
        w = self.deployment.model.bytes_per_param if bpp is None else bpp
        eff = e.gemm_max * rows / (rows + e.gemm_half)
        if bpp is None:
            nbytes = w * (d_in * d_out + rows * (d_in + d_out))
        else:  # weights at their own precision; activations move in BF16 whatever they are
            nbytes = w * d_in * d_out + 2 * rows * (d_in + d_out)
        return self._roofline(2.0 * rows * d_in * d_out, eff, nbytes, peak)

    def _dense(self, tokens: int, lm_rows: int) -> dict[str, float]:
        """Token-parallel work: the layers' GEMMs, element-wise kernels, all-reduces, LM head
        (a new dict: the callers add to it)."""
        memo = self._dense_memo
        done = memo.get((tokens, lm_rows))
        if done is None:
            if len(memo) >= DENSE_MEMO:
                memo.clear()
            done = memo[tokens, lm_rows] = self._dense_terms(tokens, lm_rows)
        return dict(done)

    def _dense_terms(self, tokens: int, lm_rows: int) -> dict[str, float]:
        m, e, tp = self.deployment.model, self.efficiency, self.deployment.tp
        h, q, kv = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
        # The layers with a dense MLP: all of them, or a mixture's first `dense_layers`.
        dense = m.dense_layers if m.experts else m.layers
        # Column-parallel QKV and gate/up, row-parallel O and down (Megatron sharding); latent
        # attention's projections are `truth_mla.projections` (part of them replicated).
        if m.kv_lora_rank:
            out = truth_mla.projections(self, tokens)
        else:
            out = {
                "qkv": m.layers * self._gemm(tokens, h, (q + 2 * kv) / tp),
                "o_proj": m.layers * self._gemm(tokens, q / tp, h),
            }
        out["mlp_gate_up"] = dense * self._gemm(tokens, h, 2 * m.intermediate / tp)
        out["mlp_down"] = dense * self._gemm(tokens, m.intermediate / tp, h)
        if m.experts:
            out.update(self._moe_terms(tokens))
        out["lm_head"] = self._gemm(lm_rows, h, m.vocab / tp)
        # Fused add+RMSNorm twice (read x and residual, write both) and SiLU-and-mul (read 2,
        # write 1 of the sharded intermediate): memory-bound, replicated on every rank.
        if m.experts:
            # Each layer's MLP activations are those it runs: the dense MLP, or the shared and
            # the `k` routed experts' (a token's share of the batch), in BF16.
            act = m.dense_layers * m.intermediate + m.moe_layers * (
                m.shared_experts * m.expert_intermediate
                + m.experts_per_token * m.expert_intermediate
            )
            per_token = 2 * (8 * h * m.layers + 3 * act / tp)
            out["elementwise"] = self._roofline(0.0, 1.0, tokens * per_token)
        else:
            per_token = m.bytes_per_param * (8 * h + 3 * m.intermediate / tp)
            out["elementwise"] = self._roofline(0.0, 1.0, m.layers * tokens * per_token)
        if tp == 1:
            out["all_reduce"] = 0.0
        else:
            # Ring all-reduce: every rank sends and receives 2(tp-1)/tp of the activations.
            moved = 2 * (tp - 1) / tp * tokens * h * m.bytes_per_param
            one = e.all_reduce_latency + moved / (self.deployment.gpu.link_bandwidth * e.link)
            out["all_reduce"] = 2 * m.layers * one
        return out

    def _expert_peak(self) -> float:
        """FLOP/s the routed experts' GEMMs run at: their weights' precision, when the GPU has
        tensor cores for it (NVFP4 at 4.5 bits a weight, FP8 at 1 byte), else BF16."""
        m, gpu = self.deployment.model, self.deployment.gpu
        if m.expert_bytes_per_param < 1 and gpu.fp4_flops > 0:
            return gpu.fp4_flops
        if m.expert_bytes_per_param <= 1 and gpu.fp8_flops > 0:
            return gpu.fp8_flops
        return gpu.flops

    def _moe_terms(self, tokens: int) -> dict[str, float]:
        """A mixture's MoE layers (GQA attention; `_dense_terms` has the rest). Each runs its
        router and shared experts over every token, and each routed expert the batch touches
        (`ModelConfig.distinct_experts`, expected) over its share of the tokens: one grouped
        GEMM per expert, whose weights are read once however few rows it has, so a decode step
        reads more of the weights as the batch grows, until every expert is read. Experts are
        sharded over the node's `tp` GPUs as the MLP is (tensor-parallel MoE)."""
        m, tp = self.deployment.model, self.deployment.tp
        h, k, ie = m.hidden, m.experts_per_token, m.expert_intermediate
        touched = m.distinct_experts(tokens)
        rows = tokens * k / touched if touched > 0 else 0.0
        wb, peak = m.expert_bytes_per_param, self._expert_peak()
        shared = m.shared_experts * ie
        return {
            "router": m.moe_layers * self._gemm(tokens, h, m.experts),
            "shared_experts": m.moe_layers
            * (self._gemm(tokens, h, 2 * shared / tp) + self._gemm(tokens, shared / tp, h)),
            "experts": m.moe_layers
            * touched
            * (self._gemm(rows, h, 2 * ie / tp, wb, peak) + self._gemm(rows, ie / tp, h, wb, peak)),
        }

    def _decode_attention(self, context: int, queries: int) -> float:
        """One batched kernel over all the KV, `queries` per sequence (1; 1 + d verifying MTP
        drafts): reading the KV dominates (GQA: ~1 FLOP per byte per query)."""
        m, e, tp = self.deployment.model, self.efficiency, self.deployment.tp
        if m.kv_lora_rank:
            return truth_mla.decode_attention(self, context, queries)
        return self._roofline(
            m.attention_flops_per_pair * context * queries / tp,
            e.decode_attention,
            m.kv_bytes_per_token * context / tp,
        )

    def _prefill_attention(self, uncached: int, cached: int) -> float:
        """Causal attention of `uncached` new queries over `cached` + `uncached` keys."""
        if uncached == 0:
            return 0.0
        m, e, tp = self.deployment.model, self.efficiency, self.deployment.tp
        if m.kv_lora_rank:
            return truth_mla.prefill_attention(self, uncached, cached)
        pairs = uncached * cached + uncached * (uncached + 1) / 2
        eff = e.attention_max * uncached / (uncached + e.attention_half)
        # Read the cached KV, write the new KV; the Q and O activations are small beside it.
        nbytes = m.kv_bytes_per_token * (cached + uncached) / tp
        return self._roofline(m.attention_flops_per_pair * pairs / tp, eff, nbytes)


def _without_overhead(parts: dict[str, float]) -> float:
    """A draft pass's seconds: it runs inside the target's iteration, whose overhead covers it."""
    return sum(v for k, v in parts.items() if k != "overhead")
