"""The online iteration-time model: what the router and the planner believe an iteration costs.

Prefill features are `1, Σt_uc, max(0, Σt_uc - knee), ΣA, Σt_c` with A = t_uc·t_c +
t_uc(t_uc+1)/2 (query-key pairs); decode features are `1, B, max(0, B - knee), C`. The hinge
term is the roofline: below the knee the linear layers are bound by reading the weights, so the
time is nearly flat in tokens; above it they are compute-bound and grow at the compute slope.
With non-negative coefficients the slope can only rise past the knee, which is that shape. The
knee is picked by a small grid search (quantiles of the window's token counts, the previous and
the prior knee, and "no hinge") minimising the fit error.

Fitting is NNLS in relative terms: each row is divided by its measured seconds, so a 5 ms
iteration weighs as much as a 2 s one (the goal is percentage error); columns are scaled to unit
norm for conditioning. Samples live in a window bounded by count and age so the model follows
drift; it refits after every sample while warming up, then every `refit_every` samples (observe
pays for it; predictions never refit).

An optional prior from a `Deployment` gives analytic coefficients, used until enough samples
arrive and, while samples are few, as pseudo-samples over the operating range (weighing
`prior_weight` samples, fading as samples accumulate) that pin what the window cannot identify.
Without a prior and with too few samples, a generic roofline shape scaled to the data stands
in. A rank-deficient window (e.g. one composition repeated) keeps the last good fit rescaled to
the data, else the prior corrected by the data. Predictions never raise; they are finite and > 0.

Not thread-safe: one engine loop owns a model; guard it with a lock to share it.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from evolving_infra.timing.samples import BadSampleError, PrefillBatch, Sample, TimingError
from evolving_infra.timing.specs import Deployment, ModelConfig
from evolving_infra.types import Phase

FloatArray = npt.NDArray[np.float64]

MAX_SECONDS = 3600.0  # no engine iteration takes an hour: such a sample is a clock bug
MAX_TOKENS = 10_000_000  # per request (and per request on average for a decode's context)
_MIN_SECONDS = 1e-6  # floor on predictions, so callers can divide by them
_RCOND = 1e-6  # smallest/largest singular value of the scaled design below which it is singular
_HINGE = 2  # column of the hinge term in both designs
_MIX = np.array([1.0, 0.7548776662466927, 0.5698402909980532])  # irrational: hashes int rows
_NAMES: dict[Phase, tuple[str, ...]] = {
    "prefill": ("intercept", "uncached", "hinge", "attention", "cached"),
    "decode": ("intercept", "batch", "hinge", "context"),
}

# Rough efficiencies for the analytic prior (assumptions, not measurements): GEMMs reach ~60% of
# the dense peak, attention ~50%, streaming kernels ~80% of HBM bandwidth, all-reduces ~80% of
# NVLink; ~2 ms of launch/scheduling per iteration and ~8 µs latency per all-reduce.
PRIOR_COMPUTE_EFF, PRIOR_ATTENTION_EFF, PRIOR_MEMORY_EFF, PRIOR_LINK_EFF = 0.6, 0.5, 0.8, 0.8
PRIOR_OVERHEAD_S, PRIOR_ALLREDUCE_S = 2e-3, 8e-6

# Without a prior, before the fit: a dimensionless roofline shape in units of the weight-read
# floor (knee at 256 tokens; per-pair attention and per-cached/context-token costs at the ratios
# Llama-class models have to a token's linear cost), scaled to the data by one factor. Before
# the first sample that factor is a 10 ms floor, a placeholder only.
_GENERIC_KNEE = 256.0
_GENERIC: dict[Phase, tuple[float, ...]] = {
    "prefill": (1.0, 0.0, 1 / _GENERIC_KNEE, 2.5e-5 / _GENERIC_KNEE, 1e-3 / _GENERIC_KNEE),
    "decode": (1.0, 0.0, 1 / _GENERIC_KNEE, 4e-6),
}
_GENERIC_SCALE_S = 10e-3


class PrefillForm(NamedTuple):
    """A prefill iteration's time as the model writes it, with its fitted figures: seconds =
    intercept + uncached·U + hinge·max(0, U - knee) + attention·A + cached·C over the batch's
    uncached tokens U, query-key pairs A (Σ u·c + u(u+1)/2) and cached tokens C (module
    docstring), at least `_MIN_SECONDS`. The one evaluation of the form in Python (`totals`,
    `seconds`, `many`); the TTFT scorer takes the record as it is (a tuple:
    `kvdir::scoring::PrefillForm`), so the two cannot drift apart in what they are given."""

    intercept: float
    uncached: float
    hinge: float
    attention: float
    cached: float
    knee: float  # uncached tokens; inf: no hinge

    def totals(self, uncached: float, pairs: float, cached: float) -> float:
        """Seconds of an iteration from its summed features."""
        b0, b1, b2, b3, b4, knee = self
        t = b0 + b1 * uncached + (b2 * (uncached - knee) if uncached > knee else 0.0)
        t += b3 * pairs
        t += b4 * cached
        return max(t, _MIN_SECONDS)

    def seconds(self, uncached: float, cached: float) -> float:
        """Seconds of one request's prefill alone."""
        return self.totals(uncached, uncached * cached + uncached * (uncached + 1) * 0.5, cached)

    def many(self, uncached: npt.ArrayLike, cached: npt.ArrayLike) -> FloatArray:
        """`seconds` per element (vectorized: a handful of numpy operations)."""
        b0, b1, b2, b3, b4, knee = self
        u, c = np.asarray(uncached, np.float64), np.asarray(cached, np.float64)
        t = b0 + b1 * u + b2 * np.maximum(u - knee, 0.0)
        t = t + b3 * (u * c + u * (u + 1.0) * 0.5) + b4 * c
        out: FloatArray = np.maximum(t, _MIN_SECONDS)
        return out


