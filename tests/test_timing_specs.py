"""The model and GPU specifications: published figures in, the derived sizes the simulator and
the engines size KV and weights by out (docs/research/deployment-figures.md for the sources)."""

from __future__ import annotations

import dataclasses

import pytest

from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.specs import (
    GB300,
    GLM_4_5,
    H100,
    KIMI_K2,
    LLAMA3_70B,
    MODELS,
    Deployment,
)
from evolving_infra.timing.truth import RooflineTruth, TruthInputError


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


@pytest.mark.parametrize("model", [KIMI_K2, GLM_4_5], ids=lambda m: m.name)
def test_models_the_timing_does_not_know_yet_are_refused_not_mistimed(model: object) -> None:
    deployment = Deployment(model, GB300, tp=4)  # type: ignore[arg-type]
    with pytest.raises(TruthInputError, match="issue 25"):
        RooflineTruth(deployment)
    with pytest.raises(ValueError, match="issue 25"):
        IterationModel(prior=deployment)
    assert model not in MODELS.values()
