"""The branch API: which agent branch a request belongs to, and the directory's branch counts.

An agent harness names the branch of each request, in headers or in the body field `agent`:

| header                  | body: `"agent": {...}` | meaning                                  |
|-------------------------|------------------------|------------------------------------------|
| `X-Agent-Branch`        | `branch`               | the branch id                            |
| `X-Agent-Parent-Branch` | `parent`               | the branch it was spawned from           |
| `X-Agent-Event`         | `event`                | `fork`, `compaction` or `end` (optional) |

Neither source wins: the two are merged field by field, and a field given in both with different
values is a 400 (a harness that says two things has a bug the router should not hide).

What each request does to the directory (DESIGN §2, `R_b`), with H the prompt's block hashes:
- any request on branch b: `branch_set(b, H)` before dispatch; b is created if new;
- `fork`: `branch_fork(parent, b)` first (parent unknown: 404; b existing with another parent:
  409; b existing as a fork of the same parent: a retry, so no error);
- `compaction`: the same `branch_set`, whose chain now diverges early, so the replaced history
  loses its counts; b must exist (404 otherwise: a compaction rewrites a context it knows);
- `end`: `branch_end(b)` once the response is complete (as a trace's last request ends its
  branch), or at once with `POST /v1/branches/{id}/end` (unknown: 404);
- no branch info: an anonymous branch for the request alone, ended when it completes, so a
  running request's blocks still count as needed.
A parent without `fork` is a sub-agent's own context: recorded for logs, no directory effect.

Branches idle for longer than the TTL are ended by `expire`, so that a harness that never ends its
branches cannot make every block look needed forever.

With router replicas (`adopt_unknown`), a branch can arrive at a replica that never saw it: its
tree's replica died and the front moved the tree (`front.py`). A fork of a parent this replica
does not know, or a compaction of a branch it does not know, then starts the branch from the
request's own prompt (logged `branch_adopted`) instead of a 404: the prompt holds the context the
parent's or the old one's would have given, so nothing the client sent is lost.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import structlog

from evolving_infra import KvDirectory, KvDirectoryError
from evolving_infra.router.api import (
    BRANCH_CONFLICT,
    ApiError,
    invalid,
)

log = structlog.get_logger(__name__)

HEADER_BRANCH = "X-Agent-Branch"
HEADER_PARENT = "X-Agent-Parent-Branch"
HEADER_EVENT = "X-Agent-Event"
MAX_BRANCH_ID = 256  # characters; ids are keys in the directory and labels in logs


class BranchEvent(StrEnum):
    FORK = "fork"
    COMPACTION = "compaction"
    END = "end"


@dataclass(frozen=True, slots=True)
class BranchInfo:
    branch: str
    parent: str | None = None
    event: BranchEvent | None = None


def check_branch_id(value: str, param: str) -> str:
    """A branch id: 1 to MAX_BRANCH_ID printable characters (no control characters)."""
    if not value:
        raise invalid("a branch id must not be empty", param)
    if len(value) > MAX_BRANCH_ID:
        raise invalid(f"a branch id has at most {MAX_BRANCH_ID} characters", param)
    if not value.isprintable():
        raise invalid("a branch id must be printable characters", param)
    return value


def _field(
    headers: Mapping[str, str], header: str, agent: Mapping[str, Any] | None, key: str
) -> str | None:
    getall = getattr(headers, "getall", None)  # a repeated header (aiohttp's multidict)
    if getall is not None and len(set(getall(header, []))) > 1:
        raise ApiError(
            400, f"header {header} given with different values", code=BRANCH_CONFLICT, param=header
        )
    from_header = headers.get(header)
    from_body = None if agent is None else agent.get(key)
    if from_body is not None and not isinstance(from_body, str):
        raise invalid(f"'agent.{key}' must be a string", f"agent.{key}")
    if from_header is not None:
        from_header = from_header.strip()
    if from_header is not None and from_body is not None and from_header != from_body:
        raise ApiError(
            400,
            f"header {header} ({from_header!r}) and body field agent.{key} ({from_body!r}) differ",
            code=BRANCH_CONFLICT,
            param=f"agent.{key}",
        )
    return from_header if from_header is not None else from_body


def parse_branch_info(
    headers: Mapping[str, str], agent: Mapping[str, Any] | None
) -> BranchInfo | None:
    """The request's branch from its headers and body field `agent` (None: no branch info)."""
    if agent is not None:
        unknown = sorted(set(agent) - {"branch", "parent", "event"})
        if unknown:
            raise invalid(f"unknown agent fields: {', '.join(unknown)}", f"agent.{unknown[0]}")
    branch = _field(headers, HEADER_BRANCH, agent, "branch")
    parent = _field(headers, HEADER_PARENT, agent, "parent")
    event_text = _field(headers, HEADER_EVENT, agent, "event")
    if branch is None:
        if parent is not None or event_text is not None:
            raise invalid(f"a parent or an event needs a branch ({HEADER_BRANCH})", "agent.branch")
        return None
    check_branch_id(branch, "agent.branch")
    if parent is not None:
        check_branch_id(parent, "agent.parent")
        if parent == branch:
            raise invalid("a branch cannot be its own parent", "agent.parent")
    event = None
    if event_text is not None:
        try:
            event = BranchEvent(event_text.lower())
        except ValueError:
            choices = ", ".join(e.value for e in BranchEvent)
            raise invalid(
                f"unknown event {event_text!r} (one of {choices})", "agent.event"
            ) from None
    if event is BranchEvent.FORK and parent is None:
        raise invalid(f"a fork needs its parent ({HEADER_PARENT})", "agent.parent")
    return BranchInfo(branch, parent, event)


