"""The hidden roofline ground truth (`evolving_infra.timing.truth`): monotonicity, noise, the
roofline regimes, tensor parallelism, input errors, and that it is not the predictor's linear form.
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
    with pytest.raises(TruthInputError, match="tensor"):
        RooflineTruth(Deployment(LLAMA3_8B, H100, tp=0))
