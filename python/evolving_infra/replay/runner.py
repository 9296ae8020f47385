"""The closed loop against a live router: the trace's agents, paced by real responses.

The replay rules are `sim.agents.AgentReplay`'s, reused as they are: it hands each request that
becomes ready to `post(time, request)` and learns of its response through `complete(request,
now)`, with times in seconds from the run's start; here that clock is the event loop's, so a
request is sent at its time (or at once when that is already past) and completed when its
stream ends. It lives in `sim` because its request record (`SimRequest`) carries the
simulator's per-request bookkeeping; moving the rules to `workloads` would drag that record
along, so the replay imports it (the `sim` package costs ~2 s of imports, which the CLI pays
already: `evolving-infra` registers `sim`).

Choices the trace does not make:
- A failed request still completes its step: the agent's branch goes on as the trace says (its
  next request `wait` seconds after the failure), so one error does not stall an agent forever
  and the load stays what the trace describes.
- Branch ids are `{run}.{agent}/{branch}`: agent ids are unique per drawn copy (`slot.k`), and
  the run id keeps two runs against one router apart. Each non-root request names its parent
  (`X-Agent-Parent-Branch`); a fork's first request says `fork`; a branch's last says `end`;
  a `compaction` request (not a branch's first) says so. One header holds one event: `end` wins
  over `compaction` (whose only effect is the prompt the request sets anyway), and a one-request
  fork says `fork`, then ends with `POST /v1/branches/{id}/end` after its response.
- A fork whose parent has already ended (its last response is in) cannot be forked by the
  router (404): its first request is sent as a new branch naming its parent, without `fork`
  (the router then indexes the same prompt blocks, just not as a copy); the same retry covers a
  parent that ended between the decision and the request.
- A failed last request of a branch is followed by `POST /v1/branches/{id}/end`, best effort,
  so that its branch does not stay live until the router's TTL.
- The next prompt of a branch carries the engine's answer (`PromptTokens.answered`), as a harness
  sends back what the model wrote: the blocks over the response are the streamed text's bytes
  (the router's byte tokenizer reads them back as the same ids; under another tokenizer they
  only miss, as the trace's own tokens would).
- `max_inflight` caps the requests in flight (a safety cap: the closed loop sets concurrency);
  a request held by it is sent late, and its TTFT counts from when it is sent.
- At `duration` seconds nothing more is sent: requests not yet sent are `unissued`; those in
  flight have `drain_timeout` seconds to finish, then are cancelled as failed (`drain_timeout`);
  then every branch begun and not ended is ended (`POST /v1/branches/{id}/end`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field, replace

import aiohttp
import structlog

from evolving_infra.nodemodel.request import SimRequest
from evolving_infra.replay import client
from evolving_infra.replay.prompts import PromptTokens
from evolving_infra.replay.summary import Outcome, Summary, summarize
from evolving_infra.sim.agents import AgentReplay
from evolving_infra.workloads.model import BranchKind, Trace
from evolving_infra.workloads.stats import IdealCache

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    router: str  # base URL, no trailing slash
    model: str
    duration: float  # seconds after which nothing more is sent
    drain_timeout: float = 60.0
    max_inflight: int = 256
    request_timeout: float = 600.0
    run_id: str = "run"  # in branch ids and in the prompt tokens' salt


@dataclass(slots=True)
class Progress:
    """Live counters, for the progress display."""

    issued: int = 0
    completed: int = 0
    failed: int = 0
    in_flight: int = 0
    held: int = 0  # ready, waiting for the in-flight cap
    unissued: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recent_ttft: deque[float] = field(default_factory=lambda: deque(maxlen=200))

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


def scale_time(trace: Trace, speed: float) -> Trace:
    """The trace with every wait and delay divided by `speed` (think time compressed)."""
    if speed == 1:
        return trace
    agents = tuple(
        replace(
            a,
            branches=tuple(
                replace(
                    b,
                    delay=b.delay / speed,
                    requests=tuple(replace(r, wait=r.wait / speed) for r in b.requests),
                )
                for b in a.branches
            ),
        )
        for a in trace.agents
    )
    return replace(trace, agents=agents)


class Replayer:
    """One run of `trace` against the router: `await run()` gives the summary."""

    def __init__(
        self,
        trace: Trace,
        settings: ReplaySettings,
        session: aiohttp.ClientSession,
    ) -> None:
        self.trace = trace
        self.settings = settings
        self.session = session
        self.progress = Progress()
        self.tokens = PromptTokens(trace.block_size, salt=settings.run_id)
        self.outcomes: list[Outcome] = []
        self.ideal = IdealCache()  # of the issued requests, as issued: each one's hits
        self.ideal_done = IdealCache()  # of the completed ones: the summary's h*
        self._url = f"{settings.router}/v1/completions"
        self._replay = AgentReplay(trace, self._post)
        self._sem = asyncio.Semaphore(settings.max_inflight)
        self._handles: dict[int, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._begun: set[str] = set()  # branches the router has seen a request of
        self._ended: set[str] = set()  # branches whose `end` the router has applied
        self._warned: set[str] = set()
        self._stopping = False
        self._idle = asyncio.Event()
        self._t0 = 0.0

    def branch_id(self, agent: str, branch: str) -> str:
        return f"{self.settings.run_id}.{agent}/{branch}"

    async def run(self) -> Summary:
        loop = asyncio.get_running_loop()
        self._t0 = loop.time()
        wall0 = time.monotonic()
        self._replay.start()
        self._check_idle()
        # A timeout: the duration is up, the trace is not.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), self.settings.duration)
        await self._stop()
        summary = summarize(
            self.outcomes,
            agents=sum(a.follows is None for a in self.trace.agents),  # one per slot
            duration_s=self.settings.duration,
            elapsed_s=time.monotonic() - wall0,
            issued=self.progress.issued,
            unissued=self.progress.unissued,
            ideal_hit_rate=self.ideal_done.rate,
        )
        # Sessions cut off by the duration: end their branches, or they stay live at the router
        # (their blocks counted as needed) until its TTL.
        cut = sorted(self._begun - self._ended)
        await asyncio.gather(
            *(client.end_branch(self.session, self.settings.router, b) for b in cut)
        )
        return summary

    async def _stop(self) -> None:
        self._stopping = True
        for h in self._handles.values():
            h.cancel()
            self.progress.unissued += 1
        self._handles.clear()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=self.settings.drain_timeout)
            if pending:
                log.warning("drain timeout: cancelling requests", in_flight=len(pending))
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

    # -- the closed loop ----------------------------------------------------------------------

    def _post(self, t: float, req: SimRequest) -> None:
        if self._stopping or t >= self.settings.duration:
            self.progress.unissued += 1
            return
        loop = asyncio.get_running_loop()
        self._handles[req.id] = loop.call_at(self._t0 + t, self._due, req)

    def _due(self, req: SimRequest) -> None:
        del self._handles[req.id]
        task = asyncio.get_running_loop().create_task(self._request(req))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # A bug in the replay itself: say so loudly, the run goes on.
            log.error("replay task failed", error=repr(task.exception()))
        self._check_idle()

    def _check_idle(self) -> None:
        if not self._handles and not self._tasks:
            self._idle.set()

    async def _request(self, req: SimRequest) -> None:
        p = self.progress
        p.held += 1
        issued = False
        try:
            async with self._sem:
                p.held -= 1
                if self._stopping:
                    p.unissued += 1
                    return
                issued = True
                p.issued += 1
                p.in_flight += 1
                hits = self.ideal.add(req.hashes)
                sent = asyncio.get_running_loop().time() - self._t0
                outcome = await self._send(req)
        except asyncio.CancelledError:
            if issued:
                self._record(req, Outcome.failure("drain_timeout"))
                p.in_flight -= 1
            else:
                p.held -= 1
                p.unissued += 1
            raise
        p.in_flight -= 1
        if outcome.ok:
            self.ideal_done.add(req.hashes)
            cached = min(outcome.cached_tokens // self.trace.block_size, hits)
            outcome = replace(outcome, blocks=len(req.hashes), cached_blocks=cached, sent=sent)
        else:
            outcome = replace(outcome, sent=sent)
        self._record(req, outcome)
        loop = asyncio.get_running_loop()
        self._replay.complete(req, loop.time() - self._t0)

    async def _send(self, req: SimRequest) -> Outcome:
        spec, branch = req.spec, req.branch
        key = self.branch_id(req.agent.id, branch.id)
        parent = None if branch.parent is None else self.branch_id(req.agent.id, branch.parent)
        event: str | None = None
        fork = branch.kind is BranchKind.FORK and req.index == 0
        if fork and parent not in self._ended:
            event = "fork"
        elif spec.end:
            event = "end"
        elif spec.compaction and req.index > 0:
            event = "compaction"
        prompt = self.tokens.prompt(req.hashes, spec.prompt_tokens, f"{key}#{req.index}")
        # A trace request with no output still asks for one token: the API needs max_tokens >= 1.
        body = client.completion_body(self.settings.model, prompt, max(spec.output_tokens, 1))
        headers = {client.HEADER_BRANCH: key}
        if parent is not None:
            headers[client.HEADER_PARENT] = parent
        if event is not None:
            headers[client.HEADER_EVENT] = event
        self._begun.add(key)
        answer: list[str] = []
        outcome, failure = await client.send(self.session, self._url, body, headers, answer)
        if event == "fork" and outcome.reason == f"http_404:{client.UNKNOWN_BRANCH}":
            # The parent ended meanwhile: a new branch, as when it had ended before.
            del headers[client.HEADER_EVENT]
            if spec.end:
                headers[client.HEADER_EVENT] = "end"
            answer.clear()
            outcome, failure = await client.send(self.session, self._url, body, headers, answer)
            event = headers.get(client.HEADER_EVENT)
        following = self._replay.next_hashes(req) if outcome.ok else None
        if following is not None:
            # The next turn sends this answer back, as the agent's harness would.
            output = "".join(answer).encode()
            self.tokens.answered(req.hashes, prompt, output, following)
        if failure is not None:
            self._warn(failure, key, req.index)
        if spec.end:
            if event != "end" or not outcome.ok:
                # A one-request fork, or a last request that failed: end the branch explicitly.
                await client.end_branch(self.session, self.settings.router, key)
            self._ended.add(key)
        return outcome

    def _record(self, req: SimRequest, outcome: Outcome) -> None:
        p = self.progress
        self.outcomes.append(outcome)
        if outcome.ok:
            p.completed += 1
            p.prompt_tokens += outcome.prompt_tokens
            p.cached_tokens += outcome.cached_tokens
            if outcome.ttft is not None:
                p.recent_ttft.append(outcome.ttft)
        else:
            p.failed += 1

    def _warn(self, failure: client.Failure, branch: str, index: int) -> None:
        # The first failure of each kind, with the router's message; the summary counts them all.
        if failure.reason not in self._warned:
            self._warned.add(failure.reason)
            log.warning(
                "request failed",
                reason=failure.reason,
                message=failure.message,
                branch=branch,
                request=index,
            )
