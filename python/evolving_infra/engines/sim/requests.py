"""One live request of the simulated engine, its errors, and the deterministic "model" output.

The engine runs no model: a request's output is exactly `max_new_tokens` tokens, drawn from a
random generator seeded by the engine's seed and the prompt's token ids (the same prompt gives
the same output, on every engine with the same seed). Each token is one lowercase ASCII letter
or a space, its id the character's byte value, so `text` encodes to `output_ids` in UTF-8 (the
router's byte tokenizer maps the text back to the same ids, and a next turn's prompt then
reuses the response's cached pages).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from evolving_infra.nodemodel.request import SimRequest
from evolving_infra.workloads.model import Agent, AgentId, Branch, BranchId, BranchKind, Request

Mode = Literal["mixed", "prefill", "decode"]  # mixed: this engine prefills and decodes
ALPHABET = b"abcdefghijklmnopqrstuvwxyz     "  # spaces weighted: word-like text


class GenerateError(Exception):
    """A request the engine refuses or fails; `status` is its HTTP status."""

    status = 500

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class BadRequestError(GenerateError):
    status = 400


class OverloadedError(GenerateError):
    """Too many requests in the engine, or it is draining: retry on another engine."""

    status = 503


class KvPullError(GenerateError):
    """The decode side could not get the request's KV from its prefill engine."""

    status = 502


def planned_output(seed: int, input_ids: list[int], n: int) -> list[int]:
    # Hashing a tuple of ints is not salted per process: the same on every engine.
    rng = random.Random(hash((seed, tuple(input_ids))))
    return [ALPHABET[rng.randrange(len(ALPHABET))] for _ in range(n)]


def token_text(ids: list[int]) -> str:
    return bytes(ids).decode("ascii")


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """SGLang's PD fields: the prefill engine's address and the transfer's room id."""

    host: str
    port: int
    room: int


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """A validated `/generate` request."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    bootstrap: Bootstrap | None = None


def sim_request(rid: int, hashes: list[int], prompt: int, output: int) -> SimRequest:
    """A `SimRequest` outside any trace: one agent, one branch, one request."""
    spec = Request(wait=0.0, prompt_tokens=prompt, output_tokens=output, blocks=())
    branch = Branch(BranchId("live"), BranchKind.ROOT, requests=(spec,))
    agent = Agent(AgentId("live"), "live", "live", (branch,))
    return SimRequest(rid, agent, branch, 0, hashes)


class LiveRequest:
    """What the HTTP side waits on: output tokens as they come, then the end (or an error)."""

    def __init__(
        self,
        rid: str,
        sim: SimRequest,
        input_ids: list[int],
        planned: list[int],
        mode: Mode,
        bootstrap: Bootstrap | None,
        arrival: float,
    ) -> None:
        self.rid = rid
        self.sim = sim
        self.input_ids = input_ids
        self.planned = planned
        self.mode = mode
        self.bootstrap = bootstrap
        self.arrival = arrival  # simulated seconds, as `finished_at`
        self.finished_at = 0.0
        self.output_ids: list[int] = []
        self.cached_tokens = 0
        self.finished = False
        self.error: GenerateError | None = None
        self._changed = asyncio.Event()
        # A pending step (a pool look-up or hand-off, the KV pull): cancelled on close.
        self.task: asyncio.Task[None] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    def emit(self, n: int = 1) -> None:
        k = len(self.output_ids)
        self.output_ids.extend(self.planned[k : k + n])
        self._changed.set()

    def finish(self, now: float) -> None:
        self.finished, self.finished_at = True, now
        self._changed.set()

    def fail(self, error: GenerateError, now: float) -> None:
        if not self.finished:
            self.error = error
            self.finish(now)

    async def wait(self) -> None:
        """Until the request ends; raises its error if it failed."""
        while not self.finished:
            self._changed.clear()
            await self._changed.wait()
        if self.error is not None:
            raise self.error

    async def updates(self) -> AsyncIterator[tuple[int, bool]]:
        """(tokens so far, finished) whenever that changes, the last with finished=True.
        Tokens produced while the consumer was busy come together (as SGLang's cumulative
        streaming does); raises the request's error if it failed."""
        sent = 0  # the first update carries the first token, as in SGLang
        while True:
            n, done = len(self.output_ids), self.finished
            if done and self.error is not None:
                raise self.error
            if n != sent or done:
                sent = n
                yield n, done
                if done:
                    return
                continue
            self._changed.clear()
            await self._changed.wait()
