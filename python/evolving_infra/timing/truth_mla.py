"""The ground truth's multi-head latent attention (DeepSeek-V2/V3, Kimi K2) and its MTP draft.

Per GPU under tensor parallelism `tp`, heads sharded over the `tp` GPUs and no data-parallel
attention (SGLang's default without `--enable-dp-attention`). The shapes are SGLang's
`DeepseekV2AttentionMLA` (sgl-project/sglang `python/sglang/srt/models/deepseek_v2.py`):

- `fused_qkv_a_proj_with_mqa` (hidden -> q_lora_rank + kv_lora_rank + rope_head_dim) is a
  `ReplicatedLinear`: every rank multiplies all of it, not a 1/tp shard. Without a query
  bottleneck (`q_lora_rank` 0) the query is a column-parallel hidden -> heads·(head_dim + rope)
  and only the KV down-projection (hidden -> kv_lora_rank + rope) is replicated.
- `q_b_proj` (q_lora_rank -> heads·(head_dim + rope)) and `kv_b_proj` (kv_lora_rank ->
  heads·2·head_dim: non-rotary keys and values) are column-parallel, `o_proj` (heads·head_dim
  -> hidden) row-parallel: 1/tp each.
- Decode (and MTP verify) runs the absorbed form (`forward_absorb`): the latent is the KV of a
  single shared head, so each rank reads ALL of the latent cache (`model.kv_bytes_per_token`
  per context token, not 1/tp) for its heads/tp query heads. FLOPs per query-key pair per layer
  2·(heads/tp)·((kv_lora_rank + rope) + kv_lora_rank): QK^T over the 576-wide latent+rope key,
  PV over the 512-wide latent value (FlashMLA's own count, deepseek-ai/FlashMLA
  `docs/20250422-new-kernel-deep-dive.md`: 2·h_q·s_q·s_k·(d_k + d_v)). The query's non-rotary
  part is absorbed into the latent by W_UK (per head head_dim x kv_lora_rank) and the output
  brought back by W_UV (kv_lora_rank x head_dim): two batched GEMMs per layer ("mla_absorb")
  that replace `kv_b_proj` in decode. They read the same weights `kv_b_proj` holds.
- Prefill: the MHA form with chunked KV (SGLang's `MHA_CHUNKED_KV`, which its `trtllm_mla`
  handler takes on Blackwell for every extend, and its FA3 handler for prefixes of 8,192
  tokens and more): `kv_b_proj` expands the latents of the new tokens and of the cached
  prefix to per-head keys and values ("kv_b", once per iteration per token), and every pair,
  new x new and new x cached, runs at 2·(heads/tp)·((head_dim + rope) + head_dim) FLOPs per
  layer. Per cached pair that is 0.29x the absorbed form (which decode runs); the price is
  the prefix's expansion, 2·kv_lora_rank·heads·2·head_dim/tp FLOPs per cached token and
  layer. Bytes: the cached latent read in full on every rank, the new latent written.
- Compute efficiencies: the absorbed decode kernel reaches `Efficiency.mla_decode_attention`
  (FlashMLA: 580, later 660 TFLOP/s compute-bound on an H800 of 990 peak, i.e. 0.59-0.67;
  assumption 0.6 on the BF16 peak, FP8 latents being dequantised in the kernel); prefill
  attention the FlashAttention curve of the GQA path (`attention_max`, `attention_half`).
- Not modelled: the q_a and kv_a RMSNorms and the rotary embedding (small, element-wise), the
  `kv_b_proj` weight split copies SGLang keeps (`w_kc`, `w_vc`: read once either way).

The MTP draft (`draft_model`): one dense decoder layer of the target's hidden size, with the
target's attention type and a dense SwiGLU MLP of `intermediate`, plus the LM head, sharded over
the same `tp` GPUs. Assumptions: DeepSeek-V3's and GLM-4.5's MTP layers have a routed MLP and
an `eh_proj` (2·hidden -> hidden) fusing the embedding with the target's hidden state, and
Kimi K2 (no MTP layer) uses an EAGLE3 draft of one Llama-style layer; the dense layer stands
in for all three. Each draft step's attention reads the draft's own one-layer KV over the
request's whole context (the few drafted tokens beside it ignored).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from evolving_infra.timing.specs import ModelConfig

if TYPE_CHECKING:
    from evolving_infra.timing.truth import RooflineTruth


def draft_model(model: ModelConfig) -> ModelConfig:
    """The MTP draft as a model of its own: one dense layer of `model`'s attention and hidden
    size, its dense MLP (`intermediate`) and its LM head."""
    return dataclasses.replace(
        model,
        name=f"{model.name}-mtp-draft",
        layers=1,
        experts=0,
        experts_per_token=0,
        shared_experts=0,
        expert_intermediate=0,
        dense_layers=0,
    )


def projections(t: RooflineTruth, tokens: float) -> dict[str, float]:
    """The projections every token runs through in every layer, in decode as in prefill: the
    replicated down-projections and the sharded q_b ("qkv"), and `o_proj`."""
    m, tp = t.deployment.model, t.deployment.tp
    h, rope, latent = m.hidden, m.rope_head_dim, m.kv_lora_rank
    qk = m.heads * (m.head_dim + rope)
    if m.q_lora_rank:
        qkv = t._gemm(tokens, h, m.q_lora_rank + latent + rope) + t._gemm(
            tokens, m.q_lora_rank, qk / tp
        )
    else:
        qkv = t._gemm(tokens, h, qk / tp) + t._gemm(tokens, h, latent + rope)
    return {
        "qkv": m.layers * qkv,
        "o_proj": m.layers * t._gemm(tokens, m.heads * m.head_dim / tp, h),
    }


def kv_b(t: RooflineTruth, rows: float) -> float:
    """`kv_b_proj` over `rows` new tokens: their latents expanded to per-head keys and values."""
    m, tp = t.deployment.model, t.deployment.tp
    return m.layers * t._gemm(rows, m.kv_lora_rank, m.heads * 2 * m.head_dim / tp)


def absorb(t: RooflineTruth, rows: float) -> float:
    """W_UK on `rows` queries (heads/tp x head_dim -> kv_lora_rank) and W_UV on their outputs
    (kv_lora_rank -> heads/tp x head_dim), as one GEMM each; activations approximate."""
    m, tp = t.deployment.model, t.deployment.tp
    local = m.heads / tp
    w_uk = t._gemm(rows, m.head_dim, local * m.kv_lora_rank)
    w_uv = t._gemm(rows, m.kv_lora_rank, local * m.head_dim)
    return m.layers * (w_uk + w_uv)


def _absorbed_flops_per_pair(m: ModelConfig, tp: int) -> float:
    """All layers, one GPU: QK^T on the latent+rope key, PV on the latent value."""
    return m.layers * 2 * (m.heads / tp) * ((m.kv_lora_rank + m.rope_head_dim) + m.kv_lora_rank)


def decode_attention(t: RooflineTruth, context: float, queries: int) -> float:
    """One absorbed kernel over the batch's `context` latents, `queries` per sequence (1, or
    1 + draft tokens in an MTP verify): the latent is read once, in full on every rank, and
    the FLOPs grow with the queries (FlashMLA packs a sequence's queries and heads together)."""
    m, tp = t.deployment.model, t.deployment.tp
    flops = _absorbed_flops_per_pair(m, tp) * context * queries
    nbytes = m.kv_bytes_per_token * context
    return t._roofline(flops, t.efficiency.mla_decode_attention, nbytes)


def prefill_attention(t: RooflineTruth, uncached: int, cached: int) -> float:
    """Causal attention of `uncached` new queries over `cached` + `uncached` keys, all in the
    MHA form on keys and values `kv_b_proj` expanded (`kv_b`, priced with the projections):
    the cached latent read in full per rank, the new one written."""
    if uncached == 0:
        return 0.0
    m, e, tp = t.deployment.model, t.efficiency, t.deployment.tp
    eff = e.attention_max * uncached / (uncached + e.attention_half)
    mha = m.layers * 2 * (m.heads / tp) * ((m.head_dim + m.rope_head_dim) + m.head_dim)
    pairs = uncached * cached + uncached * (uncached + 1) / 2
    return t._roofline(mha * pairs, eff, m.kv_bytes_per_token * (cached + uncached))
