"""How well each iteration-time form predicts compositions it was not fitted on.

Protocol: every model sees the same stream of *fit* samples (small compositions), in order, as
an engine would produce them: sample k arrives when the iterations before it have run, so the
stream's clock is the sum of their times. Each is then judged on *held-out* samples that are
larger than anything fitted (longer prompts, longer cached contexts, bigger batches), as absolute
percentage errors, split into single requests (a one-request prefill, a decode of batch size 1)
and batches. Convergence is the stream time after which a model's held-out error stays within
max(1.25 x its final error, final + 1 point); `within_goal_s` the time after which it stays
under 5%.

Sources: the hidden roofline ground truth (`truth.RooflineTruth`, with a seeded composition plan
below) or measured samples from a CSV (`benches/gpu/iteration_profile.py`), split by size with the
same thresholds.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from evolving_infra.timing.samples import PrefillBatch, Sample, Timing

# A composition is "small" (fit) when its prefill computes at most FIT_MAX_UNCACHED new tokens
# over at most FIT_MAX_CACHED cached ones per request and at most FIT_MAX_REQUESTS requests, or
# its decode has at most FIT_MAX_BATCH requests of at most FIT_MAX_CONTEXT tokens each.
FIT_MAX_UNCACHED = 2048
FIT_MAX_CACHED = 16384
FIT_MAX_REQUESTS = 4
FIT_MAX_BATCH = 32
FIT_MAX_CONTEXT = 4096
# The held-out mean error a model must stay under to count as useful (the batched goal).
GOAL = 0.05


class Predictor(Protocol):
    def observe(self, sample: Sample, now: float | None = None) -> None: ...
    def predict_prefill(self, batch: PrefillBatch) -> float: ...
    def predict_decode(self, batch_size: int, context_tokens: int) -> float: ...


@dataclass(frozen=True, slots=True)
class Errors:
    n: int
    mean_ape: float | None  # mean absolute percentage error, as a fraction
    p95_ape: float | None


@dataclass(frozen=True, slots=True)
class ModelReport:
    name: str
    single: Errors
    batch: Errors
    prefill: Errors
    decode: Errors
    converged_s: float | None  # stream seconds of samples needed; None: never settled
    within_goal_s: float | None  # stream seconds after which the error stays <= GOAL; None: never
    curve: tuple[tuple[float, float], ...]  # (stream seconds, held-out mean APE) checkpoints
    predicted: tuple[float, ...]  # per held-out sample, for plots


def is_fit_sized(s: Sample) -> bool:
    if s.phase == "prefill":
        return len(s.batch) <= FIT_MAX_REQUESTS and all(
            u <= FIT_MAX_UNCACHED and c <= FIT_MAX_CACHED for u, c in s.batch
        )
    return s.batch_size <= FIT_MAX_BATCH and s.context_tokens <= FIT_MAX_CONTEXT * s.batch_size


def split(samples: Sequence[Sample]) -> tuple[list[Sample], list[Sample]]:
    """Measured samples into (fit, held-out) by size, keeping their order."""
    fit = [s for s in samples if is_fit_sized(s)]
    test = [s for s in samples if not is_fit_sized(s)]
    return fit, test


def _log_uniform(rng: random.Random, lo: float, hi: float) -> int:
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def truth_samples(
    truth: Timing, *, seed: int = 0, fit: int = 1200, test: int = 600
) -> tuple[list[Sample], list[Sample]]:
    """A seeded plan measured on `truth`: `fit` small samples (half prefill, half decode, mixed
    in random order) and `test` held-out larger ones."""
    rng = random.Random(seed)

    def prefill_request(max_uncached: int, min_cached: int, max_cached: int) -> tuple[int, int]:
        cached = 0 if rng.random() < 0.3 else _log_uniform(rng, max(min_cached, 64), max_cached)
        return _log_uniform(rng, 16, max_uncached), cached

    def sample(phase: str, large: bool) -> Sample:
        if phase == "prefill":
            n = 1 if rng.random() < 0.5 else rng.randint(2, 16 if large else FIT_MAX_REQUESTS)
            if large:
                # Longer new prompts, or far longer cached contexts, than anything fitted.
                if rng.random() < 0.5:
                    batch = [
                        (
                            _log_uniform(rng, FIT_MAX_UNCACHED, 16384),
                            _log_uniform(rng, 64, FIT_MAX_CACHED),
                        )
                        for _ in range(n)
                    ]
                else:
                    batch = [prefill_request(16384, FIT_MAX_CACHED, 65536) for _ in range(n)]
                    batch = [(u, max(c, FIT_MAX_CACHED + 1)) for u, c in batch]
            else:
                batch = [prefill_request(FIT_MAX_UNCACHED, 64, FIT_MAX_CACHED) for _ in range(n)]
            return Sample("prefill", truth.prefill_time(batch), batch=tuple(batch))
        if large:
            b = 1 if rng.random() < 0.3 else _log_uniform(rng, FIT_MAX_BATCH + 1, 256)
            per = _log_uniform(rng, FIT_MAX_CONTEXT + 1, 32768)
        else:
            b = 1 if rng.random() < 0.15 else _log_uniform(rng, 2, FIT_MAX_BATCH)
            per = _log_uniform(rng, 128, FIT_MAX_CONTEXT)
        context = b * per
        return Sample("decode", truth.decode_time(b, context), batch_size=b, context_tokens=context)

    fit_samples = [sample(rng.choice(("prefill", "decode")), False) for _ in range(fit)]
    test_samples = [sample("prefill" if k % 2 == 0 else "decode", True) for k in range(test)]
    return fit_samples, test_samples


def _predict(model: Predictor, s: Sample) -> float:
    if s.phase == "prefill":
        return model.predict_prefill(s.batch)
    return model.predict_decode(s.batch_size, s.context_tokens)


def _errors(ape: Sequence[float]) -> Errors:
    if not ape:
        return Errors(0, None, None)
    a = np.asarray(ape)
    return Errors(len(ape), float(a.mean()), float(np.percentile(a, 95)))


def _held_out_ape(model: Predictor, test: Sequence[Sample]) -> tuple[list[float], list[float]]:
    predicted = [_predict(model, s) for s in test]
    ape = [
        abs(p - s.seconds) / s.seconds if math.isfinite(p) else math.inf
        for p, s in zip(predicted, test, strict=True)
    ]
    return predicted, ape


def evaluate(
    name: str,
    model: Predictor,
    fit: Sequence[Sample],
    test: Sequence[Sample],
    checkpoints: int = 24,
) -> ModelReport:
    """Streams `fit` into `model`, checking held-out error along the way; then the final report."""
    marks = sorted(
        {max(1, round(len(fit) * (k / checkpoints) ** 2)) for k in range(1, checkpoints + 1)}
    )
    clock = 0.0
    curve: list[tuple[float, float]] = []
    for k, s in enumerate(fit, start=1):
        clock += s.seconds
        model.observe(s, now=clock)
        if k in marks:
            _, ape = _held_out_ape(model, test)
            curve.append((clock, float(np.mean(ape))))
    predicted, ape = _held_out_ape(model, test)
    single = [a for a, s in zip(ape, test, strict=True) if s.requests == 1]
    batch = [a for a, s in zip(ape, test, strict=True) if s.requests > 1]
    prefill = [a for a, s in zip(ape, test, strict=True) if s.phase == "prefill"]
    decode = [a for a, s in zip(ape, test, strict=True) if s.phase == "decode"]
    return ModelReport(
        name=name,
        single=_errors(single),
        batch=_errors(batch),
        prefill=_errors(prefill),
        decode=_errors(decode),
        converged_s=_converged(curve),
        within_goal_s=_settled_below(curve, GOAL),
        curve=tuple(curve),
        predicted=tuple(predicted),
    )


def _converged(curve: Sequence[tuple[float, float]]) -> float | None:
    if not curve or not math.isfinite(curve[-1][1]):
        return None
    final = curve[-1][1]
    return _settled_below(curve, max(1.25 * final, final + 0.01))


def _settled_below(curve: Sequence[tuple[float, float]], bound: float) -> float | None:
    """The first checkpoint time from which the error stays <= bound; None if the last is above."""
    at = None
    for t, e in reversed(curve):
        if not e <= bound:
            break
        at = t
    return at


def compare(
    models: Mapping[str, Callable[[], Predictor]],
    fit: Sequence[Sample],
    test: Sequence[Sample],
) -> list[ModelReport]:
    """Every model, fresh, on the same stream and the same held-out samples."""
    return [evaluate(name, make(), fit, test) for name, make in models.items()]
