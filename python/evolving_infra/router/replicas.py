"""Router replicas coordinated through Redis (issue 29): which replica runs the planner, and what
they share: their work per engine, their planner windows, their live branches.

Several routers may serve the same engines; each follows every engine's KV-event and sample
streams itself (ZMQ fans out), so each has the whole directory. Exactly one of them may run the
planner and issue `SwitchPhase`: the holder of the leader lease, a Redis key written with
`SET NX PX` (no home-made consensus: Redis decides who wrote it first, and its expiry ends a
dead holder's lease). Each acquisition draws a new epoch from a Redis counter in the same script,
so epochs only grow; the leader sends its epoch with every `SwitchPhase`, and an engine refuses
an epoch below the highest it has seen (`control.StaleLeaderError`). Before it decides anything,
a new leader fences every engine with a no-op switch at its epoch (`LivePlanner`), so a deposed
leader's late switch cannot land after the new leader's view of the phases.

The holder renews every `ttl_s / 3`; the others try every `ttl_s / 10`. The holder counts itself
the leader only until its last successful acquire or renewal plus `ttl_s` less a margin for the
clocks' drift (`is_leader` reads the clock), so a holder whose renewals stall (Redis unreachable,
a stopped event loop) steps down before another can take the key. A replica that stops cleanly
releases the key (`release`): the next one takes it at its next attempt rather than after the
expiry.

The work in flight (`LoadExchange`): each replica counts what it sent to each engine and has not
seen finish (`loads.LoadTracker`), and its decode-KV gate what it admitted. Alone, each would
pick the engine that looks emptiest to it, and N replicas would all pick the same one. Every
`interval` (0.1 s) each replica writes its own figures to a Redis key that expires after a few
intervals, and reads the others' in the same round trip (one script); their sum is its tracker's
`peers`, which placement, the decode-KV gate and the planner's samples count with its own. A
replica that dies stops counting once its key expires. The live branches' last blocks, which
each replica's eviction hints name, are shared the same way (`shared_tails`).

The planner's window (`SharedFeed`): the front spreads the agents over the replicas, so each sees
only its share of the arrivals. Each replica appends what its dispatcher tells the planner's
window (arrivals with every `REUSE_STRIDE`-th block hash, tokens decoded, prefills) to a Redis
stream every `interval` (0.5 s), and applies the others' entries to its own window as they
arrive (stamped with its own clock on receipt, at most an interval late), so every replica's
window holds every arrival and a replica that takes the lease over decides on a warm window.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn

import numpy as np
import structlog

from evolving_infra.planner.reuse import REUSE_STRIDE
from evolving_infra.planner.slices import Slices
from evolving_infra.ports import LOOPBACK
from evolving_infra.router.loads import LoadTracker, NodeWork
from evolving_infra.router.observer import PlannerFeed

log = structlog.get_logger(__name__)

DEFAULT_TTL_S = 5.0
DEFAULT_PREFIX = "evolving-infra"
# Of the lease's time, what a holder does not count on: Redis's expiry and the holder's clock
# may disagree this much (monotonic clocks drift by far less over seconds).
DRIFT_MARGIN = 0.1

# KEYS[1] the lease, KEYS[2] the epoch counter; ARGV[1] the replica, ARGV[2] the TTL in ms.
# The new epoch when the lease was free (and is now ours), else 0.
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. epoch, 'PX', ARGV[2])
return epoch
"""
# KEYS[1] the lease; ARGV[1] its value as we wrote it, ARGV[2] the TTL in ms. 1 when renewed.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
# KEYS[1] the lease; ARGV[1] its value as we wrote it. 1 when it was ours and is gone.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def redis_server_command(binary: str, port: int) -> list[str]:
    """The coordination service as `cluster up` and the tests run it: Debian's `redis-server`
    at `binary`, on loopback `port`, keeping nothing on disk."""
    return [binary, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no"]


def redis_answers(port: int) -> bool:
    """Whether a Redis server on loopback `port` answers PING now."""
    with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), 1.0) as c:
        c.sendall(b"PING\r\n")
        return c.recv(16).startswith(b"+PONG")
    return False


