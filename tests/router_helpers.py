"""Shared pieces of the router front-end tests: a stand-in dispatcher and an app on loopback.

`EchoDispatcher` stands in for the real dispatch core (choosing prefill/decode engines, SGLang's
PD request protocol), which is built after the front end: it generates a deterministic reply
from the prepared request alone, so the tests check the front end's side of the `Dispatcher`
contract exactly. Everything else is real: aiohttp server and client on loopback, the Rust
`KvDirectory`, prometheus_client, Hugging Face `tokenizers`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from evolving_infra import KvDirectory
from evolving_infra.router.api import FinishReason
from evolving_infra.router.app import build_app
from evolving_infra.router.branches import BranchTracker
from evolving_infra.router.dispatcher import (
    DispatcherHealth,
    DispatchError,
    Finished,
    GenerationEvent,
    PreparedRequest,
    RequestLimits,
    TextPiece,
)
from evolving_infra.router.metrics import RouterMetrics
from evolving_infra.router.tokenize import ByteTokenizer, Tokenizer
from evolving_infra.router.transport import Body

PAGE = 4  # tokens per page: short prompts already span several blocks


def piece(i: int) -> str:
    return f"t{i} "


def expected_text(n: int) -> str:
    return "".join(piece(i) for i in range(n))


@dataclass
class EchoDispatcher:
    """Replies `max_tokens` (default `default_tokens`) pieces "t0 ", "t1 ", ...; finish "length"
    when max_tokens was given, else "stop"; reports `cached_tokens` = one page per full block.

    `fail`: raised before the first event; `fail_after`: raised after that many pieces;
    `delay`: seconds between pieces (to disconnect mid-stream); `raise_bug`: an unexpected error.
    """

    default_tokens: int = 3
    fail: DispatchError | None = None
    fail_after: int | None = None
    delay: float = 0.0
    ready: bool = True
    degraded: str = ""
    context_tokens: int | None = None  # `limits()`: None, no limit
    raise_bug: bool = False
    seen: list[PreparedRequest] = field(default_factory=list)
    open: int = 0  # generations started and not yet closed
    closed: int = 0

    def health(self) -> DispatcherHealth:
        reason = "" if self.ready else "no engine registered"
        detail = {"engines": 1 if self.ready else 0}
        return DispatcherHealth(self.ready, reason, detail, self.degraded)

    def limits(self) -> RequestLimits:
        return RequestLimits(self.context_tokens, self.default_tokens)

    def generate(self, request: PreparedRequest) -> AsyncIterator[GenerationEvent]:
        self.seen.append(request)
        return self._run(request)

    async def _run(self, request: PreparedRequest) -> AsyncIterator[GenerationEvent]:
        self.open += 1
        try:
            if self.raise_bug:
                raise RuntimeError("a bug in dispatch")
            if self.fail is not None:
                raise self.fail
            n = request.sampling.max_tokens or self.default_tokens
            for i in range(n):
                if self.fail_after is not None and i == self.fail_after:
                    raise DispatchError("engine stream broke")
                if self.delay:
                    await asyncio.sleep(self.delay)
                yield TextPiece(piece(i))
            reason: FinishReason = "length" if request.sampling.max_tokens else "stop"
            yield Finished(reason, n, cached_tokens=len(request.block_hashes) * PAGE)
        finally:
            self.open -= 1
            self.closed += 1


@dataclass
class Router:
    """One app under test and its parts."""

    client: TestClient[Any, Any]
    dispatcher: EchoDispatcher
    directory: KvDirectory
    tracker: BranchTracker
    metrics: RouterMetrics


def run_router(
    test: Callable[[Router], Awaitable[None]],
    *,
    dispatcher: EchoDispatcher | None = None,
    tokenizer: Tokenizer | None = None,
    tracker: BranchTracker | None = None,
    **app_kwargs: Any,
) -> None:
    """Run `test` against a fresh router on loopback (a new event loop per test)."""

    async def main() -> None:
        d = dispatcher or EchoDispatcher()
        t = tracker or BranchTracker(KvDirectory(), ttl=3600.0)
        m = RouterMetrics()
        app = build_app(d, t, tokenizer or ByteTokenizer(), m, page_size=PAGE, **app_kwargs)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            await test(Router(client, d, t.directory, t, m))

    asyncio.run(main())


def parse_sse(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded; the final `[DONE]` kept as a string."""
    assert text.endswith("\n\n"), "every event ends with a blank line"
    out: list[Any] = []
    for event in text[:-2].split("\n\n"):
        assert event.startswith("data: "), event
        data = event[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


class Legs:
    """A `transport.PdTransport` whose two legs are a test's own coroutines (the seam the
    dispatcher's tests send through); with none given, a leg sends nothing and answers nothing
    (for tests that only place requests)."""

    def __init__(
        self,
        prefill: Callable[[Any, bytes], Awaitable[None]] | None = None,
        decode: Callable[[Any, bytes], AsyncIterator[GenerationEvent]] | None = None,
    ) -> None:
        self._prefill, self._decode = prefill, decode

    async def prefill(self, engine: Any, body: Body) -> None:
        if self._prefill is not None:
            await self._prefill(engine, bytes(body))

    async def decode(self, engine: Any, body: Body) -> AsyncGenerator[GenerationEvent, None]:
        if self._decode is not None:
            async for event in self._decode(engine, bytes(body)):
                yield event