@dataclass(frozen=True, slots=True)
class _Fit:
    beta: FloatArray  # coefficients in _NAMES order, seconds per unit of each feature
    knee: float  # tokens (prefill) or requests (decode); inf means no hinge
    source: str  # "fit", "last-fit", "prior" or "fallback": where these numbers came from
    # The coefficients as Python floats: one prediction in plain arithmetic costs a fraction of
    # a microsecond, where numpy's per-call overhead is several (the router predicts per node).
    coef: tuple[float, ...] = field(init=False)
    # A prefill fit's figures as the form that evaluates them (None for a decode fit).
    form: PrefillForm | None = field(init=False)

    def __post_init__(self) -> None:
        coef = tuple(float(b) for b in self.beta)
        object.__setattr__(self, "coef", coef)
        form = None
        if len(coef) == len(_NAMES["prefill"]):
            b0, b1, b2, b3, b4 = coef
            form = PrefillForm(b0, b1, b2, b3, b4, self.knee)
        object.__setattr__(self, "form", form)

    def predict(self, raw: FloatArray) -> FloatArray:
        return np.maximum(_design(raw, self.knee) @ self.beta, _MIN_SECONDS)

    def one(self, x0: float, *rest: float) -> float:
        """The prediction for one row of raw features (x0, rest...), in plain floats."""
        b = self.coef
        t = b[0] + b[1] * x0 + (b[2] * (x0 - self.knee) if x0 > self.knee else 0.0)
        for k, x in enumerate(rest, start=3):
            t += b[k] * x
        return max(t, _MIN_SECONDS)

    def scaled(self, factor: float, source: str) -> _Fit:
        return _Fit(self.beta * factor, self.knee, source)


def _design(raw: FloatArray, knee: float) -> FloatArray:
    """Rows of raw features (x0, rest...) -> (1, x0, max(0, x0 - knee), rest...)."""
    x0 = raw[:, 0]
    hinge = np.maximum(x0 - knee, 0.0)  # x0 - inf = -inf: no hinge, no warning
    return np.column_stack([np.ones_like(x0), x0, hinge, raw[:, 1:]])


class _Ring:
    """Fixed-capacity rows of (time, values...): the count bound is the capacity."""

    def __init__(self, capacity: int, width: int) -> None:
        self._data = np.zeros((capacity, width + 1))
        self._n = self._i = 0

    def push(self, t: float, values: FloatArray) -> None:
        self._data[self._i, 0] = t
        self._data[self._i, 1:] = values
        self._i = (self._i + 1) % len(self._data)
        self._n = min(self._n + 1, len(self._data))

    def since(self, cutoff: float) -> FloatArray:
        rows = self._data[: self._n]
        return rows[rows[:, 0] >= cutoff, 1:]


@dataclass
class _PhaseState:
    samples: _Ring  # rows: seconds, raw features
    errors: _Ring  # rows: out-of-sample absolute percentage error (a fraction)
    fit: _Fit
    prior: _Fit | None
    generic: _Fit
    min_samples: int  # distinct compositions a fit of its own needs
    pseudo: FloatArray  # raw features of the compositions the prior speaks for
    last_good: _Fit | None = None
    # The largest batch (decode) or token count (prefill) in the window the fit was made on:
    # past it, a decode prediction takes its shape from the prior (`predict_decode`).
    seen_max: float = math.inf
    pending: int = 0
    refits: int = 0
    seen: int = 0


