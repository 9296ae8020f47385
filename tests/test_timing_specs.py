"""The model and GPU specifications: published figures in, the derived sizes the simulator and
the engines size KV and weights by out (docs/research/deployment-figures.md for the sources)."""

from __future__ import annotations

import dataclasses

import pytest

from evolving_infra.sim.config import SimConfig
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.specs import (
    GB300,
    GLM_4_5,
    H100,
    KIMI_K2,
    LLAMA3_8B,
    LLAMA3_70B,
    MODELS,
    Deployment,
)
from evolving_infra.timing.truth import RooflineTruth


def test_kv_bytes_per_token_follow_the_attention() -> None:
    # GQA: K and V per KV head and layer; BF16 Llama-3-70B 2 x 80 x 8 x 128 x 2.
    assert LLAMA3_70B.kv_bytes_per_token == 327_680
    # GQA in FP8: GLM-4.5's 2 x 92 x 8 x 128 x 1.
    assert GLM_4_5.kv_bytes_per_token == 188_416
    # MLA: one latent (512) and its rotary part (64) per layer, in FP8: 61 x 576.
    assert KIMI_K2.kv_bytes_per_token == 35_136
    assert dataclasses.replace(KIMI_K2, bytes_per_kv=2).kv_bytes_per_token == 70_272


def test_weight_bytes_count_every_expert_at_its_precision() -> None:
    # Llama-3-70B, BF16: ~70B parameters less the embedding table.
    assert LLAMA3_70B.weight_bytes == pytest.approx(139.0e9, rel=1e-3)
    # Kimi K2 with NVFP4 experts, the rest BF16: ~592 GB (1.03T parameters, 1.01T of them in the
    # routed experts at 4.5 bits); GLM-4.5 ~221 GB.
    assert KIMI_K2.weight_bytes == pytest.approx(592e9, rel=0.01)
    assert GLM_4_5.weight_bytes == pytest.approx(221e9, rel=0.01)
    routed = KIMI_K2.moe_layers * KIMI_K2.experts * KIMI_K2.expert_params
    assert routed == pytest.approx(1.015e12, rel=0.01)
    # In BF16 the same experts take 3.6x the bytes.
    bf16 = dataclasses.replace(KIMI_K2, expert_bytes_per_param=2)
    assert bf16.weight_bytes - KIMI_K2.weight_bytes == round(routed * (2 - 0.5625))


def test_mla_attention_parameters() -> None:
    # q_a 7168x1536, q_b 1536x64x192, kv_a 7168x576, kv_b 512x64x256, o 64x128x7168.
    want = 7168 * 1536 + 1536 * 64 * 192 + 7168 * 576 + 512 * 64 * 256 + 64 * 128 * 7168
    assert KIMI_K2.attention_params_per_layer == want
    assert LLAMA3_70B.attention_params_per_layer == 2 * 8192 * 64 * 128 + 2 * 8192 * 8 * 128


def test_a_bad_mixture_is_refused() -> None:
    with pytest.raises(ValueError, match="experts_per_token"):
        dataclasses.replace(GLM_4_5, experts_per_token=161)
    with pytest.raises(ValueError, match="dense_layers"):
        dataclasses.replace(GLM_4_5, dense_layers=93)


def test_gb300_peaks() -> None:
    assert (GB300.fp4_flops, GB300.fp8_flops, GB300.flops) == (15e15, 5e15, 2.5e15)
    assert GB300.memory == 288e9
    assert H100.fp8_flops == pytest.approx(2 * H100.flops, rel=1e-3)


def test_latent_attention_is_timed_and_served() -> None:
    """Kimi K2 (MLA) is a model the simulators take (`MODELS`, `--model kimi-k2`): the truth
    and the prior both time it (tests/test_timing_truth.py, tests/test_timing_model.py)."""
    deployment = Deployment(KIMI_K2, GB300, tp=4)
    truth = RooflineTruth(deployment, noise=0.0)
    prior = IterationModel(prior=deployment)
    assert prior.source("decode") == prior.source("prefill") == "prior"
    for t in (truth.expected_decode_time(8, 8 * 4096), prior.predict_decode(8, 8 * 4096)):
        assert 0.001 < t < 0.1
    assert MODELS["kimi-k2"] is KIMI_K2
    assert MODELS["glm-4.5"] is GLM_4_5
    # Each GPU keeps the whole latent (Deployment.kv_bytes_per_token: 4 copies on 4 GPUs).
    assert deployment.kv_bytes_per_token == 4 * KIMI_K2.kv_bytes_per_token


