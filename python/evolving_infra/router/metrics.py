"""The router's Prometheus series, all named `evolving_*`, rendered at `/metrics`.

Each `RouterMetrics` has its own registry rather than prometheus_client's global one: two apps in
one process (tests, or a router next to a simulated engine) then never share or double-register
series. Labels take values from fixed sets only (route templates, error codes, branch events,
engine node ids), so the number of series stays bounded whatever clients send.

Besides the request series, what an operator asks of a running router is read at scrape time
from its parts (never stale, nothing to keep in sync): each engine's state, phase, the load the
router sent it and the blocks the directory says it holds (`watch_engines`); the planner's split,
decisions and switches (`watch_planner`); the KV-event and sample ingestion counters
(`watch_ingest`); the decode-KV gate's waiting and shed requests (`watch_admission`); and the
process's own CPU, memory and file descriptors (`process_*`). Counters carry no `_created`
series (prometheus_client's default doubles every counter with one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from evolving_infra.router.ingest import EventCounters, SampleCounters
from evolving_infra.router.observer import DispatchObserver

# A process-wide switch in prometheus_client: the router's counters are rates to operators, and
# a `_created` series beside each doubled the page for nothing.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

# Seconds: TTFT of agent requests runs from tens of ms (a cached prefix) to tens of seconds (a
# long uncached prompt behind a queue); end-to-end adds the decode, up to minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Router overhead is milliseconds when the router keeps up, but a stalled event loop makes it
# seconds: buckets up to 30 s, so that a soak's P99 is a measured figure, not "over 1 s".
OVERHEAD_BUCKETS = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0,
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _BranchCollector(Collector):
    """`evolving_branches_live{kind}` read from the tracker at scrape time (never stale)."""

    def __init__(self, read: Callable[[], tuple[int, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        named, anonymous = self._read()
        g = GaugeMetricFamily(
            "evolving_branches_live",
            "Live agent branches: named by the harness, or anonymous (one per running request)",
            labels=["kind"],
        )
        g.add_metric(["named"], named)
        g.add_metric(["anonymous"], anonymous)
        yield g


class _TurnCacheCollector(Collector):
    """`evolving_turn_cache_*`: the branches' kept prompts (`router.turns`), at scrape time."""

    def __init__(self, read: Callable[[], tuple[int, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        branches, nbytes = self._read()
        yield GaugeMetricFamily(
            "evolving_turn_cache_branches",
            "Branches whose last prompt the router keeps, to tokenize and hash only what their"
            " next turn adds",
            value=branches,
        )
        yield GaugeMetricFamily(
            "evolving_turn_cache_bytes", "Bytes those kept prompts hold", value=nbytes
        )


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine as `/metrics` shows it: its state, phase, the blocks the directory says it
    holds per tier, and the work the router has sent it and not seen end."""

    node: int
    state: str  # up | draining | down
    phase: str  # prefill | decode
    l1_blocks: int
    l2_blocks: int
    decode_requests: int = 0  # requests decoding there (the router's count)
    queued_prefill_tokens: int = 0  # uncached prompt tokens sent for prefill, not yet done
    kv_used_blocks: int = 0  # KV blocks the router's requests hold there (prompt + max_tokens)
    kv_capacity_blocks: int = 0


@dataclass(frozen=True, slots=True)
class PlannerView:
    """The planner as `/metrics` shows it."""

    enabled: bool
    prefill: int  # up engines per phase: the split now
    decode: int
    decisions: int  # evaluations made, kept or switched
    switches_ok: int  # engine switches done
    switches_failed: int
    last_decision_unix: float | None  # None: no decision yet
    # With router replicas: whether this one holds the leader lease (decides), and its epoch.
    # None: a router without replicas, which always decides.
    leader: bool | None = None
    epoch: int = 0


ENGINE_STATES = ("up", "draining", "down")


class _EngineCollector(Collector):
    """`evolving_engine_state{node,state}` (1 for the current state) and
    `evolving_directory_blocks{node,tier}`, read at scrape time. One series per engine and
    value: bounded by the engines configured."""

    def __init__(self, read: Callable[[], list[EngineView]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        views = self._read()
        state = GaugeMetricFamily(
            "evolving_engine_state",
            "1 for the state each engine is in (up, draining, down), as the router sees it",
            labels=["node", "state", "phase"],
        )
        blocks = GaugeMetricFamily(
            "evolving_directory_blocks",
            "KV blocks the cluster directory says each engine holds, per tier (from its KV"
            " events; 0 once the engine is lost, until it answers again)",
            labels=["node", "tier"],
        )
        loads = {
            name: GaugeMetricFamily(f"evolving_engine_{name}", doc, labels=["node"])
            for name, doc in (
                ("decode_requests", "Requests decoding on each engine, by the router's count"),
                (
                    "queued_prefill_tokens",
                    "Uncached prompt tokens sent to each engine for prefill and not yet done",
                ),
                (
                    "kv_used_blocks",
                    "KV blocks the router's requests hold on each engine (prompt + max_tokens)",
                ),
                ("kv_capacity_blocks", "Each engine's GPU KV capacity in blocks"),
            )
        }
        for v in views:
            node = str(v.node)
            for s in ENGINE_STATES:
                state.add_metric([node, s, v.phase], 1.0 if v.state == s else 0.0)
            blocks.add_metric([node, "L1"], v.l1_blocks)
            blocks.add_metric([node, "L2"], v.l2_blocks)
            for name, family in loads.items():
                family.add_metric([node], getattr(v, name))
        yield state
        yield blocks
        yield from loads.values()


class _PlannerCollector(Collector):
    def __init__(self, read: Callable[[], PlannerView]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        v = self._read()
        yield GaugeMetricFamily(
            "evolving_planner_enabled", "1 when the planner may switch phases", value=v.enabled
        )
        split = GaugeMetricFamily(
            "evolving_planner_split", "Up engines per phase: the split now", labels=["phase"]
        )
        split.add_metric(["prefill"], v.prefill)
        split.add_metric(["decode"], v.decode)
        yield split
        yield CounterMetricFamily(
            "evolving_planner_decisions",
            "Planner evaluations made (the split kept or switched; the log has each)",
            value=v.decisions,
        )
        switches = CounterMetricFamily(
            "evolving_planner_switches", "Engine phase switches, by outcome", labels=["outcome"]
        )
        switches.add_metric(["ok"], v.switches_ok)
        switches.add_metric(["failed"], v.switches_failed)
        yield switches
        if v.leader is not None:
            yield GaugeMetricFamily(
                "evolving_planner_leader",
                "1 when this router replica holds the leader lease and runs the planner",
                value=v.leader,
            )
            yield GaugeMetricFamily(
                "evolving_planner_lease_epoch",
                "Epoch of the leader lease this replica holds or last held (0: never)",
                value=v.epoch,
            )
        if v.last_decision_unix is not None:
            yield GaugeMetricFamily(
                "evolving_planner_last_decision_timestamp_seconds",
                "Unix time of the planner's latest decision",
                value=v.last_decision_unix,
            )


class _IngestCollector(Collector):
    """Every ingestion counter, one labelled counter per stream: `evolving_kv_events_total
    {counter=...}` and `evolving_samples_total{counter=...}` (gaps, replays, corrupt batches...;
    the field names of `EventCounters` and `SampleCounters`)."""

    def __init__(self, read: Callable[[], tuple[EventCounters, SampleCounters]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        events, samples = self._read()
        for name, doc, counters in (
            ("evolving_kv_events", "KV-event ingestion, summed over the engines", events),
            ("evolving_samples", "Forward-pass sample ingestion, summed over engines", samples),
        ):
            family = CounterMetricFamily(name, doc, labels=["counter"])
            for f in fields(counters):
                family.add_metric([f.name], getattr(counters, f.name))
            yield family


class _AdmissionCollector(Collector):
    def __init__(self, read: Callable[[], tuple[int, int, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        waiting, early, late = self._read()
        yield GaugeMetricFamily(
            "evolving_admission_waiting",
            "Requests held by the router until a decode engine has room for their KV",
            value=waiting,
        )
        shed = CounterMetricFamily(
            "evolving_admission_shed",
            "Requests refused with 429 for want of decode room: at arrival (the predicted wait"
            " over the bound) or late (held as long as the bound)",
            labels=["when"],
        )
        shed.add_metric(["early"], early)
        shed.add_metric(["late"], late)
        yield shed


class _PullCollector(Collector):
    def __init__(self, read: Callable[[], Mapping[str, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        counts = self._read()
        pulls = CounterMetricFamily(
            "evolving_kv_pulls",
            "Cached prefixes a prefill engine was asked to pull from another node before its"
            " prefill (EngineControl TransferKV), by outcome (skipped: it would cost more than"
            " the prefill time it saves)",
            labels=["outcome"],
        )
        for outcome in ("ok", "failed", "skipped"):
            pulls.add_metric([outcome], counts.get(outcome, 0))
        yield pulls
        yield CounterMetricFamily(
            "evolving_kv_pulled_blocks",
            "KV blocks those pulls moved",
            value=counts.get("blocks", 0),
        )


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds_total, resident memory, open fds
        self.requests = Counter(
            "evolving_requests",
            "HTTP requests by route template and status (499: the client went away)",
            ["route", "status"],
            registry=r,
        )
        self.errors = Counter(
            "evolving_errors",
            "Error responses by OpenAI error type and router error code",
            ["type", "code"],
            registry=r,
        )
        self.ttft = Histogram(
            "evolving_ttft_seconds",
            "Arrival to the first generated piece, per completion route",
            ["route"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "evolving_e2e_seconds",
            "Arrival to the last generated piece, per completion route",
            ["route"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "evolving_router_overhead_seconds",
            "Arrival to the requests leaving for the engines: parsing, tokenizing, hashing, the"
            " branch update, the directory match and the routing decision (not the time held by"
            " the decode-KV gate)",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.admission_wait = Histogram(
            "evolving_admission_wait_seconds",
            "Time a request was held by the router until a decode engine had room for its KV",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.migrations = Counter(
            "evolving_request_migrations",
            "Requests whose decode stream broke mid-way (an engine crashed) and that went on on"
            " another decode engine from the tokens already streamed",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "evolving_prompt_tokens", "Prompt tokens of dispatched requests", registry=r
        )
        self.prompt_tokens_tokenized = Counter(
            "evolving_prompt_tokens_tokenized",
            "Prompt tokens the router's tokenizer produced (a branch's next turn tokenizes only"
            " the messages it adds; ids sent as ids are not tokenized)",
            registry=r,
        )
        self.prompt_tokens_reused = Counter(
            "evolving_prompt_tokens_reused",
            "Leading prompt tokens shared with the branch's last prompt, whose pages were not"
            " hashed again",
            registry=r,
        )
        self.cached_tokens = Counter(
            "evolving_cached_prompt_tokens",
            "Prompt tokens the engines served from KV cache (as they report it)",
            registry=r,
        )
        self.completion_tokens = Counter(
            "evolving_completion_tokens", "Generated tokens", registry=r
        )
        self.branch_events = Counter(
            "evolving_branch_events",
            "Branch events: fork, compaction, end (header, body or POST) and expired (TTL)",
            ["event"],
            registry=r,
        )
        self.disconnects = Counter(
            "evolving_client_disconnects",
            "Streams the client closed before the end (dispatch cancelled)",
            registry=r,
        )

    def watch_branches(self, read: Callable[[], tuple[int, int]]) -> None:
        """Report `read()` = (named, anonymous) live branches as `evolving_branches_live`."""
        self.registry.register(_BranchCollector(read))

    def watch_turn_cache(self, read: Callable[[], tuple[int, int]]) -> None:
        """Report `read()` = (branches, bytes) of the kept prompts as `evolving_turn_cache_*`."""
        self.registry.register(_TurnCacheCollector(read))

    def watch_engines(self, read: Callable[[], list[EngineView]]) -> None:
        """Report `read()`'s engines: `evolving_engine_state`, `evolving_directory_blocks` and
        the router's load per engine (`evolving_engine_*`)."""
        self.registry.register(_EngineCollector(read))

    def watch_planner(self, read: Callable[[], PlannerView]) -> None:
        """Report `read()` as `evolving_planner_*`."""
        self.registry.register(_PlannerCollector(read))

    def watch_ingest(self, read: Callable[[], tuple[EventCounters, SampleCounters]]) -> None:
        """Report `read()`'s counters as `evolving_kv_events_total` and `evolving_samples_total`."""
        self.registry.register(_IngestCollector(read))

    def feed(self) -> DispatchObserver:
        """What the dispatcher tells the metrics: its overhead and the gate's holds."""
        return _MetricsFeed(self)

    def watch_admission(self, read: Callable[[], tuple[int, int, int]]) -> None:
        """Report `read()` = (waiting, shed early, shed late) of the decode-KV gate
        (`router.admission`) as `evolving_admission_waiting` and `evolving_admission_shed`."""
        self.registry.register(_AdmissionCollector(read))

    def watch_pulls(self, read: Callable[[], Mapping[str, int]]) -> None:
        """Report `read()` = {"ok", "failed", "blocks"} of the prefix pulls (`router.kvpull`)
        as `evolving_kv_pulls_total{outcome}` and `evolving_kv_pulled_blocks_total`."""
        self.registry.register(_PullCollector(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _MetricsFeed(DispatchObserver):
    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def dispatched(self, overhead_s: float) -> None:
        self.metrics.overhead.observe(overhead_s)

    def admitted(self, held_s: float) -> None:
        self.metrics.admission_wait.observe(held_s)

    def migrated(self, tokens: int) -> None:
        self.metrics.migrations.inc()