def _prior_fits(deployment: Deployment) -> dict[Phase, _Fit]:
    """Analytic coefficients from the roofline of `deployment`, with the rough efficiencies above.

    Weight read W/(tp·bw) is the floor (intercept); the compute slope 2·params/(tp·peak) applies
    past the knee W/slope; all-reduce bytes per token cost a slope everywhere (they are not hidden
    by the weight read); attention FLOPs per query-key pair and KV bytes per cached token add.

    Latent attention (MLA): every GPU reads the whole latent cache (it is the KV of one head
    shared by all), so a cached or context token costs `model.kv_bytes_per_token` / bw of one
    GPU, not / tp; the replicated down-projections (q_a, kv_a) are read by every GPU; decode
    attention costs the larger of that read and the absorbed form's FLOPs; a prefill pair costs
    the non-absorbed (MHA) form's FLOPs, and a cached token its latent's expansion by kv_b
    (SGLang's MHA with chunked KV, its path on Blackwell) beside its read.

    A mixture of experts: a decode step's rows read the routed experts they touch, more as the
    batch grows (a slope per row up to the batch whose 128 rows touch nearly every expert, the
    hinge there giving it back), and a prefill iteration's floor counts the experts 512 tokens
    touch (nearly all): 0.7-1.25x the truth from batch 1 to 1,024 on Kimi K2 and GLM-4.5.

    MTP (`mtp_draft_tokens` d > 0): a decode step verifies B·(1+d) rows (the per-row slopes and
    the attention FLOPs times 1+d, the weights and the KV read once) and runs d draft steps of one
    dense layer and the LM head at B rows (their weight reads in the floor, their compute and
    all-reduces per row, their one-layer KV read per context token); a prefill adds one draft
    layer over its tokens. The features stay `1, B, C` (decode) and `1, Σt_uc, ΣA, Σt_c`.
    """
    m, g, tp = deployment.model, deployment.gpu, deployment.tp
    d = deployment.mtp_draft_tokens
    mla = m.kv_lora_rank > 0
    bw = tp * g.hbm_bandwidth * PRIOR_MEMORY_EFF
    one_gpu = g.hbm_bandwidth * PRIOR_MEMORY_EFF
    flops = tp * g.flops * PRIOR_COMPUTE_EFF
    # What one token reads (a mixture of experts reads more as the batch grows: below); a dense
    # model reads all of it.
    weight_s = m.active_weight_bytes / bw
    if mla:  # q_a and kv_a (kv_a alone without q_lora_rank): every GPU reads all of them
        down = m.layers * m.hidden * (m.q_lora_rank + m.kv_lora_rank + m.rope_head_dim)
        weight_s += down * m.bytes_per_param * (1 - 1 / tp) / one_gpu
    comm, comm0 = 0.0, 0.0
    if tp > 1:
        moved = 2 * (tp - 1) / tp * m.hidden * m.bytes_per_param  # ring all-reduce, per token
        comm = 2 * m.layers * moved / (g.link_bandwidth * PRIOR_LINK_EFF)
        comm0 = 2 * m.layers * PRIOR_ALLREDUCE_S
    if mla:  # one GPU reads all of the latent
        kv_s = m.kv_bytes_per_token / one_gpu
        # QK^T and PV per pair and layer: the MHA form in prefill (on keys and values kv_b
        # expanded, the prefix's too), the absorbed one in decode.
        mha = 2 * m.layers * m.heads * ((m.head_dim + m.rope_head_dim) + m.head_dim)
        absorbed = 2 * m.layers * m.heads * (m.kv_lora_rank + m.rope_head_dim + m.kv_lora_rank)
        attn = mha / (tp * g.flops * PRIOR_ATTENTION_EFF)
        expand_s = 2 * m.layers * m.kv_lora_rank * m.heads * 2 * m.head_dim / flops
        dec_ctx = max(kv_s, (1 + d) * absorbed / (tp * g.flops * PRIOR_ATTENTION_EFF))
    else:
        kv_s, expand_s = m.kv_bytes_per_token / bw, 0.0
        attn = m.attention_flops_per_pair / (tp * g.flops * PRIOR_ATTENTION_EFF)
        # Decode attention reads the KV once per step: memory-bound (GQA: ~1 FLOP per byte per
        # query), so the byte cost is the cost, unless 1+d verified queries outweigh it.
        dec_ctx = max(kv_s, (1 + d) * attn) if d else kv_s
    pre_slope = 2 * m.active_params / flops
    # Decode runs the LM head for every token; prefill only for the last one (ignored).
    dec_slope = 2 * (m.active_params + m.head_params) / flops
    floor = PRIOR_OVERHEAD_S + weight_s + comm0
    # A mixture of experts reads each routed expert its rows touch once: a decode step's rows
    # read more of them as the batch grows (the extra read as a slope per row, linear up to
    # `_PRIOR_EXPERT_ROWS` rows, where Kimi K2 touches ~3/4 of its experts), and a prefill
    # iteration of a few hundred tokens or more reads nearly all of them (its floor).
    per_row = (_expert_read_s(m, bw, _PRIOR_EXPERT_ROWS) - _expert_read_s(m, bw, 1)) / (
        _PRIOR_EXPERT_ROWS - 1
    )
    saturate = _PRIOR_EXPERT_ROWS / (1 + d)  # the batch whose rows touch nearly every expert
    pre_floor = floor + _expert_read_s(m, bw, _PRIOR_PREFILL_ROWS) - _expert_read_s(m, bw, 1)
    pre = np.array([pre_floor, comm, pre_slope, attn, kv_s + expand_s])
    dec = np.array([floor, comm + per_row, dec_slope, dec_ctx])
    pre_knee, dec_knee = weight_s / pre_slope, weight_s / dec_slope
    if d:
        # The draft: one dense layer (its attention and a dense MLP of `intermediate`), its
        # one-layer KV, the LM head; the weights read once a pass, sharded like the target's.
        layer = m.attention_params_per_layer + 3 * m.hidden * m.intermediate
        draft_w = layer * m.bytes_per_param / bw
        head_w = m.head_params * m.bytes_per_param / bw
        draft_comm0, draft_comm = comm0 / m.layers, comm / m.layers
        draft_kv = kv_s / m.layers
        pre = pre + np.array(
            [draft_w + draft_comm0, draft_comm, 2 * layer / flops, attn / m.layers, draft_kv]
        )
        dec = np.array(
            [
                floor + d * (draft_w + head_w + draft_comm0),
                (1 + d) * (comm + per_row) + d * draft_comm,
                (1 + d) * dec_slope + d * 2 * (layer + m.head_params) / flops,
                dec_ctx + d * draft_kv,
            ]
        )
        pre_knee = float((weight_s + draft_w) / pre[_HINGE])
        dec_knee = float((weight_s + d * (draft_w + head_w)) / dec[_HINGE])
    if m.experts:
        # Past the batch that reads every expert, a step grows by its compute alone: the
        # hinge moves there and its slope gives back the expert reads' (the fit keeps its own
        # knee and coefficients).
        dec_knee = max(dec_knee, saturate)
        dec[_HINGE] -= (1 + d) * per_row
    return {
        "prefill": _Fit(pre, pre_knee, "prior"),
        "decode": _Fit(dec, dec_knee, "prior"),
    }


