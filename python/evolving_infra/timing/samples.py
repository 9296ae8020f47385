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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

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
