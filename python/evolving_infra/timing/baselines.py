"""The iteration-time forms our model is compared with, fitted on the same samples.

- **DistServe** (Zhong et al., OSDI 2024, §3 / Appendix): prefill time is linear in the total
  prompt tokens Σl and in Σl² (attention, quadratic per request) — the paper writes the
  quadratic term as Σl²/B over its block size — plus a constant; decode time is linear in the
  batch size and the total context ΣC. It knows no prefix cache: l is the tokens computed now.
- **Vidur** (Agrawal et al., MLSys 2024): per-operator profiles keyed on, for attention prefill,
  the cached context and the square of the new tokens; as a batch regression over the same
  features that is `1, Σt_uc, Σt_uc², Σt_c` for prefill and `1, B, C` for decode (its random
  forests are replaced here by the linear fit those features imply).
- **Dynamo** (load planner, `docs/components/planner/planner-guide.md`): 1-D online regressions on
  the engine's forward-pass metrics, prefill tokens → wall time and decode KV tokens → wall
  time, over the last ≤ 64 samples.

Each is fitted by least squares weighted by 1/seconds (relative error, the metric they are judged
on: an unweighted fit would only be worse at small iterations), without sign constraints.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from evolving_infra.timing.samples import PrefillBatch, Sample

Features = Callable[[PrefillBatch], list[float]]
DecodeFeatures = Callable[[int, int], list[float]]


def _distserve_prefill(batch: PrefillBatch) -> list[float]:
    return [1.0, float(sum(u for u, _ in batch)), float(sum(u * u for u, _ in batch))]


def _vidur_prefill(batch: PrefillBatch) -> list[float]:
    total = float(sum(u for u, _ in batch))
    return [1.0, total, float(sum(u * u for u, _ in batch)), float(sum(c for _, c in batch))]


def _dynamo_prefill(batch: PrefillBatch) -> list[float]:
    return [1.0, float(sum(u for u, _ in batch))]


def _linear_decode(batch_size: int, context: int) -> list[float]:
    return [1.0, float(batch_size), float(context)]


def _dynamo_decode(batch_size: int, context: int) -> list[float]:
    del batch_size  # the regression's one input is the decode KV tokens
    return [1.0, float(context)]


@dataclass
class _Fit:
    rows: deque[tuple[list[float], float]]
    coef: npt.NDArray[np.float64] | None = None
    dirty: bool = False

    def add(self, x: list[float], y: float) -> None:
        self.rows.append((x, y))
        self.dirty = True

    def predict(self, x: list[float]) -> float:
        if self.dirty:
            self._refit()
        if self.coef is None:
            return float("nan")
        return float(np.dot(self.coef, x))

    def _refit(self) -> None:
        self.dirty = False
        if len(self.rows) < 2:
            return
        xs = np.array([r[0] for r in self.rows], dtype=np.float64)
        ys = np.array([r[1] for r in self.rows], dtype=np.float64)
        w = 1.0 / ys
        coef, *_ = np.linalg.lstsq(xs * w[:, None], ys * w, rcond=None)
        self.coef = np.asarray(coef, dtype=np.float64)


@dataclass
class FormModel:
    """A baseline form: features per phase, a weighted least-squares fit over a window."""

    name: str
    prefill_features: Features
    decode_features: DecodeFeatures
    window: int | None = None  # samples kept per phase; None: all
    _prefill: _Fit = field(init=False)
    _decode: _Fit = field(init=False)

    def __post_init__(self) -> None:
        self._prefill = _Fit(deque(maxlen=self.window))
        self._decode = _Fit(deque(maxlen=self.window))

    def observe(self, s: Sample, now: float | None = None) -> None:
        del now
        if s.phase == "prefill":
            self._prefill.add(self.prefill_features(s.batch), s.seconds)
        else:
            self._decode.add(self.decode_features(s.batch_size, s.context_tokens), s.seconds)

    def predict_prefill(self, batch: PrefillBatch) -> float:
        return self._prefill.predict(self.prefill_features(batch))

    def predict_decode(self, batch_size: int, context_tokens: int) -> float:
        return self._decode.predict(self.decode_features(batch_size, context_tokens))


def distserve() -> FormModel:
    return FormModel("distserve", _distserve_prefill, _linear_decode)


def vidur() -> FormModel:
    return FormModel("vidur", _vidur_prefill, _linear_decode)


def dynamo() -> FormModel:
    return FormModel("dynamo", _dynamo_prefill, _dynamo_decode, window=64)


BASELINES: dict[str, Callable[[], FormModel]] = {
    "distserve": distserve,
    "vidur": vidur,
    "dynamo": dynamo,
}


def names() -> Sequence[str]:
    return tuple(BASELINES)