_PRIOR_EXPERT_ROWS = 128  # decode rows by which the prior counts every expert read (Kimi K2: 93%)
_PRIOR_PREFILL_ROWS = 512  # a typical prefill iteration's tokens, for its expert reads


def _expert_read_s(m: ModelConfig, bw: float, rows: float) -> float:
    """Seconds to read the routed experts `rows` tokens touch in every MoE layer (0: dense)."""
    if not m.experts:
        return 0.0
    touched = m.distinct_experts(rows)
    return m.moe_layers * touched * m.expert_params * m.expert_bytes_per_param / bw


def _pseudo(phase: Phase) -> FloatArray:
    """Compositions spanning the operating range, where the prior's pseudo-samples sit."""
    if phase == "decode":
        return np.array([[b, b * c] for b in (1, 8, 64, 256, 512) for c in (256, 4096, 32768)])
    singles = [[(u, c)] for u in (1, 64, 512, 4096, 32768) for c in (0, 8192, 65536)]
    batches = [[(256, 0)] * 8, [(1024, 8192)] * 16, [(64, 2048)] * 64]
    return np.vstack([_prefill_raw(b) for b in singles + batches])


def _scale(fit: _Fit, raw: FloatArray, y: FloatArray) -> float:
    """The one factor that best fits `fit`'s shape to the data (median ratio: robust)."""
    return float(np.median(y / fit.predict(raw)))


