"""Iteration samples, the one interface every source of timing feeds the model through.

A prefill iteration runs a batch of requests, each `(uncached_tokens, cached_tokens)`: the
tokens it computes now and the prefix it reads from the KV cache. A decode iteration runs
`batch_size` requests, one token each, over `context_tokens` tokens of KV in total. Sources: the
hidden ground truth (`truth.py`, for the simulated engine and the simulator), the GPU profile
(`benches/gpu/iteration_profile.py`, CSV), and SGLang's forward-pass metrics.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

PrefillBatch = Sequence[tuple[int, int]]  # (uncached_tokens, cached_tokens) per request


class TimingError(ValueError):
    """Base of the timing package's errors."""


class BadSampleError(TimingError):
    """A sample that cannot be real (NaN, non-positive or absurd time, negative tokens)."""


class SampleFileError(TimingError):
    """A samples CSV that cannot be read; the message names the file, the line and the column."""


class Timing(Protocol):
    """What takes time in an engine iteration (a ground truth, or a fitted model)."""

    def prefill_time(self, batch: PrefillBatch) -> float: ...
    def decode_time(self, batch_size: int, context_tokens: int) -> float: ...


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured iteration. For decode, `batch` is empty and `batch_size`/`context` are set."""

    phase: Literal["prefill", "decode"]
    seconds: float
    batch: tuple[tuple[int, int], ...] = ()
    batch_size: int = 0
    context_tokens: int = 0

    @property
    def requests(self) -> int:
        return len(self.batch) if self.phase == "prefill" else self.batch_size


CSV_COLUMNS = ("phase", "seconds", "batch", "batch_size", "context_tokens")


def write_csv(samples: Iterable[Sample], path: Path) -> None:
    """One row a sample; `batch` is a JSON list of [uncached, cached] pairs."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for s in samples:
            batch = json.dumps([list(p) for p in s.batch], separators=(",", ":"))
            w.writerow([s.phase, repr(s.seconds), batch, s.batch_size, s.context_tokens])


def read_csv(path: Path) -> list[Sample]:
    """Samples from a CSV written by `write_csv` (or the GPU profile script)."""
    return list(_read(path))


def _read(path: Path) -> Iterator[Sample]:
    with path.open(newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None or tuple(header[: len(CSV_COLUMNS)]) != CSV_COLUMNS:
            raise SampleFileError(f"{path}:1: expected the columns {', '.join(CSV_COLUMNS)}")
        for line, row in enumerate(rows, start=2):
            if not row:
                continue
            yield _row(path, line, row)


def _row(path: Path, line: int, row: list[str]) -> Sample:
    def fail(column: str, reason: str) -> SampleFileError:
        return SampleFileError(f"{path}:{line}: {column}: {reason}")

    if len(row) < len(CSV_COLUMNS):
        raise fail("", f"expected {len(CSV_COLUMNS)} columns, got {len(row)}")
    phase, seconds_s, batch_s, size_s, context_s = row[: len(CSV_COLUMNS)]
    if phase not in ("prefill", "decode"):
        raise fail("phase", f"expected prefill or decode, got {phase!r}")
    try:
        seconds = float(seconds_s)
    except ValueError:
        raise fail("seconds", f"not a number: {seconds_s!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise fail("seconds", f"expected a time > 0, got {seconds_s}")
    try:
        raw = json.loads(batch_s) if batch_s else []
        batch = tuple((int(u), int(c)) for u, c in raw)
        batch_size, context = int(size_s or 0), int(context_s or 0)
    except (ValueError, TypeError) as e:
        raise fail("batch", f"cannot read: {e}") from None
    if any(u < 0 or c < 0 for u, c in batch) or batch_size < 0 or context < 0:
        raise fail("batch", "token counts must be >= 0")
    if phase == "prefill" and not batch:
        raise fail("batch", "a prefill sample needs its requests")
    if phase == "decode" and batch_size <= 0:
        raise fail("batch_size", "a decode sample needs a batch size > 0")
    if phase == "prefill":
        return Sample("prefill", seconds, batch=batch)
    return Sample("decode", seconds, batch_size=batch_size, context_tokens=context)


def from_forward_pass_metrics(message: Mapping[str, Any]) -> Sample | None:
    """A sample from one SGLang 0.5.23 forward-pass-metrics message (a decoded msgpack map).

    Fields used (`observability/forward_pass_metrics.py`): `wall_time` (GPU seconds of the
    forward, CUDA events) and `scheduled_requests` with `num_prefill_requests`,
    `sum_prefill_tokens` (tokens computed), `var_prefill_length` (their variance across
    requests), `sum_prefill_kv_tokens` (cached prefix tokens read), `num_decode_requests`,
    `sum_decode_kv_tokens`. Returns None for the idle heartbeat (all zeros) and for mixed
    prefill + decode forwards, which fit neither phase's form.

    The message carries sums, not requests, so a prefill batch is rebuilt as requests with the
    same count, sum and variance of new tokens, each over the mean cached prefix: exact for one
    request, and for a batch exact in Σt_uc, Σt_uc² and Σt_c (ΣA then assumes new and cached
    lengths uncorrelated within the batch).
    """
    try:
        version = message.get("version", 1)
        wall = float(message["wall_time"])
        sched = message["scheduled_requests"]
        n_prefill = int(sched["num_prefill_requests"])
        n_decode = int(sched["num_decode_requests"])
    except (KeyError, TypeError, ValueError) as e:
        raise BadSampleError(f"not a forward-pass-metrics message: {e!r}") from None
    if version != 1:
        raise BadSampleError(f"forward-pass-metrics version {version!r}, expected 1")
    if n_prefill == 0 and n_decode == 0:
        return None  # heartbeat
    if n_prefill and n_decode:
        return None  # mixed forward
    if not math.isfinite(wall) or wall <= 0:
        raise BadSampleError(f"wall_time must be > 0, got {wall}")
    try:
        if n_decode:
            context = int(sched["sum_decode_kv_tokens"])
            return Sample("decode", wall, batch_size=n_decode, context_tokens=context)
        total = int(sched["sum_prefill_tokens"])
        var = max(0.0, float(sched.get("var_prefill_length") or 0.0))
        cached = int(sched.get("sum_prefill_kv_tokens") or 0)
    except (KeyError, TypeError, ValueError) as e:
        raise BadSampleError(f"forward-pass-metrics field: {e!r}") from None
    if total < 0 or cached < 0:
        raise BadSampleError("forward-pass-metrics token sums must be >= 0")
    return Sample("prefill", wall, batch=_rebuild_batch(n_prefill, total, var, cached))


def _rebuild_batch(n: int, total: int, var: float, cached: int) -> tuple[tuple[int, int], ...]:
    """n (uncached, cached) requests with the given sum and variance of uncached tokens."""
    mean, sd = total / n, math.sqrt(var)
    # Deviations of ±1 (and one 0 when n is odd), scaled to unit variance: Σz = 0, Σz²/n = 1.
    z = [1.0 if k % 2 == 0 else -1.0 for k in range(n - n % 2)] + [0.0] * (n % 2)
    scale = math.sqrt(n / (n - n % 2)) if n > 1 else 0.0
    uncached = [max(0, round(mean + sd * scale * zk)) for zk in z]
    uncached[0] += total - sum(uncached)  # rounding: keep the sum exact
    share, extra = divmod(cached, n)
    return tuple((u, share + (1 if k < extra else 0)) for k, u in enumerate(uncached))