class Outage:
    """Redis failing for one of a replica's loops: a warning `event` when it starts and an
    `event`_ended line when it ends, not one per attempt (the loops try every 0.1-2 s)."""

    def __init__(self, event: str, replica: str) -> None:
        self.event = event
        self.replica = replica
        self.since: float | None = None  # when it started (monotonic); None: no outage

    def failed(self, error: Exception) -> float:
        """Seconds since the outage started (0 at its first failure)."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
            log.warning(self.event, replica=self.replica, error=str(error))
        return now - self.since

    def ended(self) -> None:
        if self.since is not None:
            log.info(f"{self.event}_ended", replica=self.replica)
            self.since = None


class LeaderLease:
    """One replica's side of the leader lease (see the module docstring).

    `client`: a `redis.asyncio.Redis`; `replica`: this replica's name, unique among them;
    `on_change(leader, epoch)`: called when this replica gains or loses the lease.
    """

    def __init__(
        self,
        client: Any,
        replica: str,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[bool, int], None] | None = None,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if not replica or " " in replica:
            raise ValueError(f"a replica name is non-empty and has no spaces, got {replica!r}")
        self.client = client
        self.replica = replica
        self.ttl_s = ttl_s
        self.key = f"{prefix}:leader"
        self.epoch_key = f"{prefix}:leader:epoch"
        self.on_change = on_change
        self._clock = clock
        self.epoch = 0  # of the lease this replica holds or last held; 0: never held
        self._until = 0.0  # is_leader holds until then (this replica's clock)
        self._outage = Outage("leader_lease_failed", replica)
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)

    @property
    def is_leader(self) -> bool:
        return self._clock() < self._until

    @property
    def _value(self) -> str:
        return f"{self.replica} {self.epoch}"

    @property
    def _ttl_ms(self) -> int:
        return max(int(self.ttl_s * 1000), 1)

    async def attempt(self) -> bool:
        """Renew the lease when this replica holds it, else try to take it; whether this
        replica leads now. A Redis error counts as a failed attempt (logged)."""
        was = self.is_leader
        start = self._clock()
        try:
            # Renewed while the key is still ours, even after an attempt that failed here (a
            # lost answer): the epoch stays, as nobody else can have held the lease meanwhile.
            held = self.epoch > 0 and bool(
                await self._renew(keys=[self.key], args=[self._value, self._ttl_ms])
            )
            if not held:
                epoch = int(await self._acquire(keys=[self.key, self.epoch_key],
                                                args=[self.replica, self._ttl_ms]))  # fmt: skip
                if epoch:
                    self.epoch, held = epoch, True
        except Exception as e:  # Redis unreachable or failing: not renewed
            self._outage.failed(e)
            held = False
        else:
            self._outage.ended()
        # Counted from before the call: Redis's expiry started no earlier than that.
        self._until = start + self.ttl_s * (1 - DRIFT_MARGIN) if held else 0.0
        if held != was:
            log.info("leader" if held else "leader_lost", replica=self.replica, epoch=self.epoch)
            if self.on_change is not None:
                self.on_change(held, self.epoch)
        return held

    async def run(self) -> NoReturn:
        """Renew every `ttl_s / 3` seconds while leading, else try to take the lease every
        `ttl_s / 10` (a dead leader's lease is taken at most that long after it expires), for
        ever (cancel to stop; then `release`)."""
        while True:
            leads = await self.attempt()
            await asyncio.sleep(self.ttl_s / (3 if leads else 10))

    async def release(self) -> None:
        """Give the lease up now if this replica holds it (a clean stop)."""
        if self._until == 0.0:
            return
        self._until = 0.0
        with contextlib.suppress(Exception):  # unreachable: the expiry frees it
            await self._release(keys=[self.key], args=[self._value])
        log.info("leader_released", replica=self.replica, epoch=self.epoch)
        if self.on_change is not None:
            self.on_change(False, self.epoch)

    async def holder(self) -> tuple[str, int] | None:
        """Who holds the lease now, and at which epoch (None: nobody)."""
        value = await self.client.get(self.key)
        if value is None:
            return None
        name, _, epoch = _text(value).rpartition(" ")
        return name, int(epoch)


# KEYS[1] the set of replica names; ARGV[1] the key prefix, ARGV[2] this replica, ARGV[3] its
# value, ARGV[4] its TTL in ms. Writes ours; returns the others' as [name, value, ...], and
# forgets the names whose values expired (a replica gone).
_SWAP = """
redis.call('SADD', KEYS[1], ARGV[2])
redis.call('SET', ARGV[1] .. ARGV[2], ARGV[3], 'PX', ARGV[4])
local out = {}
for _, name in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if name ~= ARGV[2] then
    local v = redis.call('GET', ARGV[1] .. name)
    if v then
      table.insert(out, name)
      table.insert(out, v)
    else
      redis.call('SREM', KEYS[1], name)
    end
  end
end
return out
"""


class Board:
    """One value per replica of one `kind`, each written with an expiry: `swap` writes this
    replica's and reads the others' in one round trip (one script); `leave` removes it."""

    def __init__(self, client: Any, replica: str, kind: str, prefix: str = DEFAULT_PREFIX) -> None:
        self.client = client
        self.replica = replica
        self.members = f"{prefix}:{kind}:members"
        self.prefix = f"{prefix}:{kind}:of:"
        self.outage = Outage(f"{kind}_exchange_failed", replica)  # for its users' loops
        self._script = client.register_script(_SWAP)

    async def swap(self, value: bytes | str, ttl_s: float) -> list[bytes]:
        """Write ours (kept `ttl_s`), return the others' values."""
        ttl_ms = max(int(ttl_s * 1000), 1)
        raw = await self._script(
            keys=[self.members], args=[self.prefix, self.replica, value, ttl_ms]
        )
        return [v if isinstance(v, bytes) else str(v).encode() for v in raw[1::2]]

    async def leave(self) -> None:
        with contextlib.suppress(Exception):  # unreachable: the expiry removes it
            await self.client.delete(self.prefix + self.replica)
            await self.client.srem(self.members, self.replica)


DEFAULT_EXCHANGE_S = 0.1
EXPIRE_INTERVALS = 5  # a replica's figures outlive this many missed writes, no more


class LoadExchange:
    """Each replica's work per engine, shared through Redis (see the module docstring).

    `extra()`: KV blocks committed per engine beyond the tracker's count (the decode-KV gate's
    admitted requests, `admission.DecodeGate.claimed`), published with this replica's KV
    figure. `on_change()`: called when the others' work changed (the engine registry's
    `changed`: the decode-KV gate re-checks its queues then, or a request waiting for room
    another replica freed would wait until this replica's own next change, or its 60 s, and be
    refused).
    """

    def __init__(
        self,
        client: Any,
        replica: str,
        tracker: LoadTracker,
        *,
        extra: Callable[[], Mapping[int, int]] | None = None,
        on_change: Callable[[], None] | None = None,
        interval: float = DEFAULT_EXCHANGE_S,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.board = Board(client, replica, "load", prefix)
        self.replica = replica
        self.tracker = tracker
        self.extra = extra
        self.on_change = on_change
        self.interval = interval
        self.peers_seen = 0  # other replicas in the last exchange

    def figures(self) -> str:
        """This replica's work as published: {node: NodeWork.figures()} as JSON."""
        extra = self.extra() if self.extra is not None else {}
        loads = self.tracker.loads
        out = {}
        for node in loads.keys() | extra.keys():
            work = loads.get(node) or NodeWork()
            if extra.get(node):  # the gate's commitments count as used KV too
                work = dataclasses.replace(work, kv_used_blocks=work.kv_used_blocks + extra[node])
            out[str(node)] = work.figures()
        return json.dumps(out, separators=(",", ":"))

    async def exchange(self) -> bool:
        """Publish ours, read the others' into `tracker.peers`; False when Redis failed (the
        peers are kept for `EXPIRE_INTERVALS` intervals, then dropped: stale work misleads)."""
        try:
            values = await self.board.swap(self.figures(), self.interval * EXPIRE_INTERVALS)
        except Exception as e:
            if self.board.outage.failed(e) > self.interval * EXPIRE_INTERVALS:
                self._set_peers({})
            return False
        self.board.outage.ended()
        peers: dict[int, NodeWork] = {}
        for value in values:
            for node, figures in json.loads(value).items():
                work = NodeWork.of(figures)
                n = int(node)
                peers[n] = work if n not in peers else peers[n].plus(work)
        self._set_peers(peers)
        self.peers_seen = len(values)
        return True

    def _set_peers(self, peers: dict[int, NodeWork]) -> None:
        if peers != self.tracker.peers:
            self.tracker.peers = peers
            if self.on_change is not None:
                self.on_change()

    async def run(self) -> NoReturn:
        while True:
            await self.exchange()
            await asyncio.sleep(self.interval)

    async def leave(self) -> None:
        """Take this replica's figures out now (a clean stop)."""
        await self.board.leave()


async def shared_tails(board: Board, own: Iterable[int], ttl_s: float) -> set[int]:
    """The live branches' last blocks of every replica: `own` published (as int64s), the
    others' read. Each replica's eviction hints replace the engine's previous set, so each sends
    the union: otherwise an engine would keep only the last sender's branches. A Redis error
    gives `own` alone (logged once per outage)."""
    mine = set(own)
    try:
        values = await board.swap(np.array(sorted(mine), dtype=np.int64).tobytes(), ttl_s)
    except Exception as e:
        board.outage.failed(e)
        return mine
    board.outage.ended()
    for v in values:
        mine.update(int(x) for x in np.frombuffer(v, dtype=np.int64))
    return mine


DEFAULT_FEED_S = 0.5
STREAM_MAXLEN = 100_000  # entries the window stream keeps (approximately: Redis trims lazily)


class SharedFeed(PlannerFeed):
    """The planner's window fed by every replica's dispatcher (see the module docstring): this
    replica's events go to its own window at once and, batched, to the stream."""

    def __init__(
        self,
        slices: Slices,
        client: Any,
        replica: str,
        *,
        interval: float = DEFAULT_FEED_S,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(slices)
        self.client = client
        self.replica = replica
        self.interval = interval
        self.stream = f"{prefix}:window"
        self.clock = clock
        self.applied = 0  # the others' entries applied
        self._out: list[list[Any]] = []
        self._tokens = 0
        self._last_id: bytes | str | None = None  # of the stream: read after it
        self._outage = Outage("window_exchange_failed", replica)

    def arrival(
        self,
        prompt_tokens: int,
        uncached: int,
        cached: int,
        hashes: Sequence[int],
        now: float,
        think_s: float | None = None,
    ) -> None:
        super().arrival(prompt_tokens, uncached, cached, hashes, now, think_s)
        sampled = [int(h) for h in hashes[::REUSE_STRIDE]]
        self._out.append(["a", prompt_tokens, uncached, cached, sampled, think_s])

    def answered(self, ttft_s: float, response_s: float) -> None:
        super().answered(ttft_s, response_s)
        self._out.append(["r", ttft_s, response_s])

    def tokens(self, n: int) -> None:
        super().tokens(n)
        self._tokens += n

    def prefilled(self, prompt_tokens: int, uncached: int) -> None:
        super().prefilled(prompt_tokens, uncached)
        self._out.append(["p", prompt_tokens, uncached])

    async def exchange(self) -> bool:
        """Append ours, apply the others' since the last read; False when Redis failed (ours
        are kept for the next try)."""
        try:
            if self._last_id is None:  # from now on: the stream's past is older windows'
                last = await self.client.xrevrange(self.stream, count=1)
                self._last_id = last[0][0] if last else "0-0"
            if self._out or self._tokens:
                out = self._out + ([["t", self._tokens]] if self._tokens else [])
                body = json.dumps(out, separators=(",", ":"))
                await self.client.xadd(
                    self.stream, {"from": self.replica, "events": body},
                    maxlen=STREAM_MAXLEN, approximate=True,
                )  # fmt: skip
                self._out, self._tokens = [], 0
            read = await self.client.xread({self.stream: self._last_id}, count=10_000)
        except Exception as e:
            self._outage.failed(e)
            return False
        self._outage.ended()
        now = self.clock()
        for _, entries in read:
            for entry_id, fields in entries:
                self._last_id = entry_id
                if _text(fields.get(b"from", fields.get("from"))) == self.replica:
                    continue
                self._apply(json.loads(_text(fields.get(b"events", fields.get("events")))), now)
        return True

    def _apply(self, events: list[list[Any]], now: float) -> None:
        s = self.slices
        for e in events:
            if e[0] == "a":
                # A replica of an earlier version sends no think time.
                think = e[5] if len(e) > 5 else None
                s.arrival(e[1], e[2], e[3], e[4], now, sampled=True, think_s=think)
            elif e[0] == "r":
                s.answered(e[1], e[2])
            elif e[0] == "p":
                s.prefilled(e[1], e[2])
            elif e[0] == "t":
                s.tokens(e[1])
            self.applied += 1

    async def run(self) -> NoReturn:
        while True:
            await self.exchange()
            await asyncio.sleep(self.interval)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