def _count(value: object, what: str, limit: int = MAX_TOKENS) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise BadSampleError(f"{what} must be an integer, got {value!r}")
    v = int(value)
    if not 0 <= v <= limit:
        raise BadSampleError(f"{what} must be in [0, {limit}], got {v}")
    return v


def _seconds(value: float) -> float:
    if not isinstance(value, numbers.Real) or not 0 < float(value) <= MAX_SECONDS:  # NaN too
        raise BadSampleError(f"seconds must be in (0, {MAX_SECONDS}], got {value!r}")
    return float(value)


def _prefill_raw(batch: PrefillBatch) -> FloatArray:
    """(Σt_uc, ΣA, Σt_c) of a batch, summed exactly in integers."""
    u_sum = a_sum = c_sum = 0
    for u, c in batch:
        u_sum += u
        a_sum += u * c + u * (u + 1) // 2
        c_sum += c
    return np.array([[u_sum, a_sum, c_sum]], dtype=np.float64)


_Normal = tuple[FloatArray, FloatArray, float, FloatArray]  # x^T x, x^T target, |target|², norms


def _nnls(normal: _Normal, idx: list[int], knee: float, ref: _Fit) -> tuple[float, _Fit] | None:
    """Minimise |x·b - target|² with b >= 0 over the columns `idx`, from the normal equations.

    Columns are scaled to unit norm (conditioning); NNLS on the Cholesky factor has the same
    minimiser as NNLS on the tall weighted design. Returns the objective and the fit.
    """
    gram, h, const, norms = normal
    p = len(ref.beta)
    which = [j if j < p else _HINGE for j in idx]  # a candidate's hinge is the hinge term
    nrm = norms[idx]
    g = gram[idx][:, idx] / np.outer(nrm, nrm)
    b = h[idx] / nrm
    try:
        chol = np.linalg.cholesky(g)
        # Imported here: scipy.optimize takes ~1 s to import (see planner/evolving.py).
        from scipy.optimize import nnls

        gamma, _ = nnls(chol.T, np.linalg.solve(chol, b))
    except (np.linalg.LinAlgError, RuntimeError):
        return None  # not positive definite, or NNLS hit its iteration limit
    beta = ref.beta.copy()  # empty columns keep the reference's value...
    if math.isinf(knee):
        beta[_HINGE] = 0.0  # ...except "no hinge", which means no hinge
    beta[which] = gamma / nrm
    if not np.all(np.isfinite(beta)):
        return None
    return float(gamma @ g @ gamma - 2 * b @ gamma) + const, _Fit(beta, knee, "fit")


