"""The hidden roofline ground truth (`evolving_infra.timing.truth`): monotonicity, noise, the
roofline regimes, tensor parallelism, latent attention (Kimi K2), multi-token prediction, input
errors, and that it is not the predictor's linear form.
"""

import itertools
import math
import statistics

import numpy as np
import pytest

from evolving_infra.timing import (
    DEFAULT_DEPLOYMENT,
    H100,
    LLAMA3_8B,
    Deployment,
    PrefillBatch,
    Sample,
    TimingError,
)
from evolving_infra.timing.specs import (
    GB300,
    GLM_4_5,
    KIMI_K2,
    LLAMA3_70B,
    NVFP4,
    GpuSpec,
    ModelConfig,
)
from evolving_infra.timing.truth import Efficiency, RooflineTruth, TruthInputError

EXACT = RooflineTruth(noise=0.0)
EFF = Efficiency()
GPU = DEFAULT_DEPLOYMENT.gpu
MODEL = DEFAULT_DEPLOYMENT.model
TP = DEFAULT_DEPLOYMENT.tp
LINEAR_OPS = ("qkv", "o_proj", "mlp_gate_up", "mlp_down")


def prefill(batch: PrefillBatch) -> float:
    return EXACT.expected_prefill_time(batch)


def decode(batch_size: int, context: int) -> float:
    return EXACT.expected_decode_time(batch_size, context)


def non_decreasing(values: list[float]) -> bool:
    return all(a <= b for a, b in itertools.pairwise(values))


# -- monotonicity, determinism, noise -----------------------------------------------------------

TOKENS = [0, 1, 7, 64, 128, 500, 2048, 8192, 32768, 100_000]


@pytest.mark.parametrize("other", [0, 1, 300, 4096, 65536])
def test_more_tokens_never_faster(other: int) -> None:
    assert non_decreasing([prefill([(u, other)]) for u in TOKENS])
    assert non_decreasing([prefill([(max(other, 1), c)]) for c in TOKENS])
    assert non_decreasing([prefill([(other, 10), (u, 4000)]) for u in TOKENS])


def test_more_requests_never_faster() -> None:
    for u, c in [(0, 0), (1, 0), (512, 0), (64, 65536), (8192, 1024)]:
        times = [prefill([(u, c)] * n) for n in range(1, 40)]
        assert non_decreasing(times)


def test_decode_monotone_in_batch_and_context() -> None:
    sizes = [1, 2, 4, 16, 64, 128, 256, 1024]
    for per_request in (0, 256, 8192):
        assert non_decreasing([decode(b, b * per_request) for b in sizes])
    for b in (1, 32, 256):
        assert non_decreasing([decode(b, c) for c in TOKENS])


def test_expected_is_deterministic_and_noise_free() -> None:
    noisy = RooflineTruth(noise=0.05, seed=3)
    batch = [(512, 2048), (33, 0)]
    assert noisy.expected_prefill_time(batch) == prefill(batch)
    assert noisy.expected_decode_time(8, 9000) == decode(8, 9000)
    assert EXACT.prefill_time(batch) == prefill(batch)  # noise 0: no jitter at all
    assert EXACT.decode_time(8, 9000) == decode(8, 9000)


def test_noise_is_reproducible_and_lognormal() -> None:
    a, b = RooflineTruth(seed=7), RooflineTruth(seed=7)
    draws_a = [a.decode_time(16, 16 * 4096) for _ in range(50)]
    assert draws_a == [b.decode_time(16, 16 * 4096) for _ in range(50)]
    assert draws_a != [RooflineTruth(seed=8).decode_time(16, 16 * 4096) for _ in range(50)]

    sigma, n = 0.02, 4000
    truth = RooflineTruth(noise=sigma, seed=11)
    expected = truth.expected_prefill_time([(1024, 4096)])
    logs = [math.log(truth.prefill_time([(1024, 4096)]) / expected) for _ in range(n)]
    assert abs(statistics.fmean(logs)) < 4 * sigma / math.sqrt(n)
    assert statistics.stdev(logs) == pytest.approx(sigma, rel=0.08)


