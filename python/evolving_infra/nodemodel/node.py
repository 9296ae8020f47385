"""One node's mechanics: a prefill queue with chunked iterations, or a decode batch in spans.

Prefill (docs/simulator.md, "Prefill iterations"): requests are admitted FIFO into an iteration
up to the chunk budget; a longer request is split into chunks over several iterations, each
chunk's cached part being the prefix plus the chunks before it. Admission takes the request's KV
(`NodeKv.reserve`): its cached prefix is pinned, blocks it finds in this node's L2 or elsewhere
are fetched into L1 (the iteration waits for the fetch; with `prefetch` the fetch starts when
the request is queued, so it overlaps the wait), and the uncached rest is reserved. At the end
the prompt's blocks are stored in L1, pinned until the KV has moved to the decode node.

Decode (docs/simulator.md, "Decode spans"): the batch advances by spans of k iterations, k the
fewest tokens any request still needs (capped); the span's time is k times the truth's
iteration time at the span's mean context (context grows by B tokens per iteration). A request
arriving mid-span cuts the span at the next iteration boundary and joins after it (continuous
batching admits at iteration boundaries). A decode node admits a request only when its whole
KV (prompt and output) fits; otherwise the request waits, FIFO, with its KV still on the
prefill node.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from evolving_infra._core import KvDirectory, PrefixMatch
from evolving_infra.nodemodel.kv import PIN_TIME, NodeKv
from evolving_infra.nodemodel.request import SimRequest
from evolving_infra.routing.base import NodeLoad
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.truth import RooflineTruth
from evolving_infra.types import Phase, blocks_for

State = Literal["active", "draining", "down"]


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """What every node of a run shares (from `SimConfig` and the policy)."""

    block_size: int
    block_bytes: int
    chunk_tokens: int
    span_cap: int
    l2_bandwidth: float
    pool_bandwidth: float
    net_bandwidth: float  # reads of another node's L1
    shared_pool: bool  # prefill may read blocks any node holds (else only its own L1/L2)
    prefetch: bool  # fetch while queued
    # Tokens a decoding request gains per iteration, on average (`Deployment.mtp_accepted`:
    # 1 without multi-token prediction). Credited as an expected value: a request's tokens
    # after j iterations are floor(j x accepted), its fraction carried (`SimRequest.credit`).
    accepted: float = 1.0


class Env(Protocol):
    """What a node asks of the cluster that runs it."""

    truth: RooflineTruth
    model: IterationModel
    now: float

    def at(self, t: float, fn: Callable[[Any], None], arg: Any) -> None: ...
    def observe_prefill(self, pairs: list[tuple[int, int]], seconds: float) -> None: ...
    def observe_decode(self, batch: int, context: int, seconds: float) -> None: ...
    def fetched(self, l2_blocks: int, remote_blocks: int, seconds: float) -> None: ...
    def prefilled(self, req: SimRequest) -> None: ...
    def span_done(self, tokens: int) -> None: ...
    def decoded(self, req: SimRequest) -> None: ...
    def decode_reserved(self, req: SimRequest) -> None: ...
    def next_hashes(self, req: SimRequest) -> list[int] | None: ...
    def changed(self, node: Node) -> None: ...


class Node:
    """A prefill or decode node (the phase may change at a switch)."""

    def __init__(
        self,
        node: int,
        phase: Phase,
        kv: NodeKv,
        directory: KvDirectory,
        settings: NodeSettings,
        env: Env,
    ) -> None:
        self.id = node
        self.phase: Phase = phase
        self.state: State = "active"
        self.kv = kv
        self.directory = directory
        self.s = settings
        self.env = env
        # prefill
        self.queue: deque[SimRequest] = deque()
        self.held: dict[int, SimRequest] = {}  # bootstrap queue: decode KV not reserved yet
        self.running: list[SimRequest] = []  # admitted, tokens left to compute
        self.busy = False
        self._iter: list[tuple[SimRequest, int]] = []
        self._iter_pairs: list[tuple[int, int]] = []
        self._iter_compute = 0.0
        self.queued_s = 0.0  # predicted seconds of prefill work held, queued or running
        self.queued_tokens = 0  # uncached tokens held, queued or running
        # Of those, the bootstrap queue's: work that waits for decode KV, not for this node.
        self.held_s = 0.0
        self.held_tokens = 0
        # Prompt blocks of the requests routed here and not gone (prefill: until prefilled or
        # handed back; decode: offered, until finished or handed back): Dynamo's router-tracked
        # load (`NodeLoad.active_blocks`).
        self.active_blocks = 0
        # decode
        self.batch: list[SimRequest] = []
        # NOTE: kept as the batch changes rather than summed per span and per planner sample
        # (a sum over every decode node's batch each simulated second was 3% of a 3,072-GPU run).
        self.batch_context = 0  # the batch's KV tokens: sum of its requests' `context`
        self.joining: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()  # not admitted yet (KV does not fit)
        self.waiting_blocks = 0  # the waiting requests' KV (prompt and output) in blocks
        self.inbound = 0  # admitted, KV in transfer
        self.in_span = False
        self._span = (0.0, 0, 0.0, 0.0)  # start, iterations, seconds per iteration, context
        self._token = 0
        # switch bookkeeping (the cluster's)
        self.target: Phase | None = None
        self.drain_start = 0.0

    @property
    def accepting(self) -> bool:
        return self.state == "active"

    def load(self) -> NodeLoad:
        kv = self.kv
        return NodeLoad(
            node=self.id,
            phase=self.phase,
            accepting=self.state == "active",
            queued_prefill_s=self.queued_s if self.queued_s > 0 else 0.0,
            queued_prefill_tokens=self.queued_tokens,
            decode_requests=len(self.batch) + len(self.joining) + self.inbound + len(self.waiting),
            # What a router counts once it has sent requests here (the live router counts a
            # request's KV from dispatch, `router.loads.LoadTracker`): the waiting requests' KV is
            # taken too. Without it a node whose head waits for most of its KV (SGLang's
            # prealloc queue is FIFO) stays the most free and every request queues behind it.
            kv_used_blocks=min(kv.reserved + kv.pinned + self.waiting_blocks, kv.l1_capacity),
            kv_capacity_blocks=kv.l1_capacity,
            active_blocks=self.active_blocks,
        )

    def prefill_demand_s(self) -> float:
        """Predicted seconds of prefill work this node has to do: queued and running, not the
        bootstrap queue's. SGLang keeps requests that wait for decode KV apart from its waiting
        queue (`PrefillBootstrapQueue`), and a planner must not read a decode shortage as
        prefill demand. (`queued_s`, which routing reads, counts them: they will run here.)"""
        return max(self.queued_s - self.held_s, 0.0)

    def waiting_prefill_tokens(self) -> int:
        """Uncached prompt tokens in the prefill queue, not yet started (SGLang's waiting queue:
        what Dynamo's planner reads as `queued_requests.sum_prefill_tokens`)."""
        started = sum(r.remaining for r in self.running)
        return max(self.queued_tokens - self.held_tokens - started, 0)

    def kv_use(self) -> float:
        """KV in use by running requests over L1, 0..1 (an engine's token usage; the cache that
        fills the rest is evictable). It is also Dynamo's decode signal, scheduled + queued KV
        over the cache, "queued" being requests preempted back to the waiting queue (its
        `ForwardPassMetrics`, docs/baselines.md §2a): a simulated decode node never preempts
        (it admits a request only once its KV fits), and requests waiting for their KV to be
        allocated (`waiting`, SGLang's prealloc queue) are in no scheduler queue."""
        kv = self.kv
        return min(kv.reserved + kv.pinned, kv.l1_capacity) / kv.l1_capacity

    def drained(self) -> bool:
        """Nothing runs, waits or holds KV here: the node may switch."""
        if self.phase == "prefill":
            return not (self.busy or self.queue or self.held or self.running or self.kv.pinned)
        return not (self.in_span or self.batch or self.joining or self.inbound or self.waiting)

    # -- prefill ------------------------------------------------------------------------------

    def reach(
        self, hashes: Sequence[int], match: PrefixMatch | None = None
    ) -> tuple[int, int, int, int]:
        """(l1, l12, pool, c): the prompt's leading blocks in this node's L1, its L1 or L2, any
        L2 (capped to what is reachable), and the cached prefix this node can use. `match`:
        the directory's match of `hashes`, if the caller has it already."""
        m = self.directory.match(hashes) if match is None else match
        l1, l12 = m.node(self.id)
        if not self.s.shared_pool:
            return l1, l12, l12, l12
        c = max(l12, m.cluster)
        return l1, l12, max(l12, min(m.pool, c)), c

    def fetch_seconds(self, l1: int, l12: int, pool: int, c: int) -> float:
        s = self.s
        return s.block_bytes * (
            (l12 - l1) / s.l2_bandwidth
            + (pool - l12) / s.pool_bandwidth
            + (c - pool) / s.net_bandwidth
        )

    def enqueue(
        self, req: SimRequest, now: float, match: PrefixMatch | None = None
    ) -> tuple[int, int]:
        """Queues `req` for prefill; returns its (uncached, cached) prompt tokens as estimated
        now (the demand the planner's slices count). `match`: as in `reach`."""
        reach = self.reach(req.hashes, match)
        u = self._count(req, reach[3])
        self._queue(req, reach, now)
        return u, req.prompt_tokens - u

    def hold(
        self, req: SimRequest, now: float, match: PrefixMatch | None = None
    ) -> tuple[int, int]:
        """Takes `req` into the bootstrap queue: with early decode allocation (SGLang's
        `PrefillBootstrapQueue`) the prefill node is chosen at dispatch and the request waits
        here, off the prefill queue, until its decode node has reserved its KV (`bootstrap`).
        Its predicted seconds count in `queued_s` from now on, as the live router counts a
        dispatched prefill (`router.pd`). Returns what `enqueue` returns."""
        u = self._count(req, self.reach(req.hashes, match)[3])
        self.held[req.id] = req
        self.held_s += req.pred_s
        self.held_tokens += u
        return u, req.prompt_tokens - u

    def bootstrap(self, req: SimRequest, now: float) -> bool:
        """`req`'s decode node has reserved its KV: it leaves the bootstrap queue for the
        prefill queue. False if it is not held here (it was handed back, `take_queued`)."""
        if self.held.pop(req.id, None) is None:
            return False
        self.held_s -= req.pred_s
        self.held_tokens -= req.uncached
        if not self.held:
            self.held_s, self.held_tokens = 0.0, 0  # no float drift
        self._queue(req, None, now)
        return True

    def _count(self, req: SimRequest, c: int) -> int:
        """Counts `req`'s predicted work (its prompt's `c` leading blocks cached) in this
        node's queue; returns its uncached tokens."""
        t = req.prompt_tokens
        u = max(t - min(c * self.s.block_size, t), 1)
        req.cached_blocks = c
        req.uncached = u
        self.active_blocks += self._prompt_blocks(req)
        req.pred_s = self.env.model.predict_prefill_one(u, t - u)
        self.queued_s += req.pred_s
        self.queued_tokens += u
        return u

    def _queue(self, req: SimRequest, reach: tuple[int, int, int, int] | None, now: float) -> None:
        """Appends `req` to the prefill queue; `reach` as of now, if the caller has it (only a
        prefetch reads it: without one, no match is made)."""
        self.queue.append(req)
        if self.s.prefetch:
            self._prefetch(req, *(reach or self.reach(req.hashes)), now)
        if not self.busy:
            self._next_prefill(now)

    def prefetch(self, req: SimRequest, now: float) -> bool:
        """Fetches a queued request's cached blocks into L1 now (pinned until it runs), as
        `enqueue` does with `settings.prefetch`; True if they are (being) fetched."""
        if not req.prefetched and req in self.queue:
            self._prefetch(req, *self.reach(req.hashes), now)
        return req.prefetched

    def _prefetch(self, req: SimRequest, l1: int, l12: int, pool: int, c: int, now: float) -> None:
        if c > l1 and self._reserve_pinned(req, l1, c - l1, now):
            self._take_cached(req, l1, l12, pool, c, now)
            req.prefetched = True

    def _reserve_pinned(self, req: SimRequest, l1: int, need: int, now: float) -> bool:
        """Pins the prompt's `l1` leading L1 blocks, then reserves `need` more (the eviction
        that makes room must not take the very prefix the request is about to read); on
        failure nothing changes."""
        kv = self.kv
        kv.pinned += l1
        if not kv.room(need):
            kv.pinned -= l1
            return False
        kv.pin(req.hashes[:l1], req.id)
        kv.reserve(need, now)
        return True

    def _take_cached(
        self, req: SimRequest, l1: int, l12: int, pool: int, c: int, now: float
    ) -> None:
        """Fetches blocks l1..c into L1 (the caller pinned l1 and reserved the rest)."""
        h, kv = req.hashes, self.kv
        if c > l1:
            kv.store(h[l1:c], h[l1 - 1] if l1 else None, PIN_TIME)
            kv.pinned_to(req.id, h, c)
            kv.reserved -= c - l1
            seconds = self.fetch_seconds(l1, l12, pool, c)
            req.fetch_ready = now + seconds
            self.env.fetched(l12 - l1, c - l12, seconds)
        else:
            req.fetch_ready = now
        req.pin_p = c
        kv.pinned += c - l1
        req.cached_blocks = c

    def _admit(self, req: SimRequest, now: float) -> bool:
        bs, t, kv = self.s.block_size, req.prompt_tokens, self.kv
        total = blocks_for(t, bs)
        if req.prefetched:
            need = total - req.cached_blocks
            if not kv.reserve(need, now):
                return False
            req.res_p = need
        else:
            l1, l12, pool, c = self.reach(req.hashes)
            need = total - l1
            if not self._reserve_pinned(req, l1, need, now):
                return False
            self._take_cached(req, l1, l12, pool, c, now)
            req.res_p = need - (c - l1)
        # The cache may have changed since the request was queued: re-estimate its work.
        u = max(t - min(req.cached_blocks * bs, t), 1)
        if u != req.uncached:
            pred = self.env.model.predict_prefill_one(u, t - u)
            self.queued_s += pred - req.pred_s
            self.queued_tokens += u - req.uncached
            req.pred_s, req.uncached = pred, u
        req.remaining = u
        return True

    def _unprefetch_queue(self, now: float) -> bool:
        """Releases the pins of queued prefetched requests behind the head, so that the head
        can be admitted (else prefetches could hold the L1 the head needs: a deadlock)."""
        released = False
        for r in list(self.queue)[1:]:
            if r.prefetched:
                self.kv.unpin(r.hashes, now, r.id)
                self.kv.pinned -= r.pin_p
                r.pin_p = 0
                r.prefetched = False
                released = True
        return released

    def _next_prefill(self, now: float) -> None:
        if self.busy:
            return
        budget = self.s.chunk_tokens
        batch: list[tuple[SimRequest, int]] = []
        pairs: list[tuple[int, int]] = []
        wait = 0.0
        for r in self.running:
            if budget <= 0:
                break
            u = min(r.remaining, budget)
            batch.append((r, u))
            pairs.append((u, r.prompt_tokens - r.remaining))
            budget -= u
            wait = max(wait, r.fetch_ready - now, r.ready_floor - now)
        while budget > 0 and self.queue:
            r = self.queue[0]
            # A head that does not fit with nothing running may be blocked by the prefetches
            # behind it: release them and try once more.
            if not self._admit(r, now) and (
                self.running or not self._unprefetch_queue(now) or not self._admit(r, now)
            ):
                break
            self.queue.popleft()
            self.running.append(r)
            u = min(r.remaining, budget)
            batch.append((r, u))
            pairs.append((u, r.prompt_tokens - r.remaining))
            budget -= u
            wait = max(wait, r.fetch_ready - now, r.ready_floor - now)
        if not batch:
            return  # idle, or the head waits for KV: `kick` retries when KV is released
        compute = self.env.truth.prefill_time(pairs)
        self.busy = True
        self._iter, self._iter_pairs, self._iter_compute = batch, pairs, compute
        self.env.at(now + wait + compute, self._prefill_done, None)

    def _prefill_done(self, _: object) -> None:
        now = self._now()
        self.busy = False
        self.env.observe_prefill(self._iter_pairs, self._iter_compute)
        finished: list[SimRequest] = []
        for r, u in self._iter:
            r.remaining -= u
            self.queued_tokens -= u
            self.queued_s -= r.pred_s * u / r.uncached
            if r.remaining == 0:
                finished.append(r)
        if finished:
            self.running = [r for r in self.running if r.remaining > 0]
        if not self.running and not self.queue and not self.held:
            self.queued_s, self.queued_tokens = 0.0, 0  # no float drift across idle periods
        for r in finished:
            self._complete_prefill(r, now)
        self._next_prefill(now)
        self.env.changed(self)

    def _complete_prefill(self, req: SimRequest, now: float) -> None:
        h, c, kv = req.hashes, req.cached_blocks, self.kv
        kv.store(h[c:], h[c - 1] if c else None, PIN_TIME)
        kv.pinned_to(req.id, h, len(h))
        kv.reserved -= req.res_p
        req.res_p = 0
        kv.pinned += len(h) - c
        req.pin_p += len(h) - c
        req.prefill_done = now
        self.active_blocks -= self._prompt_blocks(req)
        self.env.prefilled(req)

    def release(self, req: SimRequest, now: float, kick: bool = True) -> None:
        """The request's KV has left this prefill node: unpin its prompt. `kick=False` leaves
        the queue alone (the caller pins what it still needs first, then kicks)."""
        self.kv.unpin(req.hashes, now, req.id)
        self.kv.pinned -= req.pin_p
        req.pin_p = 0
        if kick:
            self.kick(now)

    def kick(self, now: float) -> None:
        """KV was released: a head waiting for it may now be admitted."""
        if self.phase == "prefill" and not self.busy and self.queue:
            self._next_prefill(now)
        self.env.changed(self)

    # -- decode -------------------------------------------------------------------------------

    def offer(self, req: SimRequest, now: float) -> bool:
        """A prefilled request asks for this decode node: admitted (the caller starts the
        transfer) or queued until its KV fits."""
        req.decode_node = self.id
        self.active_blocks += self._prompt_blocks(req)
        if self.waiting or not self._admit_decode(req, now):
            self.waiting.append(req)
            self.waiting_blocks += self._blocks(req)
            return False
        return True

    def adopt(self, req: SimRequest, now: float) -> bool:
        """A request this node prefilled and kept through its switch to decode: admitted here
        (True; the caller starts the transfer, which moves nothing) when no one waits before it
        and its KV fits now; otherwise it keeps its prefill pins (False) and waits for a decode
        node like any prefilled request."""
        pins = req.pin_p
        self.release(req, now, kick=False)
        if not self.waiting and self._admit_decode(req, now):
            req.decode_node = self.id
            self.active_blocks += self._prompt_blocks(req)
            return True
        # `_admit_decode` changed nothing: pin the prompt again as its prefill left it.
        self.kv.pin(req.hashes, req.id)
        self.kv.pinned += pins
        req.pin_p = pins
        return False

    def _blocks(self, req: SimRequest) -> int:
        """`req`'s whole KV (prompt and output) in blocks."""
        return blocks_for(req.prompt_tokens + req.output_tokens, self.s.block_size)

    def _prompt_blocks(self, req: SimRequest) -> int:
        return blocks_for(req.prompt_tokens, self.s.block_size)

    def _admit_decode(self, req: SimRequest, now: float) -> bool:
        h, kv = req.hashes, self.kv
        total = self._blocks(req)
        # NOTE: whatever prefix h_d <= len(h) this node holds, `_reserve_pinned(req, h_d, total -
        # h_d)` fits only if total <= free + max(l1_held - pinned, len(h)): when even that
        # fails (a saturated node retried at every finish), skip the match, which walks the
        # whole prompt, and refuse as `_reserve_pinned` would (it changes nothing then).
        if total > kv.l1_capacity - kv.l1_held - kv.reserved + max(kv.l1_held - kv.pinned, len(h)):
            return False
        h_d = self.directory.match(h).node(self.id)[0] if h else 0
        need = total - h_d
        if not self._reserve_pinned(req, h_d, need, now):
            return False
        req.pin_d, req.res_d, req.h_d = h_d, need, h_d
        self.inbound += 1
        return True

    def admit_waiting(self, now: float) -> None:
        while self.waiting and self.state != "down" and self._admit_decode(self.waiting[0], now):
            req = self.waiting.popleft()
            self.waiting_blocks -= self._blocks(req)
            self.env.decode_reserved(req)

    def take_waiting_from(self, prefill_node: int, now: float) -> list[SimRequest]:
        """The waiting requests whose KV is on `prefill_node` (a prefill node switching to
        decode in place adopts them: `adopt`), and admits what now fits."""
        out = [r for r in self.waiting if r.prefill_node == prefill_node]
        if out:
            self.waiting = deque(r for r in self.waiting if r.prefill_node != prefill_node)
            self.waiting_blocks -= sum(self._blocks(r) for r in out)
            self.active_blocks -= sum(self._prompt_blocks(r) for r in out)
            self.admit_waiting(now)
        return out

    def take_waiting(self) -> list[SimRequest]:
        out = list(self.waiting)
        self.waiting.clear()
        self.waiting_blocks = 0
        self.active_blocks -= sum(self._prompt_blocks(r) for r in out)
        return out

    def take_queued(self, now: float) -> list[SimRequest]:
        """The prefill requests queued here and not started, released (their prefetch pins
        undone), then those in the bootstrap queue: a draining node hands them to other nodes
        rather than working through them first, which made a switch wait minutes behind a long
        queue."""
        out = list(self.queue)
        self.queue.clear()
        held = list(self.held.values())
        self.held.clear()
        self.held_s, self.held_tokens = 0.0, 0
        for r in out:
            if r.prefetched:
                self.kv.unpin(r.hashes, now, r.id)
                self.kv.pinned -= r.pin_p
                r.pin_p = 0
                r.prefetched = False
        for r in out + held:
            self.queued_s -= r.pred_s
            self.queued_tokens -= r.uncached
            self.active_blocks -= self._prompt_blocks(r)
        if not self.running:
            self.queued_s, self.queued_tokens = 0.0, 0  # no float drift once idle
        return out + held

    def arrive(self, req: SimRequest, now: float) -> None:
        """The request's KV is here: it joins the batch (after the span in flight, if any)."""
        h, hd, kv = req.hashes, req.h_d, self.kv
        kv.store(h[hd:], h[hd - 1] if hd else None, PIN_TIME)
        kv.pinned_to(req.id, h, len(h))
        moved = len(h) - hd
        kv.reserved -= moved
        req.res_d -= moved
        kv.pinned += moved
        req.pin_d += moved
        self.inbound -= 1
        req.context = req.prompt_tokens + 1
        req.left = req.output_tokens - 1
        if req.left <= 0:
            self._finish(req, now)
            self.env.changed(self)
            return
        if self.in_span:
            start, k, dt, c = self._span
            done = int((now - start) / dt) + 1  # iterations finished at the next boundary
            if done < k:
                self._span = (start, done, dt, c)
                self._token += 1
                self.env.at(start + done * dt, self._span_done, self._token)
            self.joining.append(req)
        else:
            self.batch.append(req)
            self.batch_context += req.context
            self._start_span(now)

    def _start_span(self, now: float) -> None:
        if self.joining:
            self.batch.extend(self.joining)
            self.batch_context += sum(r.context for r in self.joining)
            self.joining.clear()
        batch = self.batch
        if not batch:
            self.in_span = False
            return
        b = len(batch)
        a = self.s.accepted
        # Iterations until the first request is done (its `left` exactly when a is 1).
        k = min(self.s.span_cap, min(max(math.ceil((r.left - r.credit) / a), 1) for r in batch))
        context = self.batch_context + b * (k - 1) * a / 2
        dt = self.env.truth.decode_time(b, int(context))
        self._span = (now, k, dt, context)
        self.in_span = True
        self._token += 1
        self.env.at(now + k * dt, self._span_done, self._token)

    def _span_done(self, token: int) -> None:
        if token != self._token:
            return  # a span cut short by an arrival: its later end was rescheduled
        now = self._now()
        _, k, dt, context = self._span
        batch = self.batch
        self.env.observe_decode(len(batch), int(context), dt)
        done: list[SimRequest] = []
        a, made = self.s.accepted, 0
        for r in batch:
            gained = r.credit + k * a
            whole = math.floor(gained)
            r.credit = gained - whole
            n = min(whole, r.left)
            r.made = n
            made += n
            r.left -= n
            r.context += n
            if r.left <= 0:
                done.append(r)
        self.env.span_done(made)
        self.batch_context += made
        if done:
            self.batch = [r for r in batch if r.left > 0]
            self.batch_context -= sum(r.context for r in done)
        self.in_span = False
        for r in done:
            self._finish(r, now)
        self._start_span(now)
        self.env.changed(self)

    def _finish(self, req: SimRequest, now: float) -> None:
        """Decode done: the prompt and the response stay cached here for the next turn."""
        h, kv = req.hashes, self.kv
        n = len(h)
        kv.unpin(h, now, req.id)
        if n:
            nxt = self.env.next_hashes(req)
            end = (req.prompt_tokens + req.output_tokens) // self.s.block_size
            if nxt is not None and len(nxt) > n and nxt[n - 1] == h[n - 1] and end > n:
                req.out_hashes = nxt[n:end]
                if kv.parents is not None:  # the engine's record of chains (hints)
                    kv.parents.register(h + req.out_hashes)
                kv.store(req.out_hashes, h[n - 1], now)
        kv.reserved -= req.res_d
        kv.pinned -= req.pin_d
        req.res_d = req.pin_d = 0
        kv.fit(now)
        req.done = now
        self.active_blocks -= self._prompt_blocks(req)
        self.env.decoded(req)
        self.admit_waiting(now)  # its KV is free: the next waiting request may fit

    def _now(self) -> float:
        return self.env.now