class IterationModel:
    """Online, non-negative, roofline-aware iteration-time model (implements `samples.Timing`)."""

    def __init__(
        self,
        prior: Deployment | None = None,
        *,
        max_samples: int = 2000,
        max_age: float = 600.0,
        refit_every: int = 16,
        prior_weight: float = 8.0,
        hinge: bool = True,
    ) -> None:
        if max_samples < 1 or refit_every < 1 or not max_age > 0 or not prior_weight >= 0:
            raise TimingError("need max_samples, refit_every >= 1, max_age > 0, prior_weight >= 0")
        self.max_samples, self.max_age, self.refit_every = max_samples, float(max_age), refit_every
        self.prior_weight, self.hinge, self.deployment = float(prior_weight), hinge, prior
        priors = _prior_fits(prior) if prior is not None else None
        self._clock = -math.inf  # the latest `now` observed: ages are measured from it
        self._phases: dict[Phase, _PhaseState] = {}
        for phase, names in _NAMES.items():
            generic = _Fit(np.array(_GENERIC[phase]), _GENERIC_KNEE, "fallback")
            p = priors[phase] if priors is not None else None
            self._phases[phase] = _PhaseState(
                samples=_Ring(max_samples, 1 + len(names) - 2),
                errors=_Ring(max_samples, 1),
                fit=p if p is not None else generic.scaled(_GENERIC_SCALE_S, "fallback"),
                prior=p,
                generic=generic,
                # Four per coefficient: a fit on fewer distinct compositions (e.g. a window of
                # one composition and a handful of others) extrapolates wildly.
                min_samples=4 * len(names),
                pseudo=_pseudo(phase),
            )

    # -- observing ------------------------------------------------------------------------------

    def observe_prefill(
        self, batch: PrefillBatch, seconds: float, now: float | None = None
    ) -> None:
        """Add one measured prefill iteration; BadSampleError (changing nothing) if absurd."""
        try:
            checked = [(_count(u, "uncached tokens"), _count(c, "cached tokens")) for u, c in batch]
        except BadSampleError:
            raise
        except (TypeError, ValueError) as e:
            raise BadSampleError(f"a prefill batch is (uncached, cached) pairs: {e}") from None
        if not checked:
            raise BadSampleError("a prefill sample needs at least one request")
        self._add("prefill", _prefill_raw(checked)[0], _seconds(seconds), now)

    def observe_decode(
        self, batch_size: int, context_tokens: int, seconds: float, now: float | None = None
    ) -> None:
        """Add one measured decode iteration; BadSampleError (changing nothing) if absurd."""
        b = _count(batch_size, "batch size")
        if b == 0:
            raise BadSampleError("a decode sample needs batch_size > 0")
        c = _count(context_tokens, "context tokens", MAX_TOKENS * b)
        self._add("decode", np.array([b, c], dtype=np.float64), _seconds(seconds), now)

    def observe(self, sample: Sample, now: float | None = None) -> None:
        if sample.phase == "prefill":
            self.observe_prefill(sample.batch, sample.seconds, now)
        elif sample.phase == "decode":
            self.observe_decode(sample.batch_size, sample.context_tokens, sample.seconds, now)
        else:
            raise BadSampleError(f"unknown phase {sample.phase!r}")

    def _add(self, phase: Phase, raw: FloatArray, seconds: float, now: float | None) -> None:
        t = time.monotonic() if now is None else now
        if not isinstance(t, numbers.Real) or not math.isfinite(t):
            raise BadSampleError(f"now must be a finite time, got {now!r}")
        ph = self._phases[phase]
        # Score the prediction made before the sample joins the fit: an honest, out-of-sample
        # error, the same thing the router suffers when it relies on the model.
        predicted = float(ph.fit.predict(raw[None, :])[0])
        self._clock = max(self._clock, float(t))
        ph.errors.push(t, np.array([abs(predicted - seconds) / seconds]))
        ph.samples.push(t, np.concatenate(([seconds], raw)))
        ph.pending += 1
        ph.seen += 1
        # While warming up (twice the minimum sample count) every sample refits: small, cheap.
        if ph.pending >= self.refit_every or ph.seen <= 2 * ph.min_samples:
            self._refit(phase)

    # -- fitting --------------------------------------------------------------------------------

    def _refit(self, phase: Phase) -> None:
        ph = self._phases[phase]
        ph.pending = 0
        rows = ph.samples.since(self._clock - self.max_age)
        if len(rows) == 0:
            return  # everything aged out: keep what we had rather than forget it
        y, raw = rows[:, 0], rows[:, 1:]
        distinct = len(np.unique(raw @ _MIX[: raw.shape[1]]))  # rows, told apart by a hash
        fit = self._solve(ph, raw, y) if distinct >= ph.min_samples else None
        if fit is not None:
            ph.fit = ph.last_good = fit
            ph.seen_max = float(raw[:, 0].max())
        elif ph.last_good is not None:
            # Singular window: the last good fit, rescaled by one factor to the data.
            ph.fit = ph.last_good.scaled(_scale(ph.last_good, raw, y), "last-fit")
        elif ph.prior is not None:
            # Too few samples, or a singular window: the prior, moved only as far as the data
            # can say (its pseudo-samples make even one composition a well-posed problem).
            ph.fit = self._solve(ph, raw, y, anchored=True) or ph.prior
        else:
            ph.fit = ph.generic.scaled(_scale(ph.generic, raw, y), "fallback")

    def _solve(
        self, ph: _PhaseState, raw: FloatArray, y: FloatArray, anchored: bool = False
    ) -> _Fit | None:
        """NNLS over every knee candidate at once, through one Gram matrix.

        Candidates differ only in the hinge column, so one product of the weighted design with
        every candidate's hinge column gives each candidate's normal equations; each is then a
        tiny NNLS on its Cholesky factor (same minimiser as the tall problem), which keeps a
        2,000-sample refit with a dozen knees near a millisecond. `anchored` fits at the prior's
        knee and accepts a rank-deficient window (the prior's pseudo-samples fill the gaps).
        """
        n, p = raw.shape[0], raw.shape[1] + 2
        if anchored and ph.prior is not None:
            knees = [ph.prior.knee]
        else:
            # The full knee search every 4th refit (and until a fit exists); in between, only
            # the coefficients at the current knee follow the data, at a tenth of the cost.
            ph.refits += 1
            knees = self._knees(ph, raw[:, 0], ph.refits % 4 == 1 or ph.last_good is None)
        finite = np.array([k for k in knees if math.isfinite(k)])

        def weighted(r: FloatArray, t: FloatArray, w: float) -> FloatArray:
            dd = np.hstack([_design(r, math.inf), np.maximum(r[:, :1] - finite, 0.0)])
            return dd * (w / t)[:, None]  # relative error: residuals are fractions off

        x = weighted(raw, y, 1.0)
        gram = x.T @ x
        h = x.sum(axis=0)  # x^T 1: every row's target is 1 (the measured time, relatively)
        norms = np.sqrt(np.diag(gram))
        cols = [j for j in range(p) if j != _HINGE and norms[j] > 0]
        if not anchored:
            ev = np.linalg.eigvalsh(gram[cols][:, cols] / np.outer(norms[cols], norms[cols]))
            if n < len(cols) or ev[0] <= _RCOND**2 * ev[-1]:
                return None  # the window cannot tell the terms apart (eigenvalues: sv squared)
        const = float(n)
        if ph.prior is not None and self.prior_weight > 0:
            # The prior as pseudo-samples over the operating range, weighing `prior_weight`
            # samples in all at first and fading like (n0/(n0 + n))²: it pins what the window
            # cannot identify (attention, when every prompt is short) while samples are few.
            k = self.prior_weight * (2 * ph.min_samples / (2 * ph.min_samples + n)) ** 2
            xp = weighted(ph.pseudo, ph.prior.predict(ph.pseudo), math.sqrt(k / len(ph.pseudo)))
            gram, h = gram + xp.T @ xp, h + xp.sum(axis=0) * math.sqrt(k / len(ph.pseudo))
            const += k
            norms = np.sqrt(np.diag(gram))
            cols = [j for j in range(p) if j != _HINGE and norms[j] > 0]
        # Terms still unseen (empty columns) keep the reference's value, at the data's scale.
        base = ph.last_good or ph.generic
        ref = base.scaled(_scale(base, raw, y), "")
        best: tuple[float, _Fit] | None = None
        for i, knee in enumerate(knees):
            # Column of this candidate's hinge (none for "no hinge").
            hc = [p + i] if math.isfinite(knee) and norms[p + i] > 0 else []
            fit = _nnls((gram, h, const, norms), cols + hc, knee, ref)
            if fit is not None and (best is None or fit[0] < best[0]):
                best = fit
        if best is None:
            return None
        return best[1].scaled(1.0, "prior") if anchored else best[1]

    def _knees(self, ph: _PhaseState, x0: FloatArray, full: bool) -> list[float]:
        """Candidate knees: the previous and prior knees, window quantiles, and no hinge."""
        last = ph.last_good.knee if ph.last_good else math.inf
        if not self.hinge or (not full and math.isinf(last)):
            return [math.inf]
        uniq = np.unique(x0)
        raw = [last]
        if full:
            raw.append(ph.prior.knee if ph.prior else math.inf)
            raw.extend(np.quantile(x0, (0.05, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8)).tolist())
        out: list[float] = []
        for k in raw:
            # Inside the data a knee needs points on both sides (3 distinct above, or the hinge
            # slope is noise); at or past the largest point its column is empty and its slope is
            # carried from the reference (the roofline known beyond the data).
            below = np.count_nonzero(uniq <= k)
            inside = below >= 2 and len(uniq) - below >= 3
            if math.isfinite(k) and (inside or k >= uniq[-1]) and k not in out:
                out.append(float(k))
        if not full:
            # The current knee alone, unless the window has left it behind: then search again.
            return out or self._knees(ph, x0, full=True)
        return [*out, math.inf]

    # -- predicting -----------------------------------------------------------------------------

    def prefill_form(self) -> PrefillForm:
        """The prefill form with the current fit's figures (for callers that evaluate it over
        many nodes: the TTFT predictor hands it to the Rust scorer)."""
        form = self._phases["prefill"].fit.form
        assert form is not None, "a prefill fit has a prefill form"
        return form

    def predict_prefill(self, batch: PrefillBatch) -> float:
        """Seconds for one prefill iteration over `batch` of (uncached, cached) requests."""
        uncached = pairs = cached = 0.0
        for u, c in batch:
            uncached += u
            pairs += u * c + u * (u + 1) * 0.5
            cached += c
        return self.prefill_form().totals(uncached, pairs, cached)

    def predict_prefill_totals(self, uncached: float, pairs: float, cached: float) -> float:
        """`predict_prefill` from a batch's summed features: its uncached tokens, query-key
        pairs (Σ u·c + u(u+1)/2) and cached tokens."""
        return self.prefill_form().totals(uncached, pairs, cached)

    def predict_prefill_one(self, uncached: float, cached: float) -> float:
        """`predict_prefill([(uncached, cached)])` without building a batch (the router's path)."""
        return self.prefill_form().seconds(uncached, cached)

    def predict_decode(self, batch_size: int, context_tokens: int) -> float:
        """Seconds for one decode step of `batch_size` requests over `context_tokens` of KV.

        Past the largest batch of the window the fit was made on: the fit's time at that batch
        (the same context per request) plus the prior's growth from there to `batch_size`.
        Why: the planner prices splits whose decode batches it has never run, and a window's
        fit extrapolates its own line, where a mixture of experts' step grows ever more slowly
        with the batch (the experts a batch touches saturate), which non-negative coefficients
        past a knee cannot follow. On the Mooncake trace on the paper's deployment the fit of
        the first minutes at 4P5D put a 228-request step at 292 ms against the truth's 54 (the
        prior: 63), pricing 8P1D at 17 requests/s where it served 29 (docs/scenarios.md, issue
        25). The growth is added, not multiplied: the prior is furthest off at small batches
        (0.7x the truth at 8 on Kimi K2), where the window's edge usually is, and a ratio from
        there would carry that error to every larger batch."""
        ph = self._phases["decode"]
        fit, prior = ph.fit, ph.prior
        if prior is None or fit.source != "fit" or batch_size <= ph.seen_max:
            return fit.one(batch_size, context_tokens)
        edge = ph.seen_max
        at_edge = context_tokens * edge / batch_size
        return (
            fit.one(edge, at_edge)
            + prior.one(batch_size, context_tokens)
            - prior.one(edge, at_edge)
        )

    def predict_prefill_many(self, uncached: npt.ArrayLike, cached: npt.ArrayLike) -> FloatArray:
        """Single-request prefill seconds per element (vectorized: a handful of numpy ops)."""
        return self.prefill_form().many(uncached, cached)

    # `samples.Timing`: a fitted model stands wherever a ground truth does.
    def prefill_time(self, batch: PrefillBatch) -> float:
        return self.predict_prefill(batch)

    def decode_time(self, batch_size: int, context_tokens: int) -> float:
        return self.predict_decode(batch_size, context_tokens)

    # -- reporting ------------------------------------------------------------------------------

    def ready(self, phase: Phase) -> bool:
        """True when `phase` runs on its own fit (not the prior, a fallback or a rescaled fit)."""
        return self._phases[phase].fit.source == "fit"

    def source(self, phase: Phase) -> str:
        """Where `phase`'s current coefficients come from: fit, last-fit, prior or fallback."""
        return self._phases[phase].fit.source

    @property
    def coefficients(self) -> dict[str, dict[str, float]]:
        """Current coefficients per phase (seconds per feature unit) and the knee (inf: none)."""
        fits = {phase: self._phases[phase].fit for phase in _NAMES}
        return {
            phase: {**dict(zip(_NAMES[phase], f.beta.tolist(), strict=True)), "knee": f.knee}
            for phase, f in fits.items()
        }

    def error(self) -> dict[str, dict[str, float]]:
        """Out-of-sample absolute percentage error (fractions) per phase, over the window.

        Each sample was predicted before it joined the fit. `count` is the errors in the window,
        `samples` the samples the fit uses; mean and p95 are NaN until a sample arrives.
        """
        out: dict[str, dict[str, float]] = {}
        cutoff = self._clock - self.max_age
        for phase, ph in self._phases.items():
            ape = ph.errors.since(cutoff)[:, 0]
            some = len(ape) > 0
            out[phase] = {
                "mean_ape": float(ape.mean()) if some else math.nan,
                "p95_ape": float(np.percentile(ape, 95)) if some else math.nan,
                "count": float(len(ape)),
                "samples": float(len(ph.samples.since(cutoff))),
            }
        return out

    def __repr__(self) -> str:
        c = self.coefficients
        parts = [
            f"{p}[{self.source(p)}](" + ", ".join(f"{n}={v:.3g}" for n, v in c[p].items()) + ")"
            for p in _NAMES
        ]
        return f"IterationModel({'; '.join(parts)})"