def test_samples_carry_their_batch() -> None:
    truth = RooflineTruth(seed=1)
    s = truth.sample_prefill([(100, 0), (20, 5000)])
    assert s.phase == "prefill"
    assert s.batch == ((100, 0), (20, 5000))
    assert s.seconds == pytest.approx(prefill([(100, 0), (20, 5000)]), rel=0.15)
    d = truth.sample_decode(4, 12000)
    assert d == Sample("decode", d.seconds, batch_size=4, context_tokens=12000)
    assert d.requests == 4


# -- roofline regimes ----------------------------------------------------------------------------


def test_small_batch_decode_is_weight_read_bound() -> None:
    times = [decode(b, b * 256) for b in (1, 2, 4, 8, 16)]
    assert max(times) / min(times) < 1.1  # nearly flat: the weights are read once per iteration

    weight_read = MODEL.weight_bytes / TP / (GPU.hbm_bandwidth * EFF.memory)
    fixed = EFF.decode_overhead + EFF.per_request + 2 * MODEL.layers * EFF.all_reduce_latency
    assert decode(1, 256) == pytest.approx(weight_read + fixed, rel=0.03)
    assert 0.015 < decode(1, 2048) < 0.025  # Llama-3-70B TP4 H100, small batch: 15-25 ms
    parts = EXACT.breakdown_decode(1, 2048)
    assert sum(parts[op] for op in (*LINEAR_OPS, "lm_head")) > 0.75 * sum(parts.values())


def test_large_context_decode_is_kv_read_bound() -> None:
    parts = EXACT.breakdown_decode(64, 64 * 32768)
    kv_read = MODEL.kv_bytes_per_token * 64 * 32768 / TP / (GPU.hbm_bandwidth * EFF.memory)
    assert parts["attention"] == pytest.approx(kv_read)
    assert parts["attention"] > 0.5 * sum(parts.values())


