"""What one replay measured: per-request outcomes and the run's summary.

Definitions (the `--json` summary's keys):
- `issued`: requests sent to the router; `completed` of them answered in full (a stream that
  ended with `[DONE]` and carried the usage), `failed` answered with an error or broken (by
  reason in `errors`), `lost` neither: always 0 unless the replay's accounting has a bug.
  Of the failed, answered before admission: `shed`, refused at once for overload (`429`: no
  engine saw them, the client may retry after `Retry-After`); `rejected`, refused as the
  client's mistake (another 4xx, e.g. `400 context_length_exceeded`: a prompt no engine holds);
  `unreachable`, never taken (the router could not be reached, e.g. while it restarts, or
  answered `503 shutting_down` while it drained for a stop: it asks for the request again).
  The rest, `failed_late`, failed after the router admitted them: the figure overload handling
  and fault tolerance drive to zero (an engine killed under them is the one cause left).
- `unissued`: requests the closed loop made ready but the run stopped (duration) before sending.
- `requests_per_s`, `output_tokens_per_s`: completed requests and their output tokens over the
  wall time from the run's start to the end of its drain (`elapsed_s`).
- `hit_rate`, `ideal_hit_rate`, `lost_kv_reuse`: h, h* and 1 - h/h* as the simulator defines
  them (`sim/metrics.py`), so that the two can be set side by side (`evolving-infra parity`).
  h*: over the completed requests, on one infinite cache (`trace stats`'s rule: a request hits
  its leading trace blocks that each appeared in an earlier request). h: prompt blocks served
  from cache over prompt blocks, completed requests, where a request's cached blocks are its
  whole trace blocks among the cached tokens the router reports
  (`usage.prompt_tokens_details.cached_tokens`: what the serving engine found in its KV
  cache), capped at its hits on the ideal cache as issued (cached responses, which h* never
  counts, are left out). `hit_rate_all`: cached tokens / prompt tokens as reported, uncapped.
- `p50/p95/p99_ttft_s`: seconds from sending a request to its first content chunk (completed
  requests; linear interpolation between order statistics, as `trace stats`); `mean_e2e_s`:
  mean seconds from sending to the end of the stream. None (JSON null) when nothing completed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from evolving_infra.workloads.stats import percentile

# The failure reason of a request the router shed for overload (`replay.client`'s `http_429:...`).
SHED_PREFIX = "http_429:"
# ... of one it could not reach at all (`replay.client`).
CONNECTION_REFUSED = "connection_refused"
# ... of one a draining router did not take (`router.server.Drain`: 503 shutting_down).
SHUTTING_DOWN = "http_503:shutting_down"


def before_admission(reason: str) -> str | None:
    """`shed`, `rejected` or `unreachable` for a failure the router answered (or could not be
    asked) before admitting the request; None for a late failure."""
    if reason.startswith(SHED_PREFIX):
        return "shed"
    if reason.startswith("http_4"):
        return "rejected"
    if reason in (CONNECTION_REFUSED, SHUTTING_DOWN):
        return "unreachable"
    return None


@dataclass(frozen=True, slots=True)
class Outcome:
    """One issued request's result."""

    ok: bool
    reason: str | None = None  # why it failed (None when ok)
    ttft: float | None = None  # seconds to the first content chunk
    e2e: float | None = None  # seconds to the end of the stream
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    blocks: int = 0  # the prompt's whole trace blocks
    cached_blocks: int = 0  # of them, cached and counted by h* (see the module docstring)
    sent: float = 0.0  # seconds from the run's start to sending

    @classmethod
    def failure(cls, reason: str, e2e: float | None = None) -> Outcome:
        return cls(ok=False, reason=reason, e2e=e2e)


@dataclass(slots=True)
class Summary:
    agents: int
    duration_s: float
    elapsed_s: float
    issued: int
    completed: int
    failed: int
    lost: int
    shed: int  # of `failed`: refused for overload (429) before dispatch
    rejected: int  # of `failed`: refused as the client's mistake (another 4xx)
    unreachable: int  # of `failed`: the router could not be reached
    failed_late: int  # of `failed`: after admission
    unissued: int
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    hit_rate: float | None
    hit_rate_all: float | None
    ideal_hit_rate: float | None
    lost_kv_reuse: float | None
    p50_ttft_s: float | None
    p95_ttft_s: float | None
    p99_ttft_s: float | None
    mean_e2e_s: float | None
    errors: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def summarize(
    outcomes: Sequence[Outcome],
    *,
    agents: int,
    duration_s: float,
    elapsed_s: float,
    issued: int,
    unissued: int = 0,
    ideal_hit_rate: float | None = None,
) -> Summary:
    """The summary of a run's outcomes (see the module docstring for each figure)."""
    done = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    early = Counter(before_admission(o.reason or "") for o in failed)
    prompt = sum(o.prompt_tokens for o in done)
    cached = sum(o.cached_tokens for o in done)
    output = sum(o.output_tokens for o in done)
    blocks = sum(o.blocks for o in done)
    h = sum(o.cached_blocks for o in done) / blocks if blocks else None
    ttfts = sorted(o.ttft for o in done if o.ttft is not None)
    e2es = [o.e2e for o in done if o.e2e is not None]
    rate = 1 / elapsed_s if elapsed_s > 0 else 0.0
    return Summary(
        agents=agents,
        duration_s=duration_s,
        elapsed_s=elapsed_s,
        issued=issued,
        completed=len(done),
        failed=len(failed),
        lost=issued - len(done) - len(failed),
        shed=early["shed"],
        rejected=early["rejected"],
        unreachable=early["unreachable"],
        failed_late=early[None],
        unissued=unissued,
        requests_per_s=len(done) * rate,
        output_tokens_per_s=output * rate,
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=output,
        hit_rate=h,
        hit_rate_all=cached / prompt if prompt else None,
        ideal_hit_rate=ideal_hit_rate,
        lost_kv_reuse=1 - h / ideal_hit_rate if h is not None and ideal_hit_rate else None,
        p50_ttft_s=percentile(ttfts, 50),
        p95_ttft_s=percentile(ttfts, 95),
        p99_ttft_s=percentile(ttfts, 99),
        mean_e2e_s=sum(e2es) / len(e2es) if e2es else None,
        errors=dict(sorted(Counter(o.reason or "unknown" for o in failed).items())),
    )
