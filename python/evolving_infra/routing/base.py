"""What a routing policy sees and decides (a pure decision over state handed in; DESIGN §1).

The live router and the simulator both build these views from their own state (engine metrics,
or simulated nodes) and call the same policy: a policy knows neither driver.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from evolving_infra._core import KvDirectory

Phase = Literal["prefill", "decode"]


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
    """A request to place: its prompt as directory block hashes (full blocks) and its size."""

    hashes: Sequence[int]
    prompt_tokens: int
    expected_output_tokens: int = 0  # when the harness or a predictor knows it; 0: unknown
    branch: str | None = None


class Router(Protocol):
    """Chooses the prefill node and the decode node of a request among accepting nodes.

    A router may also offer `index()`: a `routing.index.LoadIndex` that makes the same choices
    from views a driver updates one node at a time (the simulator uses it when there is one).
    """

    name: str

    def choose_prefill(
        self, request: RouteRequest, nodes: Sequence[NodeLoad], directory: KvDirectory
    ) -> int: ...

    def choose_decode(
        self, request: RouteRequest, nodes: Sequence[NodeLoad], directory: KvDirectory
    ) -> int: ...
