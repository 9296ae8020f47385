"""`RealTimeEnv`: the simulator's `Node` driven by an asyncio loop instead of an event heap.

The discrete-event driver (`sim/cluster.py`) implements `nodemodel.node.Env` over a heap of
simulated times; this class implements the same protocol over the running loop, so the live
simulated engine runs the very same prefill/decode/KV mechanics (`nodemodel/`). Simulated time runs
`time_scale` times faster than the loop's clock: `now` is simulated seconds since the engine
started, `at(t, ...)` is `loop.call_at` at the matching loop time. Inside a callback `now` is the
time it was scheduled for (or the latest time already seen, if later), not the time the loop got
to it: a busy loop runs callbacks late, and if the node read the clock there, every iteration
would start late by the loop's lag and the engine would run slower than the hardware it models
(on a 2-core machine with four engines, a router and a load generator, decode ran ~20% slower
than the simulator's; `evolving-infra parity`). With the scheduled time the node's timeline
keeps the model's durations and a late loop catches up; time never runs backwards.

Iteration times come from the hidden ground truth (`RooflineTruth`, with its lognormal noise);
the engine's own `IterationModel` is fitted online from every iteration, as the simulator's is;
each iteration also becomes a `Sample` for the forward-pass publisher (`SampleSink`) and for
`StreamIterationSamples` subscribers. The node's other callbacks (a prefill finished, a token
batch was decoded, ...) are the engine's business: they go to `EngineHooks`, which the engine core
implements.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from evolving_infra.nodemodel.node import Node
from evolving_infra.nodemodel.request import SimRequest
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.samples import BadSampleError, Sample
from evolving_infra.timing.specs import Deployment
from evolving_infra.timing.truth import RooflineTruth

log = structlog.get_logger("evolving_infra.engines.sim")


class SampleSink(Protocol):
    """Where forward-pass samples go (the SGLang-format ZMQ publisher implements it:
    `engines.samples.ForwardPassMetricsPublisher.publish_sample`). Called on the loop thread;
    must not block."""

    def publish_sample(self, sample: Sample) -> None: ...


class EngineHooks(Protocol):
    """The node callbacks that belong to the engine (see `nodemodel.node.Env`)."""

    def prefilled(self, req: SimRequest) -> None: ...
    def decoded(self, req: SimRequest) -> None: ...
    def decode_reserved(self, req: SimRequest) -> None: ...
    def next_hashes(self, req: SimRequest) -> list[int] | None: ...
    def changed(self, node: Node) -> None: ...
    def span_done(self, tokens: int) -> None: ...


class RealTimeEnv:
    """Implements `nodemodel.node.Env` on an asyncio loop (see the module docstring)."""

    def __init__(
        self,
        deployment: Deployment,
        hooks: EngineHooks,
        *,
        time_scale: float = 1.0,
        noise: float = 0.02,
        seed: int = 0,
        sink: SampleSink | None = None,
        keep_samples: int = 1024,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.loop = loop or asyncio.get_running_loop()
        self.scale = float(time_scale)
        self._t0 = self.loop.time()
        self._scheduled: float | None = None  # inside a callback: the time it was due
        self._seen = 0.0  # the latest `now` handed out: it never goes back
        self.truth = RooflineTruth(deployment, noise=noise, seed=seed)
        self.model = IterationModel(deployment)
        self.hooks = hooks
        self.sink = sink
        # (seq, wall-clock time, sample): the recent iterations, for late subscribers and tests.
        self.recent: deque[tuple[int, float, Sample]] = deque(maxlen=keep_samples)
        self.seq = 0
        self._subscribers: list[Callable[[int, float, Sample], None]] = []
        self.fetch_seconds = 0.0  # simulated seconds of L2 -> L1 fetches, for reports

    # -- time ---------------------------------------------------------------------------------

    @property
    def now(self) -> float:
        """Simulated seconds since the engine started (see the module docstring)."""
        if self._scheduled is not None:
            return self._scheduled
        t = (self.loop.time() - self._t0) * self.scale
        if t > self._seen:
            self._seen = t
        return self._seen

    @now.setter
    def now(self, value: float) -> None:
        # `Env` declares `now` as an attribute (the event loop sets it); here the clock is real.
        raise AttributeError("a real-time environment's clock cannot be set")

    def real_seconds(self, simulated: float) -> float:
        return simulated / self.scale

    def at(self, t: float, fn: Callable[[Any], None], arg: Any) -> None:
        self.loop.call_at(self._t0 + t / self.scale, self._call, t, fn, arg)

    def _call(self, t: float, fn: Callable[[Any], None], arg: Any) -> None:
        # The loop is at or past `t`, so the scheduled time is never ahead of the real one.
        self._scheduled = self._seen = max(t, self._seen)
        # A node callback that raises would otherwise be reported by the loop and forgotten:
        # log it with the engine's logger (the request it served is failed by the engine).
        try:
            fn(arg)
        except Exception:
            log.exception("engine_callback_failed", callback=getattr(fn, "__qualname__", fn))
        finally:
            self._scheduled = None

    # -- samples ------------------------------------------------------------------------------

    def subscribe(self, fn: Callable[[int, float, Sample], None]) -> Callable[[], None]:
        """Calls `fn(seq, wall time, sample)` for every iteration from now on; returns the
        function that stops it."""
        self._subscribers.append(fn)

        def stop() -> None:
            if fn in self._subscribers:
                self._subscribers.remove(fn)

        return stop

    def _sample(self, sample: Sample) -> None:
        try:
            self.model.observe(sample, self.now)
        except BadSampleError as e:  # a zero-time iteration cannot be real: skip it
            log.warning("sample_rejected", error=str(e))
            return
        self.seq += 1
        wall = time.time()
        self.recent.append((self.seq, wall, sample))
        if self.sink is not None:
            self.sink.publish_sample(sample)
        for fn in list(self._subscribers):
            fn(self.seq, wall, sample)

    # -- `nodemodel.node.Env` ------------------------------------------------------------------

    def observe_prefill(self, pairs: list[tuple[int, int]], seconds: float) -> None:
        self._sample(Sample("prefill", seconds, batch=tuple(pairs)))

    def observe_decode(self, batch: int, context: int, seconds: float) -> None:
        self._sample(Sample("decode", seconds, batch_size=batch, context_tokens=context))

    def fetched(self, l2_blocks: int, remote_blocks: int, seconds: float) -> None:
        self.fetch_seconds += seconds

    def prefilled(self, req: SimRequest) -> None:
        self.hooks.prefilled(req)

    def span_done(self, tokens: int) -> None:
        self.hooks.span_done(tokens)

    def decoded(self, req: SimRequest) -> None:
        self.hooks.decoded(req)

    def decode_reserved(self, req: SimRequest) -> None:
        self.hooks.decode_reserved(req)

    def next_hashes(self, req: SimRequest) -> list[int] | None:
        return self.hooks.next_hashes(req)

    def changed(self, node: Node) -> None:
        self.hooks.changed(node)
