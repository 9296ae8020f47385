"""Dispatch to prefill/decode engines (the live router's core): placement, the decode-KV gate,
retries and aborts.

For each request the routing policy (`evolving_infra.routing`, the same objects the simulator
drives) picks a prefill node and a decode node from the router's view of every engine (the
`EngineRegistry`'s engines and the `NodeLoad`s of its `LoadTracker`) and the directory's match
of the prompt, taken once (`RouteRequest.matched`). The request then goes to both at once
through the `PdTransport` (`transport.py`: SGLang's PD request protocol, notes
`sglang-0.5.23.md` §1.2); only the decode stream reaches the client, the prefill answer only
ends the prefill bookkeeping. The `DispatchObserver` hears of each request (the planner's
window, the metrics). Registry, transport and observer are given at construction.

Cached prefixes another node holds: when another node holds more of the prompt than the chosen
prefill engine, the engine is asked to pull it first (`kvpull.py`: the simulator's prefill nodes
reach the whole cluster's KV, a live engine only its own and the pool's).

Load is tracked on the router side, from what it dispatched (as Dynamo's and SGLang's routers
do), so choosing a node needs no round trip: a request adds its predicted prefill seconds to its
prefill node until the prefill engine answers, and its KV blocks to its decode node until the
stream ends.

Failures: an engine that cannot be reached, or whose stream breaks before its first token (a
crashed engine), is marked down and the request is tried once more on other nodes, as long as
no token has reached the client. A decode stream that breaks after it streamed migrates (as
Dynamo's frontend does with --migration-limit): the request goes on as a new one whose prompt
is the old prompt and the tokens streamed so far, with the output budget left, placed like any
other (its prefix is cached on the prefill side), and the client's stream goes on unbroken;
its usage counts every token. Beyond `migration_limit` such breaks, or on an engine error
answer, the request fails with `EngineFailedError` (an SSE error event when streaming).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from evolving_infra._core import KvDirectory, block_hashes
from evolving_infra.router.admission import DecodeGate
from evolving_infra.router.dispatcher import (
    BrokenStreamError,
    DispatcherHealth,
    EngineFailedError,
    Finished,
    GenerationEvent,
    NoEngineError,
    PreparedRequest,
    RequestLimits,
    TextPiece,
)
from evolving_infra.router.kvpull import KvPuller, Pull, best_source
from evolving_infra.router.loads import EngineHandle
from evolving_infra.router.observer import DispatchObserver
from evolving_infra.router.registry import EngineRegistry
from evolving_infra.router.transport import Body, PdTransport, UnreachableError, pd_bodies
from evolving_infra.routing.base import Router, RouteRequest
from evolving_infra.routing.common import NoNodeError
from evolving_infra.timing.model import IterationModel
from evolving_infra.types import blocks_for

log = structlog.get_logger("evolving_infra.router.pd")

# SGLang's gateway draws the room as `u64 & i64::MAX` (notes §1.2): a non-negative i64.
ROOM_MAX = (1 << 63) - 1
# How long a decode-side failure waits for the prefill side's answer, which says whether the
# prefill engine was the cause (then the request is retried elsewhere).
PREFILL_VERDICT_S = 2.0


@dataclass(frozen=True, slots=True)
class _Placement:
    prefill: EngineHandle
    decode: EngineHandle
    prefill_s: float
    uncached: int
    decode_blocks: int
    max_out: int  # the output budget sent to the engines (`RouteRequest.expected_output_tokens`)
    pull: Pull | None = None  # a longer cached prefix another node holds, pulled first
    ttft_s: float | None = None  # the TTFT the policy predicted on the prefill engine


class PdDispatcher:
    """`Dispatcher` over prefill and decode engines (see the module docstring)."""

    def __init__(
        self,
        registry: EngineRegistry,
        directory: KvDirectory,
        router: Router,
        model: IterationModel,
        *,
        page_size: int,
        transport: PdTransport,
        observer: DispatchObserver | None = None,
        default_max_tokens: int = 256,
        context_length: int | None = None,
        max_queue_wait_s: float = 60.0,
        seed: int | None = None,
        admission: bool = True,
        puller: KvPuller | None = None,
        migration_limit: int = 1,
    ) -> None:
        """`registry`: the engines and their loads; `transport`: how requests reach them
        (`transport.HttpTransport` for SGLang's HTTP API); `observer`: who hears of each
        request (the planner's window, the metrics; `observer.Observers` for several);
        `context_length`: the model's (None: only the engines' KV bounds a request);
        `max_queue_wait_s`: the longest a request may wait for decode room, predicted or held,
        before it is refused with a 429 (`admission.DecodeGate`); `puller`: moves a cached
        prefix another node holds to the chosen prefill engine (`kvpull.py`; None: never);
        `migration_limit`: broken decode streams a request goes on after (the module
        docstring)."""
        self.registry = registry
        self.directory = directory
        self.router = router
        self.model = model
        self.page_size = page_size
        self.transport = transport
        self.observer = observer if observer is not None else DispatchObserver()
        self.default_max_tokens = default_max_tokens
        self.context_length = context_length
        self.puller = puller
        self.migration_limit = migration_limit
        self._rng = random.Random(seed)
        # Requests in flight per engine (their tasks), so that an engine found dead can have
        # its requests pulled back at once instead of at their timeouts.
        self._inflight: dict[int, set[asyncio.Task[Any]]] = {}
        self._aborted: dict[asyncio.Task[Any], tuple[int, str]] = {}
        # Requests wait here until a decode engine has room for their KV (`router.admission`);
        # it re-checks them whenever the registry changes.
        self.gate = (
            DecodeGate(registry.decode_space, max_wait_s=max_queue_wait_s) if admission else None
        )
        if self.gate is not None:
            registry.listen(self.gate.notify)

    def abort_engine(self, node: int, reason: str) -> int:
        """Pulls back every request in flight on `node` (an engine that stopped answering):
        those that sent the client nothing are retried elsewhere, the others end with an error.
        Returns how many were in flight."""
        tasks = self._inflight.get(node, set())
        for task in tasks:
            if task not in self._aborted and not task.done():
                self._aborted[task] = (node, reason)
                task.cancel()
        if tasks:
            log.warning("engine_requests_aborted", node=node, requests=len(tasks), reason=reason)
        return len(tasks)

    def health(self) -> DispatcherHealth:
        return self.registry.health()

    def limits(self) -> RequestLimits:
        """The model's context length, bounded by the KV of the largest engine known (in any
        state or phase: a request that fits one may wait for it; every engine can become a
        decode engine)."""
        caps = [e.kv_capacity_blocks * self.page_size for e in self.registry.engines.values()]
        bounds = [b for b in (self.context_length, max(caps, default=None)) if b is not None]
        return RequestLimits(min(bounds, default=None), self.default_max_tokens)

    def _max_out(self, req: PreparedRequest) -> int:
        """The request's output budget: its max_tokens, else the default, cut to the room its
        prompt leaves (the front end refused requests that do not fit: `limits`). Computed once
        per request, into its route (`_route`); the gate, the placement and the engines' bodies
        read it there."""
        if req.sampling.max_tokens:
            return req.sampling.max_tokens
        room = self.limits().context_tokens
        if room is None:
            return self.default_max_tokens
        return max(min(self.default_max_tokens, room - len(req.token_ids)), 1)

    def _route(self, req: PreparedRequest) -> RouteRequest:
        max_out = self._max_out(req)
        return RouteRequest(
            hashes=req.block_hashes,  # the tuple as is: the directory reads any sequence
            prompt_tokens=len(req.token_ids),
            expected_output_tokens=max_out,
            branch=str(req.branch),
        )

    def _choose_decode(self, route: RouteRequest, extra: Mapping[int, int]) -> int:
        """The decode engine the policy picks for `route` with the gate's commitments counted
        (the gate queues the request there); -1 if none is up."""
        try:
            loads = self.registry.loads.view(self.registry.up("decode"), extra)
            return self.router.choose_decode(route, loads)
        except NoNodeError:
            return -1

    # -- dispatch -----------------------------------------------------------------------------

    def _place(
        self,
        req: PreparedRequest,
        excluded: set[int],
        decode: int | None = None,
        route: RouteRequest | None = None,
    ) -> _Placement:
        """The request's engines: prefill by the policy on current loads; decode `decode` (the
        engine whose room the gate gave it) while it is an up decode engine, else the policy's."""
        reg = self.registry
        engines = [e for e in reg.engines.values() if e.node not in excluded]
        nodes = reg.loads.view(engines, self.gate.extra() if self.gate is not None else None)
        if route is None:
            route = self._route(req)
        # Matched now, once, for the policy and the prefill's size below: a request the gate
        # held has waited while the directory changed, and the ingestion threads may change it
        # again in between.
        route = dataclasses.replace(route, match=self.directory.match(route.hashes))
        try:
            placed = self.router.choose_prefill(route, nodes)
            given = reg.engines.get(decode) if decode is not None else None
            if given is not None and given.phase == "decode" and given.state == "up":
                d = given.node
            else:
                d = self.router.choose_decode(route, nodes)
        except NoNodeError as e:
            raise NoEngineError(f"{e}; engines: {reg.states()}") from None
        t = route.prompt_tokens
        cached = placed.cached_blocks
        pull = None
        if self.puller is not None:
            pull = best_source(route.prefix(), placed.node, cached)
            queue_s = next((n.queued_prefill_s for n in nodes if n.node == placed.node), 0.0)
            if pull is not None and not self._pays(pull, cached, t, queue_s):
                self.puller.skipped()
                pull = None
            cached = cached if pull is None else pull.blocks
        uncached = max(t - min(cached * self.page_size, t), 1)
        seconds = self.model.predict_prefill_one(uncached, t - uncached)
        return _Placement(
            reg.engines[placed.node],
            reg.engines[d],
            seconds,
            uncached,
            self._decode_blocks(route),
            route.expected_output_tokens,
            pull,
            placed.ttft_s,
        )

    def _pays(self, pull: Pull, cached: int, prompt_tokens: int, queue_s: float = 0.0) -> bool:
        """Whether pulling `pull` saves more prefill time than it costs, less the `queue_s`
        the prefill waits in its engine's queue meanwhile (`kvpull.py`)."""
        assert self.puller is not None
        cost = self.puller.cost_s(pull.blocks - cached)
        if cost is None:
            return True  # not learned yet: pulls are how it learns

        def prefill_s(blocks: int) -> float:
            u = max(prompt_tokens - min(blocks * self.page_size, prompt_tokens), 1)
            return self.model.predict_prefill_one(u, prompt_tokens - u)

        return prefill_s(cached) - prefill_s(pull.blocks) > cost - max(queue_s, 0.0)

    def _decode_blocks(self, route: RouteRequest) -> int:
        """KV blocks the router counts for the request on its decode node: prompt and output
        budget (the gate asks for the same room the placement then takes)."""
        return blocks_for(route.prompt_tokens + route.expected_output_tokens, self.page_size)

    async def generate(self, request: PreparedRequest) -> AsyncIterator[GenerationEvent]:
        original = request
        streamed = 0  # output tokens the client has from attempts whose stream broke
        for migration in range(self.migration_limit + 1):
            try:
                async for event in self._generate(request):
                    if isinstance(event, Finished) and streamed:
                        # The client's usage: every token; cached, at most its own prompt (the
                        # continuation's prompt is the client's and the tokens streamed).
                        c = event.cached_tokens
                        event = Finished(
                            event.finish_reason,
                            event.completion_tokens + streamed,
                            None if c is None else min(c, len(original.token_ids)),
                        )
                    yield event
                return
            except BrokenStreamError as e:
                if migration == self.migration_limit or not e.output_ids:
                    raise
                budget = self._max_out(request) - len(e.output_ids)
                streamed += len(e.output_ids)
                if budget < 1:  # every token was streamed: only the end was lost
                    yield Finished("length", streamed, None)
                    return
                request = self._continuation(request, e.output_ids, budget)
                self.observer.migrated(streamed)
                log.warning(
                    "request_migrated", request=original.request_id, down=e.node, tokens=streamed
                )

    def _continuation(
        self, req: PreparedRequest, output: tuple[int, ...], budget: int
    ) -> PreparedRequest:
        """`req` gone on after `output`: its prompt and `output` as the prompt, `budget` tokens
        left to generate."""
        ids = (*req.token_ids, *output)
        return dataclasses.replace(
            req,
            token_ids=ids,
            block_hashes=tuple(block_hashes(ids, self.page_size)),  # the tuple read in place
            sampling=dataclasses.replace(req.sampling, max_tokens=budget),
            arrival=time.monotonic(),  # the router's own time is counted from here
            # A new request to the engines: the broken attempt may still be winding down on
            # the prefill engine under the old id.
            request_id=f"{req.request_id}-m{len(output)}",
            think_s=None,  # the same turn, counted once in the planner's window
        )

    async def _generate(self, request: PreparedRequest) -> AsyncIterator[GenerationEvent]:
        held_s = 0.0
        decode: int | None = None
        # Built once: the gate's decode choice and the placement read the same request.
        route = self._route(request)
        if self.gate is not None:
            # The room is taken by `_run` (`add_decode`) with no `await` in between.
            start = time.monotonic()
            decode = await self.gate.wait(
                self._decode_blocks(route), lambda extra: self._choose_decode(route, extra)
            )
            held_s = time.monotonic() - start
            self.observer.admitted(held_s)
        excluded: set[int] = set()
        for attempt in range(2):
            place = self._place(request, excluded, decode if attempt == 0 else None, route)
            streamed = False
            try:
                async for event in self._run(request, place, attempt, held_s):
                    streamed = True
                    yield event
                return
            except asyncio.CancelledError:
                aborted = self._take_abort()
                if aborted is None:
                    raise  # the client went away, or the router stops
                node, why = aborted[0], f"stopped answering: {aborted[1]}"
            except UnreachableError as e:
                node, why = e.engine.node, f"unreachable: {e.reason}"
                if e.gone:
                    self.registry.set_state(node, "down", e.reason)
            # Only failures reach here (a finished request returned above).
            if streamed or attempt == 1:
                raise EngineFailedError(f"engine {node} {why}", node=node, unavailable=True)
            excluded.add(node)
            log.warning("retry", request=request.request_id, down=node)

    async def _prefill(
        self, p: EngineHandle, place: _Placement, hashes: Sequence[int], body: Body
    ) -> None:
        """The prefill leg: the cached prefix pulled first, if another node holds more of it
        (the engine answers once the move has begun, and its prefill waits until the blocks
        are in: the move overlaps the wait in its queue); meanwhile the decode engine admits
        the request and waits for the room, as it would for a prefill queued behind others."""
        if place.pull is not None and self.puller is not None:
            await self.puller.pull(p.node, place.pull, hashes)
        await self.transport.prefill(p, body)

    def _take_abort(self) -> tuple[int, str] | None:
        """The abort (node, reason) behind the current task's cancellation, consumed, or None
        when the cancellation came from elsewhere."""
        task = asyncio.current_task()
        aborted = self._aborted.pop(task, None) if task is not None else None
        if aborted is not None and task is not None:
            task.uncancel()
        return aborted

    async def _run(
        self, req: PreparedRequest, place: _Placement, attempt: int, held_s: float = 0.0
    ) -> AsyncIterator[GenerationEvent]:
        room = self._rng.randint(0, ROOM_MAX)
        prefill_body, decode_body = pd_bodies(req, place.prefill, room, attempt, place.max_out)
        p, d = place.prefill, place.decode
        me = asyncio.current_task()
        assert me is not None
        for node in {p.node, d.node}:
            self._inflight.setdefault(node, set()).add(me)
        t = len(req.token_ids)
        prompt = blocks_for(t, self.page_size)
        loads = self.registry.loads
        loads.add_prefill(p.node, place.prefill_s, place.uncached, prompt)
        loads.add_decode(d.node, place.decode_blocks, t, prompt)
        seen = self.observer
        # The planner's bookkeeping (its window, the reuse tracker: ~0.1 ms at 100k tokens)
        # runs once the engines have the request, off its path; its time is taken now.
        asyncio.get_running_loop().call_soon(
            seen.arrival,
            t,
            place.uncached,
            t - place.uncached,
            req.block_hashes,
            time.monotonic(),
            req.think_s if attempt == 0 else None,
        )
        prefill_open = True

        def prefill_done(_: object = None) -> None:
            nonlocal prefill_open
            if prefill_open:
                prefill_open = False
                loads.done_prefill(p.node, place.prefill_s, place.uncached, prompt)

        if attempt == 0:
            # The router's own cost: the time held by the gate is queueing, not overhead.
            seen.dispatched(time.monotonic() - req.arrival - held_s)
        # On the request's access-log line (the front end logs it when the answer ends): where
        # it went and what was predicted, against the TTFT it got (bound on the first token).
        structlog.contextvars.bind_contextvars(
            prefill=p.node,
            decode=d.node,
            prompt_tokens=t,
            uncached=place.uncached,
            pulled=place.pull is not None,
            held_s=round(held_s, 4),
            predicted_ttft_s=None if place.ttft_s is None else round(place.ttft_s, 4),
        )
        prefill = asyncio.create_task(self._prefill(p, place, req.block_hashes, prefill_body))
        prefill.add_done_callback(prefill_done)
        stream = self.transport.decode(d, decode_body)
        del prefill_body, decode_body  # megabytes: only their requests hold them, until sent
        first: asyncio.Future[GenerationEvent] = asyncio.ensure_future(anext(stream))
        try:
            # Until the decode side streams, a failed prefill must end the request: the decode
            # engine would otherwise wait for KV that never comes (SGLang's decode side learns
            # it from the bootstrap server; here the router knows first).
            legs: set[asyncio.Future[Any]] = {prefill, first}
            await asyncio.wait(legs, return_when=asyncio.FIRST_COMPLETED)
            failed = None if first.done() or prefill.cancelled() else prefill.exception()
            if failed is not None:
                raise failed
            try:
                event: GenerationEvent | None = await first
            except EngineFailedError:
                # The decode side gave up before streaming: when its prefill side failed, that
                # is the cause (e.g. a prefill engine that began draining), and it is retryable.
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(prefill), PREFILL_VERDICT_S)
                failed = None if not prefill.done() or prefill.cancelled() else prefill.exception()
                if failed is not None:
                    raise failed from None
                raise
            ttft = time.monotonic() - req.arrival
            structlog.contextvars.bind_contextvars(ttft_s=round(ttft, 4))
            while event is not None:
                if isinstance(event, TextPiece):
                    seen.tokens(event.tokens)
                elif isinstance(event, Finished) and event.cached_tokens is not None:
                    # What the prefill really found cached (the decode side reports it).
                    seen.prefilled(t, t - min(event.cached_tokens, t))
                    structlog.contextvars.bind_contextvars(cached_tokens=event.cached_tokens)
                yield event
                event = await anext(stream, None)
            # The planner's closed loop: how long the agent waited for its answer.
            seen.answered(ttft, time.monotonic() - req.arrival)
            # The decode side had the KV once it streamed: the prefill answer only confirms it,
            # and the client has its whole answer, so a late prefill error is only logged.
            try:
                await prefill
            except (UnreachableError, EngineFailedError) as e:
                log.warning("prefill_answer_failed", request=req.request_id, reason=str(e))
        finally:
            for task in (first, prefill):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            await stream.aclose()
            prefill_done()
            loads.done_decode(d.node, place.decode_blocks, t, prompt)
            if self.gate is not None:
                self.gate.freed(d.node, place.decode_blocks)
            self.registry.changed()  # decode room freed: the gate re-checks
            for node in {p.node, d.node}:
                self._inflight[node].discard(me)