BranchKey = str | int  # named branches are str, anonymous ones int: they can never collide


@dataclass(slots=True)
class _Live:
    parent: str | None  # the branch it was forked from (None: not a fork)
    last_active: float
    in_flight: int = 0
    tail: int | None = None  # the last block of its context: what eviction hints name
    finished: float | None = None  # when its last request ended (None: none has yet)


@dataclass(slots=True)
class BranchLease:
    """One request's hold on its branch, from `begin` to `finish`."""

    key: BranchKey
    info: BranchInfo | None
    anonymous: bool
    end_after: bool  # the request carries the `end` event
    done: bool = field(default=False)
    # Seconds since the branch's last request ended, none in flight since (the agent's think
    # time, which the planner's window counts); None for a branch's first request.
    think_s: float | None = None


class BranchError(Exception):
    """Branch info the tracker's state refuses (the app answers it as a client error);
    `param`: the request field it came from."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownBranchError(BranchError):
    """A parent, a compacted branch or a branch to end that is not live (never begun, ended or
    expired)."""


class BranchExistsError(BranchError):
    """A fork onto a live branch that was forked from another parent."""


class BranchTracker:
    """Named and anonymous branches over a `KvDirectory`, with idle expiry.

    Used from the router's event loop only (the directory itself is thread-safe, and shared with
    the event-ingestion threads). `clock` is injectable so that tests drive expiry.
    """

    def __init__(
        self,
        directory: KvDirectory,
        ttl: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl}")
        self.directory = directory
        self.ttl = ttl
        self._clock = clock
        self._named: dict[str, _Live] = {}
        self._anonymous: set[int] = set()
        self._ids = itertools.count()
        self.on_event: Callable[[str], None] | None = None  # called with each event's name
        self.on_end: Callable[[str], None] | None = None  # called with each ended named branch
        self.adopt_unknown = False  # router replicas: see the module docstring

    @property
    def live(self) -> int:
        return len(self._named)

    @property
    def anonymous_live(self) -> int:
        return len(self._anonymous)

    def __contains__(self, branch: str) -> bool:
        return branch in self._named

    def _count(self, event: str) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def begin(self, info: BranchInfo | None, hashes: Sequence[int]) -> BranchLease:
        """Apply a request's branch info and prompt to the directory, before dispatch."""
        now = self._clock()
        if info is None:
            key = next(self._ids)
            self._set(key, hashes)
            self._anonymous.add(key)
            return BranchLease(key, None, anonymous=True, end_after=False)
        b = info.branch
        live = self._named.get(b)
        if info.event is BranchEvent.FORK:
            assert info.parent is not None, "parse_branch_info: a fork has a parent"
            if live is None and info.parent not in self._named:
                if not self.adopt_unknown:
                    raise UnknownBranchError(
                        f"unknown parent branch {info.parent!r}", "agent.parent"
                    )
                log.info("branch_adopted", branch=b, parent=info.parent, on="fork")
                live = self._named[b] = _Live(info.parent, now)  # a retry is the same fork
            elif live is None:
                # A KvDirectoryError here is a bug (the tracker and the directory disagree):
                # it reaches the app's catch-all, a logged 500.
                self.directory.branch_fork(info.parent, b)
                parent_tail = self._named[info.parent].tail
                live = self._named[b] = _Live(info.parent, now, tail=parent_tail)
            elif live.parent != info.parent:
                raise BranchExistsError(
                    f"branch {b!r} already exists (forked from {live.parent!r}, not"
                    f" {info.parent!r})",
                    "agent.branch",
                )
        elif info.event is BranchEvent.COMPACTION and live is None:
            if not self.adopt_unknown:
                raise UnknownBranchError(f"compaction of unknown branch {b!r}", "agent.branch")
            log.info("branch_adopted", branch=b, on="compaction")
        self._set(b, hashes)
        if live is None:
            live = self._named[b] = _Live(parent=None, last_active=now)
        think = None if live.in_flight or live.finished is None else now - live.finished
        live.last_active = now
        live.tail = hashes[-1] if hashes else None
        live.in_flight += 1
        if info.event is not None:
            self._count(info.event.value)
        end = info.event is BranchEvent.END
        return BranchLease(b, info, anonymous=False, end_after=end, think_s=think)

    def _set(self, key: BranchKey, hashes: Sequence[int]) -> None:
        try:
            self.directory.branch_set(key, hashes)
        except KvDirectoryError as e:
            # Page hashes chain by sha256, so this means a hashing bug, not a bad request: the
            # app's catch-all answers a logged 500.
            raise RuntimeError(f"the KV directory refused the prompt: {e}") from e

    def finish(self, lease: BranchLease) -> None:
        """The request is over (done, failed or disconnected); idempotent."""
        if lease.done:
            return
        lease.done = True
        if lease.anonymous:
            assert isinstance(lease.key, int)
            self._anonymous.discard(lease.key)
            self.directory.branch_end(lease.key)
            return
        assert isinstance(lease.key, str)
        live = self._named.get(lease.key)
        if live is None:  # ended meanwhile (POST .../end, or expired)
            return
        live.in_flight -= 1
        live.last_active = live.finished = self._clock()
        if lease.end_after:
            self._end(lease.key)

    def live_tails(self) -> dict[str, int]:
        """The last block of each live named branch's context (for eviction hints: an engine
        keeps the chain up to a hinted block ahead of blocks no live branch needs)."""
        return {b: s.tail for b, s in self._named.items() if s.tail is not None}

    def end(self, branch: str) -> bool:
        """`POST /v1/branches/{id}/end`: end a named branch now. Idempotent, as a harness that
        retries the call (or ends a branch the TTL already ended) expects: False when the
        branch was not live, which changes nothing."""
        if branch not in self._named:
            return False
        self._count(BranchEvent.END.value)
        self._end(branch)
        return True

    def _end(self, branch: str) -> None:
        del self._named[branch]
        self.directory.branch_end(branch)
        if self.on_end is not None:
            self.on_end(branch)

    def expire(self) -> list[str]:
        """End the named branches idle for longer than the TTL (none with a request running)."""
        cutoff = self._clock() - self.ttl
        stale = [b for b, s in self._named.items() if s.in_flight == 0 and s.last_active < cutoff]
        for b in stale:
            self._end(b)
            self._count("expired")
        if stale:
            log.info("branches expired", count=len(stale), ttl=self.ttl)
        return stale
