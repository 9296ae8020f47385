"""What a routing policy sees and decides (a pure decision over state handed in; DESIGN §1).

The live router and the simulator both build these views from their own state (engine metrics,
or simulated nodes) and call the same policy: a policy knows neither driver, nor the directory.
A driver matches a request's prompt once (`RouteRequest.matched`) and hands the match with the
request: the policy reads it, the driver sizes the prefill from the same figures, and nothing
the directory learns in between (the live router ingests events on other threads) can make the
two disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from evolving_infra._core import KvDirectory, PrefixMatch
from evolving_infra.types import Phase


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """One node as the router knows it from the engine's metrics."""

    node: int
    phase: Phase
    accepting: bool  # False while the node drains, switches phase or is down
    queued_prefill_s: float  # predicted seconds to drain the prefill work queued on it
    queued_prefill_tokens: int  # uncached prompt tokens queued (what Dynamo's cost counts)
    decode_requests: int  # requests in its running decode batch
    kv_used_blocks: int  # L1 blocks in use by running requests
    kv_capacity_blocks: int  # L1 capacity in blocks
    # Prompt blocks of the requests the router sent here and has not seen leave (a prefill
    # node: until their prefill completes; a decode node: until they finish), counted whole
    # (`ceil(prompt / block)`), generated tokens not counted: Dynamo's router-tracked
    # `active_blocks` with its default `router_track_output_blocks=false` (docs/baselines.md
    # §3), the load unit of its cost.
    active_blocks: int = 0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A request to place: its prompt as directory block hashes (full blocks), its size, and
    the directory's match of the prompt (`matched`; a prefill choice needs it, a decode choice
    does not)."""

    hashes: Sequence[int]
    prompt_tokens: int
    expected_output_tokens: int = 0  # when the harness or a predictor knows it; 0: unknown
    branch: str | None = None
    match: PrefixMatch | None = None

    @classmethod
    def matched(
        cls,
        directory: KvDirectory,
        hashes: Sequence[int],
        prompt_tokens: int,
        expected_output_tokens: int = 0,
        branch: str | None = None,
    ) -> RouteRequest:
        """The request with the directory's match of `hashes` taken now (both drivers build
        the requests they place this way)."""
        return cls(hashes, prompt_tokens, expected_output_tokens, branch, directory.match(hashes))

    def prefix(self) -> PrefixMatch:
        """The match a prefill choice reads; a `ValueError` for a request built without one."""
        if self.match is None:
            raise ValueError("a prefill choice needs the request's match (RouteRequest.matched)")
        return self.match


@dataclass(frozen=True, slots=True)
class Placement:
    """A prefill choice: the node, the TTFT the policy predicted there (None: it predicts
    none), and the leading prompt blocks that node holds in L1 or L2 (its cached prefix)."""

    node: int
    ttft_s: float | None
    cached_blocks: int

    @classmethod
    def on(cls, request: RouteRequest, node: int, ttft_s: float | None = None) -> Placement:
        return cls(node, ttft_s, request.prefix().node(node)[1])


class Router(Protocol):
    """Chooses the prefill node and the decode node of a request among accepting nodes.

    A router may also offer `index()`: a `routing.index.LoadIndex` that makes the same choices
    from views a driver updates one node at a time (the simulator uses it when there is one).
    """

    name: str

    def choose_prefill(self, request: RouteRequest, nodes: Sequence[NodeLoad]) -> Placement: ...

    def choose_decode(self, request: RouteRequest, nodes: Sequence[NodeLoad]) -> int: ...