# -- the ground truth of a mixture of experts ---------------------------------------------------

GLM_GB300 = Deployment(GLM_4_5, GB300, tp=4)


def test_a_batch_touches_more_experts_until_it_touches_all() -> None:
    m = GLM_4_5
    assert m.distinct_experts(1) == pytest.approx(8)
    assert m.distinct_experts(0) == 0.0
    touched = [m.distinct_experts(t) for t in (1, 4, 16, 64, 256, 4096)]
    assert touched == sorted(touched)
    assert touched[-1] == pytest.approx(160, rel=1e-6)
    assert m.distinct_experts(64) < 64 * 8  # tokens share experts


def test_decode_reads_more_expert_weights_as_the_batch_grows() -> None:
    truth = RooflineTruth(GLM_GB300, noise=0.0)
    experts = [truth.breakdown_decode(b, b * 1024)["experts"] for b in (1, 8, 64, 512)]
    assert experts == sorted(experts)
    # At batch 1 a step reads 8 experts per layer; at 512 nearly all 160, near the HBM
    # roofline: the experts' term grows ~20x, not 512x.
    assert 10 < experts[-1] / experts[0] < 25
    m, gpu, e = GLM_4_5, GB300, truth.efficiency
    every = m.moe_layers * m.experts * m.expert_params * m.expert_bytes_per_param / 4
    floor = every / (gpu.hbm_bandwidth * e.memory)
    assert floor <= experts[-1] < 1.3 * floor  # the weights, and the activations beside them
    # A dense model reads all its weights at batch 1 already: no such term.
    assert "experts" not in RooflineTruth(noise=0.0).breakdown_decode(8, 8192)


def test_nvfp4_experts_run_at_the_fp4_peak_where_the_gpu_has_one() -> None:
    fast = RooflineTruth(GLM_GB300, noise=0.0)
    no_fp4 = dataclasses.replace(GB300, fp4_flops=0.0)
    slow = RooflineTruth(Deployment(GLM_4_5, no_fp4, tp=4), noise=0.0)
    batch = [(8192, 0)]
    assert fast.breakdown_prefill(batch)["experts"] < slow.breakdown_prefill(batch)["experts"]
    # Everything else runs in BF16 either way.
    assert fast.breakdown_prefill(batch)["qkv"] == slow.breakdown_prefill(batch)["qkv"]


def test_the_prior_of_a_mixture_counts_the_active_weights() -> None:
    m = GLM_4_5
    assert m.active_params == pytest.approx(32e9, rel=0.1)  # "32 billion active"
    assert m.active_weight_bytes < m.weight_bytes
    assert LLAMA3_70B.active_params == LLAMA3_70B.linear_params
    assert LLAMA3_70B.active_weight_bytes == LLAMA3_70B.weight_bytes
    prior = IterationModel(prior=GLM_GB300)
    truth = RooflineTruth(GLM_GB300, noise=0.0)
    # Within 2x of the truth where it matters: the prior starts the fit, it does not end it.
    for b in (1, 64):
        ratio = prior.predict_decode(b, b * 4096) / truth.expected_decode_time(b, b * 4096)
        assert 0.5 < ratio < 2.0
    ratio = prior.predict_prefill_one(8192, 0) / truth.expected_prefill_time([(8192, 0)])
    assert 0.5 < ratio < 2.0


def test_node_kv_footprint_by_attention_type() -> None:
    """MLA's latent sits on every GPU of the node; GQA heads are sharded, and replicated only
    when the node has more GPUs than KV heads."""
    kimi = Deployment(KIMI_K2, GB300, tp=4)
    assert kimi.kv_bytes_per_token == 4 * KIMI_K2.kv_bytes_per_token
    assert Deployment(GLM_4_5, GB300, tp=4).kv_bytes_per_token == GLM_4_5.kv_bytes_per_token
    tiny_heads = dataclasses.replace(LLAMA3_8B, kv_heads=2)
    assert Deployment(tiny_heads, H100, tp=8).kv_bytes_per_token == pytest.approx(
        4 * tiny_heads.kv_bytes_per_token
    )
    config = SimConfig(gpus=36, deployment=kimi)
    assert config.l1_blocks(64) == int(kimi.kv_bytes() // (64 * kimi.kv_bytes_per_token))
