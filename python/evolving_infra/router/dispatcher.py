"""The interface between the HTTP front end (`app.py`) and dispatch to the engines.

The front end parses, tokenizes, hashes and applies the branch API; a `Dispatcher` chooses the
prefill and decode nodes and runs the request on them. This module holds only the contract, so
that the dispatch core and the tests' stand-ins implement the same thing without importing the
front end:

- `PreparedRequest`: everything dispatch needs, already validated;
- `generate(request)` returns an async iterator of `TextPiece`s then exactly one `Finished`;
- `limits()`: what one request may ask for (`RequestLimits`), so that the front end refuses a
  request that could never fit with OpenAI's `400 context_length_exceeded` before dispatch;
- failures are `DispatchError`s: `NoEngineError` (503: nothing can take the request, with the
  reason), `OverloadedError` (429 with a `Retry-After`: shed before dispatch, nothing ran),
  `EngineRejectedError` (400: an engine refused the request itself, its 4xx relayed as the
  client's mistake it is) and `EngineFailedError` (502, or 503 when the engine is unreachable).
  Raised before the first event, they become an HTTP error response; after it, an SSE error
  event.

The front end stops iterating (and calls `aclose()` when the iterator has one) when the client
goes away; a dispatcher releases engine work in its generator's `finally`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from evolving_infra.router.api import FinishReason, SamplingParams
from evolving_infra.router.branches import BranchInfo, BranchKey


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """One validated request, ready for dispatch.

    `token_ids` are what the engines must receive (SGLang `input_ids`): the block hashes were
    computed from them, so the engines' KV events name the same blocks (see `tokenize.py`). A
    tuple (ids sent as ids), or the branch's kept `PagedPrompt` (`turns.py`), which writes its
    own JSON without a Python int per id.
    """

    request_id: str
    kind: Literal["chat", "completion"]
    model: str
    token_ids: Sequence[int]
    block_hashes: Sequence[int]  # one per full page of `page_size` tokens (read natively)
    page_size: int
    branch: BranchKey  # the directory's key: the named branch, or the request's anonymous int
    branch_info: BranchInfo | None  # None: an anonymous request
    sampling: SamplingParams
    stream: bool
    arrival: float  # time.monotonic() when the request arrived
    user: str | None = None
    think_s: float | None = None  # since its branch's last answer (`BranchLease.think_s`)


@dataclass(frozen=True, slots=True)
class TextPiece:
    """Generated text, as the engine detokenized it; `tokens`: the output tokens it covers (may be
    0 for a flush). Informational: the usage reported to clients is `Finished.completion_tokens`.
    """

    text: str
    tokens: int = 1


@dataclass(frozen=True, slots=True)
class Finished:
    """The last event of a generation."""

    finish_reason: FinishReason
    completion_tokens: int
    cached_tokens: int | None = None  # prompt tokens the engine had cached, if it reports them


GenerationEvent = TextPiece | Finished


@dataclass(frozen=True, slots=True)
class DispatcherHealth:
    ready: bool
    reason: str = ""  # why not ready
    detail: Mapping[str, Any] = field(default_factory=dict)  # e.g. per-engine state, for /health
    # Ready, but not whole: why (e.g. engines down); "" when every engine is up.
    degraded: str = ""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may ask for, known before dispatch."""

    # Prompt and output tokens together, at most: the model's context length or the KV of the
    # largest engine, whichever is smaller. None: no limit known (the engines answer for it).
    context_tokens: int | None
    default_max_tokens: int  # the output budget of a request that names no max_tokens


class DispatchError(Exception):
    """A request that dispatch could not serve; `reason` is shown to the client."""

    status = 503

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NoEngineError(DispatchError):
    """No engine can take the request now (none up, none in the needed phase, all draining)."""

    status = 503


class OverloadedError(DispatchError):
    """The cluster cannot take the request soon enough: shed at once, before any engine saw it,
    so that the client backs off and retries instead of waiting to fail (429)."""

    status = 429

    def __init__(self, reason: str, *, retry_after_s: float) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class EngineRejectedError(DispatchError):
    """An engine refused the request itself (its HTTP 4xx): the client's mistake, a 400."""

    status = 400

    def __init__(self, reason: str, *, node: int | None = None) -> None:
        super().__init__(reason)
        self.node = node


class EngineFailedError(DispatchError):
    """The chosen engine failed: an error answer or a broken stream (502), or unreachable (503)."""

    def __init__(self, reason: str, *, node: int | None = None, unavailable: bool = False) -> None:
        super().__init__(reason)
        self.node = node
        self.status = 503 if unavailable else 502


class ShuttingDownError(DispatchError):
    """The router is stopping and had not sent the request to any engine yet (it waited for
    decode room): refused so that the drain waits only for work under way; the client sends
    it again, to another replica or once the router is back (503, `Retry-After`)."""

    status = 503


class BrokenStreamError(EngineFailedError):
    """A decode stream that broke after it had streamed (its engine crashed): `output_ids` are
    the tokens it had generated, as its last chunk said them (empty when it did not), so that
    the request can go on elsewhere from there (`PdDispatcher`'s migration)."""

    def __init__(self, reason: str, *, node: int, output_ids: tuple[int, ...]) -> None:
        super().__init__(reason, node=node)
        self.output_ids = output_ids


class Dispatcher(Protocol):
    def generate(self, request: PreparedRequest) -> AsyncIterator[GenerationEvent]:
        """Run the request: `TextPiece`s, then one `Finished`; or raise a `DispatchError`."""

    def health(self) -> DispatcherHealth:
        """Whether requests can be served now (for `/health`); must be cheap, never block."""

    def limits(self) -> RequestLimits:
        """What one request may ask for now; must be cheap, never block."""
