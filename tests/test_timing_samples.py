"""Samples: the CSV format and SGLang's forward-pass metrics turned into samples."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgpack
import pytest

from evolving_infra.timing import (
    BadSampleError,
    Sample,
    SampleFileError,
    from_forward_pass_metrics,
    read_csv,
    write_csv,
)
from evolving_infra.timing.model import IterationModel


def fpm(wall: float = 0.05, **sched: Any) -> dict[str, Any]:
    """A message as SGLang 0.5.23 publishes it (map-encoded msgpack), decoded."""
    fields = {
        "num_prefill_requests": 0,
        "sum_prefill_tokens": 0,
        "var_prefill_length": 0.0,
        "sum_prefill_kv_tokens": 0,
        "num_decode_requests": 0,
        "sum_decode_kv_tokens": 0,
        "var_decode_kv_tokens": 0.0,
    } | sched
    queued = {k: 0 for k in fields if k != "sum_prefill_kv_tokens"}
    message = {
        "version": 1,
        "worker_id": 3,
        "dp_rank": 0,
        "counter_id": 17,
        "wall_time": wall,
        "scheduled_requests": fields,
        "queued_requests": queued,
    }
    decoded: dict[str, Any] = msgpack.unpackb(msgpack.packb(message))
    return decoded


def test_single_prefill_is_exact() -> None:
    s = from_forward_pass_metrics(
        fpm(0.2, num_prefill_requests=1, sum_prefill_tokens=900, sum_prefill_kv_tokens=5000)
    )
    assert s == Sample("prefill", 0.2, batch=((900, 5000),))


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_batch_keeps_count_sum_variance_and_cached_sum(n: int) -> None:
    lengths = [100 * (k + 1) ** 2 for k in range(n)]
    total = sum(lengths)
    mean = total / n
    var = sum((x - mean) ** 2 for x in lengths) / n
    s = from_forward_pass_metrics(
        fpm(
            0.3,
            num_prefill_requests=n,
            sum_prefill_tokens=total,
            var_prefill_length=var,
            sum_prefill_kv_tokens=12345,
        )
    )
    assert s is not None
    assert len(s.batch) == n
    us = [u for u, _ in s.batch]
    assert sum(us) == total
    assert sum(c for _, c in s.batch) == 12345
    got_var = sum((u - mean) ** 2 for u in us) / n
    assert math.isclose(got_var, var, rel_tol=1e-2)  # integer token counts round it


def test_decode_heartbeat_and_mixed() -> None:
    s = from_forward_pass_metrics(fpm(0.02, num_decode_requests=32, sum_decode_kv_tokens=64000))
    assert s == Sample("decode", 0.02, batch_size=32, context_tokens=64000)
    assert from_forward_pass_metrics(fpm(0.0)) is None
    mixed = fpm(0.05, num_prefill_requests=1, sum_prefill_tokens=10, num_decode_requests=4)
    assert from_forward_pass_metrics(mixed) is None


def test_bad_messages_are_typed_errors() -> None:
    with pytest.raises(BadSampleError):
        from_forward_pass_metrics({"version": 1})
    with pytest.raises(BadSampleError):
        from_forward_pass_metrics(fpm(-1.0, num_decode_requests=1, sum_decode_kv_tokens=5))
    with pytest.raises(BadSampleError):
        from_forward_pass_metrics(fpm(math.nan, num_decode_requests=1, sum_decode_kv_tokens=5))
    bad = fpm(0.1, num_decode_requests=1) | {"version": 2}
    with pytest.raises(BadSampleError):
        from_forward_pass_metrics(bad)


def test_forward_pass_samples_feed_the_model() -> None:
    m = IterationModel()
    for k in range(1, 40):
        s = from_forward_pass_metrics(
            fpm(
                0.01 + 1e-5 * 100 * k,
                num_prefill_requests=1,
                sum_prefill_tokens=100 * k,
                sum_prefill_kv_tokens=50 * k,
            )
        )
        assert s is not None
        m.observe(s)
    assert m.error()["prefill"]["samples"] > 0


def test_csv_round_trip_and_errors(tmp_path: Path) -> None:
    samples = [
        Sample("prefill", 0.25, batch=((100, 0), (7, 9000))),
        Sample("decode", 0.0125, batch_size=8, context_tokens=4096),
    ]
    path = tmp_path / "s.csv"
    write_csv(samples, path)
    assert read_csv(path) == samples
    cases = {
        "phase,seconds\n": ":1:",
        "phase,seconds,batch,batch_size,context_tokens\nwarmup,1,[],0,0\n": ":2: phase",
        "phase,seconds,batch,batch_size,context_tokens\nprefill,x,[[1,0]],0,0\n": ":2: seconds",
        "phase,seconds,batch,batch_size,context_tokens\nprefill,1,[[1]],0,0\n": ":2: batch",
        "phase,seconds,batch,batch_size,context_tokens\ndecode,1,[],0,0\n": ":2: batch_size",
    }
    for text, where in cases.items():
        path.write_text(text)
        with pytest.raises(SampleFileError, match=where):
            read_csv(path)
