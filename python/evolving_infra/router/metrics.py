"""The router's Prometheus series, all named `evolving_*`, rendered at `/metrics`.

Each `RouterMetrics` has its own registry rather than prometheus_client's global one: two apps in
one process (tests, or a router next to a simulated engine) then never share or double-register
series. Labels take values from fixed sets only (route templates, error codes, branch events), so
the number of series stays bounded whatever clients send.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from evolving_infra.router.observer import DispatchObserver

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


class _ValueCollector(Collector):
    """One unlabelled gauge read at scrape time."""

    def __init__(self, name: str, doc: str, read: Callable[[], float]) -> None:
        self._name, self._doc, self._read = name, doc, read

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self._name, self._doc, value=self._read())


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine as `/metrics` shows it: its state, phase and the blocks the directory says it
    holds per tier."""

    node: int
    state: str  # up | draining | down
    phase: str  # prefill | decode
    l1_blocks: int
    l2_blocks: int


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
        for v in views:
            node = str(v.node)
            for s in ENGINE_STATES:
                state.add_metric([node, s, v.phase], 1.0 if v.state == s else 0.0)
            blocks.add_metric([node, "L1"], v.l1_blocks)
            blocks.add_metric([node, "L2"], v.l2_blocks)
        yield state
        yield blocks


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
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
        self.prompt_tokens = Counter(
            "evolving_prompt_tokens", "Prompt tokens of dispatched requests", registry=r
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

    def watch_engines(self, read: Callable[[], list[EngineView]]) -> None:
        """Report `read()`'s engines as `evolving_engine_state` and `evolving_directory_blocks`."""
        self.registry.register(_EngineCollector(read))

    def feed(self) -> DispatchObserver:
        """What the dispatcher tells the metrics: its overhead and the gate's holds."""
        return _MetricsFeed(self)

    def watch_admission(self, read: Callable[[], int]) -> None:
        """Report `read()` as `evolving_admission_waiting`: requests the router holds until a
        decode engine has room for their KV (`router.admission`)."""
        self.registry.register(
            _ValueCollector(
                "evolving_admission_waiting",
                "Requests held by the router until a decode engine has room for their KV",
                read,
            )
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _MetricsFeed(DispatchObserver):
    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def dispatched(self, overhead_s: float) -> None:
        self.metrics.overhead.observe(overhead_s)

    def admitted(self, held_s: float) -> None:
        self.metrics.admission_wait.observe(held_s)