def test_prefill_per_token_falls_to_the_gemm_asymptote() -> None:
    sizes = [16, 64, 128, 256, 512, 1024, 4096, 16384, 32768]
    batches = [[(min(n, 512), 0)] * max(1, n // 512) for n in sizes]
    per_token = [prefill(b) / n for b, n in zip(batches, sizes, strict=True)]
    assert all(a > b for a, b in itertools.pairwise(per_token))

    asymptote = 2 * MODEL.linear_params / TP / (GPU.flops * EFF.gemm_max)
    linear = [
        sum(EXACT.breakdown_prefill(b)[op] for op in LINEAR_OPS) / n
        for b, n in zip(batches, sizes, strict=True)
    ]
    assert linear[-1] == pytest.approx(asymptote, rel=0.01)
    assert linear[0] > 3 * asymptote  # below the knee the weight read dominates
    # Long-prompt throughput of a 4-GPU node: ~15k tokens/s (attention and all-reduce included).
    assert 13_000 < 8192 / prefill([(8192, 0)]) < 30_000


def test_attention_quadratic_in_uncached_linear_in_cached() -> None:
    def attention(u: int, c: int) -> float:
        return EXACT.breakdown_prefill([(u, c)])["attention"]

    assert attention(32768, 0) / attention(16384, 0) == pytest.approx(4.0, rel=0.03)
    steps = [attention(4096, c) for c in (32768, 65536, 98304, 131072)]
    diffs = np.diff(steps)
    assert diffs.min() > 0
    assert diffs.max() - diffs.min() < 1e-9 * steps[-1]  # constant increments: linear in t_c
    assert attention(0, 100_000) == 0.0  # nothing to compute without queries


# -- tensor parallelism --------------------------------------------------------------------------


def test_single_gpu_has_no_all_reduce_and_small_model_is_faster() -> None:
    small = RooflineTruth(Deployment(LLAMA3_8B, H100, tp=1), noise=0.0)
    assert small.breakdown_prefill([(4096, 0)])["all_reduce"] == 0.0
    assert small.breakdown_decode(8, 8 * 4096)["all_reduce"] == 0.0
    assert EXACT.breakdown_decode(8, 8 * 4096)["all_reduce"] > 0.0
    for b in (1, 16, 128):
        assert small.expected_decode_time(b, b * 2048) < decode(b, b * 2048)


# -- latent attention (Kimi K2 on 4 x GB300) ----------------------------------------------------

KIMI = RooflineTruth(Deployment(KIMI_K2, GB300, tp=4), noise=0.0)


def _kimi_weight_read_per_gpu(tp: int) -> float:
    """Bytes one GPU reads at batch 1: q_a and kv_a whole (replicated), the rest of attention,
    the dense layer, the shared experts and the LM head a 1/tp shard in BF16, the router whole,
    and 8 NVFP4 routed experts per MoE layer, sharded."""
    m = KIMI_K2
    replicated = m.hidden * (m.q_lora_rank + m.kv_lora_rank + m.rope_head_dim)
    attention = m.layers * (replicated + (m.attention_params_per_layer - replicated) / tp) * 2
    dense = m.dense_layers * 3 * m.hidden * m.intermediate * 2 / tp
    moe = m.moe_layers * (
        m.hidden * m.experts * 2
        + m.shared_experts * m.expert_params * 2 / tp
        + m.experts_per_token * m.expert_params * NVFP4 / tp
    )
    return attention + dense + moe + m.head_params * 2 / tp


def test_kimi_k2_sanity_figures() -> None:
    """Noise-free Kimi K2 on 4 x GB300 (truth.py's docstring, docs/research/deployment-figures.md):
    decode B=1 with 2k context ≈ 4.0 ms, weight-read bound (~9.9 GB a GPU at 0.85 x 8 TB/s, 1.0 ms
    of all-reduce latency, 1.5 ms overhead); B=64 x 8k ≈ 23.5 ms (284 of 384 experts touched a
    layer: the experts dominate; the latents are read whole on every GPU); an 8k prefill ≈ 0.12 s
    (≈ 66k tokens/s a node)."""
    gpu = GB300.hbm_bandwidth * EFF.memory
    fixed = EFF.decode_overhead + EFF.per_request + 2 * KIMI_K2.layers * EFF.all_reduce_latency
    one = KIMI.expected_decode_time(1, 2048)
    assert one == pytest.approx(_kimi_weight_read_per_gpu(4) / gpu + fixed, rel=0.03)
    assert 0.003 < one < 0.006

    parts = KIMI.breakdown_decode(64, 64 * 8192)
    total = sum(parts.values())
    assert 0.018 < total < 0.030
    assert parts["experts"] > 0.5 * total
    assert parts["attention"] == pytest.approx(KIMI_K2.kv_bytes_per_token * 64 * 8192 / gpu)

    assert 40_000 < 8192 / KIMI.expected_prefill_time([(8192, 0)]) < 100_000


def test_mla_decode_reads_the_whole_latent_on_every_gpu() -> None:
    """The latent is every head's KV: each GPU reads all of it, however many GPUs share the
    heads (GQA's heads, and their KV, split over the GPUs)."""
    kimi8 = RooflineTruth(Deployment(KIMI_K2, GB300, tp=8), noise=0.0)
    b, c = 64, 64 * 8192
    four, eight = KIMI.breakdown_decode(b, c), kimi8.breakdown_decode(b, c)
    assert four["attention"] == eight["attention"]
    glm4 = RooflineTruth(Deployment(GLM_4_5, GB300, tp=4), noise=0.0)
    glm8 = RooflineTruth(Deployment(GLM_4_5, GB300, tp=8), noise=0.0)
    gqa = glm8.breakdown_decode(b, c)["attention"] / glm4.breakdown_decode(b, c)["attention"]
    assert gqa == pytest.approx(0.5)
    # q_a and kv_a are replicated: the projections barely shrink from 4 to 8 GPUs (GQA's halve).
    qkv = kimi8.breakdown_decode(1, 2048)["qkv"] / KIMI.breakdown_decode(1, 2048)["qkv"]
    assert qkv > 0.8
    assert glm8.breakdown_decode(1, 2048)["qkv"] / glm4.breakdown_decode(1, 2048)["qkv"] < 0.6
    # At batch 1 each GPU reads what `_kimi_weight_read_per_gpu` counts, at 8 GPUs too.
    gpu = GB300.hbm_bandwidth * EFF.memory
    fixed = EFF.decode_overhead + EFF.per_request + 2 * KIMI_K2.layers * EFF.all_reduce_latency
    want = _kimi_weight_read_per_gpu(8) / gpu + fixed
    assert kimi8.expected_decode_time(1, 2048) == pytest.approx(want, rel=0.03)


def test_mla_prefill_runs_every_pair_in_mha_form_on_expanded_prefixes() -> None:
    """SGLang's MHA_CHUNKED_KV (its Blackwell path for every extend): kv_b expands the new and
    the cached latents, and every pair costs the MHA form's FLOPs."""

    def attention(u: int, c: int) -> float:
        return KIMI.breakdown_prefill([(u, c)])["attention"]

    # Compute-bound at 8k queries: a cached pair costs what a new pair does.
    new_pair = attention(8192, 0) / (8192 * 8193 / 2)
    cached_pair = (attention(8192, 65536) - attention(8192, 0)) / (8192 * 65536)
    assert cached_pair / new_pair == pytest.approx(1.0, rel=1e-9)
    steps = np.diff([attention(2048, c) for c in (8192, 16384, 24576, 32768)])
    assert steps.max() - steps.min() < 1e-9 * steps.max()  # linear in the cached tokens
    # The prefix's expansion: kv_b over the cached tokens as well as the new ones.
    short, long = (KIMI.breakdown_prefill([(512, c)])["kv_b"] for c in (0, 60_000))
    assert long > 50 * short > 0.0
    assert "mla_absorb" not in KIMI.breakdown_prefill([(512, 1000)])
    assert "kv_b" not in KIMI.breakdown_decode(8, 8000)  # decode absorbs instead
    assert KIMI.breakdown_decode(8, 8000)["mla_absorb"] > 0.0


# -- multi-token prediction -----------------------------------------------------------------------

PAPER_MODELS = [(KIMI_K2, GB300), (GLM_4_5, GB300), (LLAMA3_70B, H100)]
PAPER_IDS = ["kimi", "glm", "llama"]


def _mtp(model: ModelConfig, gpu: GpuSpec, d: int = 3) -> RooflineTruth:
    """4 GPUs, `d` draft tokens (0: plain decode) accepting 1 + d/2 (2.5 at d = 3)."""
    deployment = Deployment(model, gpu, tp=4, mtp_draft_tokens=d, mtp_accepted=1 + d / 2)
    return RooflineTruth(deployment, noise=0.0)


@pytest.mark.parametrize(("model", "gpu"), PAPER_MODELS, ids=PAPER_IDS)
def test_mtp_pays_at_small_batch(model: ModelConfig, gpu: GpuSpec) -> None:
    """An MTP iteration (3 draft steps and a 4-row verify) takes longer than a plain one but far
    less than 4: at 2.5 tokens accepted per iteration, tokens/s rise by > 1.5x at B=1."""
    plain, spec = _mtp(model, gpu, 0), _mtp(model, gpu)
    for b, c in [(1, 2048), (4, 4 * 2048)]:
        t0, t1 = plain.expected_decode_time(b, c), spec.expected_decode_time(b, c)
        assert t0 < t1 < 4 * t0
    gain = 2.5 * plain.expected_decode_time(1, 2048) / spec.expected_decode_time(1, 2048)
    assert gain > 1.5


@pytest.mark.parametrize(("model", "gpu"), PAPER_MODELS, ids=PAPER_IDS)
def test_mtp_gain_shrinks_once_compute_bound(model: ModelConfig, gpu: GpuSpec) -> None:
    plain, spec = _mtp(model, gpu, 0), _mtp(model, gpu)

    def gain(b: int, c: int) -> float:
        return 2.5 * plain.expected_decode_time(b, c) / spec.expected_decode_time(b, c)

    assert gain(2048, 2048 * 1024) < gain(1, 2048) - 0.2
    # The verify's GEMMs: at B=1 weight reads (4 rows cost what 1 does), at B=2048 compute (4x
    # the rows, ~4x the time).
    dense_ops = ("qkv", "o_proj")
    small = [sum(t.breakdown_decode(1, 2048)[op] for op in dense_ops) for t in (plain, spec)]
    large = [
        sum(t.breakdown_decode(2048, 2048 * 1024)[op] for op in dense_ops) for t in (plain, spec)
    ]
    assert small[1] / small[0] < 1.1
    assert large[1] / large[0] > 3.0


def test_mtp_breakdown_drafts_verify_and_draft_extend() -> None:
    plain, one, three = _mtp(LLAMA3_70B, H100, 0), _mtp(LLAMA3_70B, H100, 1), _mtp(LLAMA3_70B, H100)
    assert "draft" not in plain.breakdown_decode(8, 8000)
    assert "draft" not in plain.breakdown_prefill([(512, 0)])
    # d draft steps of the same one-layer draft, each over the whole context.
    d1, d3 = one.breakdown_decode(8, 8000)["draft"], three.breakdown_decode(8, 8000)["draft"]
    assert d3 == pytest.approx(3 * d1, rel=1e-12)
    # At B=1 a draft step reads one dense layer and the LM head: weight-read bound.
    m, gpu = LLAMA3_70B, H100.hbm_bandwidth * EFF.memory
    step = (m.linear_params_per_layer + m.head_params) * 2 / 4 / gpu + 2 * EFF.all_reduce_latency
    assert three.breakdown_decode(1, 2048)["draft"] == pytest.approx(3 * step, rel=0.05)
    # The verify's 4 queries a sequence read the KV once (memory-bound GQA attention).
    b, c = 64, 64 * 32768
    assert three.breakdown_decode(b, c)["attention"] == plain.breakdown_decode(b, c)["attention"]
    # MLA's absorbed kernel: 4x the FLOPs over a latent read once, less than 4x the time.
    latent = KIMI.breakdown_decode(b, b * 8192)["attention"]
    verify = _mtp(KIMI_K2, GB300).breakdown_decode(b, b * 8192)["attention"]
    assert latent <= verify < 4 * latent
    # Prefill: one draft layer over the prompt (whatever d), a few percent of the target's.
    batch = [(8192, 0), (300, 5000)]
    extend = three.breakdown_prefill(batch)["draft"]
    assert extend == one.breakdown_prefill(batch)["draft"]
    without = plain.expected_prefill_time(batch)
    assert three.expected_prefill_time(batch) == pytest.approx(without + extend)
    assert 0 < extend < 0.05 * without


@pytest.mark.parametrize(
    "truth",
    [KIMI, _mtp(KIMI_K2, GB300), _mtp(GLM_4_5, GB300)],
    ids=["kimi", "kimi-mtp", "glm-mtp"],
)
def test_latent_and_mtp_truths_are_monotone(truth: RooflineTruth) -> None:
    sizes = [1, 2, 4, 16, 64, 128, 256, 1024]
    for per_request in (0, 256, 8192):
        assert non_decreasing([truth.expected_decode_time(b, b * per_request) for b in sizes])
    for b in (1, 32, 256):
        assert non_decreasing([truth.expected_decode_time(b, c) for c in TOKENS])
    for other in (0, 300, 65536):
        assert non_decreasing([truth.expected_prefill_time([(u, other)]) for u in TOKENS])
        assert non_decreasing([truth.expected_prefill_time([(max(other, 1), c)]) for c in TOKENS])


# -- not the predictor's linear form -------------------------------------------------------------


def test_linear_features_cannot_match_the_truth() -> None:
    """OLS on the predictor's features `1, t_uc, A, t_c` (weighted for relative error) misses
    some single-request prefills by more than 5%: the max()es and the efficiency curves are not
    linear in those features, which is why the predictor needs its roofline handling."""
    rows, times = [], []
    for u in (1, 4, 16, 64, 256, 1024, 4096, 16384, 32768):
        for c in (0, 1024, 8192, 32768, 100_000):
            rows.append([1.0, u, u * c + u * (u + 1) / 2, c])
            times.append(prefill([(u, c)]))
    x, y = np.array(rows), np.array(times)
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    relative = np.abs(x @ coef - y) / y
    assert relative.max() > 0.05


# -- bad inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch", [[], [(-1, 0)], [(5, -1)], [(10, 10), (-3, 0)]], ids=["empty", "u", "c", "second"]
)
def test_bad_prefill_raises(batch: PrefillBatch) -> None:
    with pytest.raises(TruthInputError):
        EXACT.prefill_time(batch)
    with pytest.raises(TimingError):
        EXACT.sample_prefill(batch)


@pytest.mark.parametrize(("b", "c"), [(0, 100), (-2, 100), (4, -1)])
def test_bad_decode_raises(b: int, c: int) -> None:
    with pytest.raises(TruthInputError):
        EXACT.decode_time(b, c)


def test_bad_configuration_raises() -> None:
    with pytest.raises(TruthInputError, match="noise"):
        RooflineTruth(noise=-0.1)
    with pytest.raises(TruthInputError, match="noise"):
        RooflineTruth(noise=math.nan)
    with pytest.raises(ValueError, match="tensor"):  # the deployment itself refuses it
        RooflineTruth(Deployment(LLAMA3_8B, H100, tp=0))
