"""The router's view of its engines: what each one is (`EngineHandle`, kept current by the daemon)
and the work it sent there and has not seen finish (`LoadTracker`), from which the routing
policies' `NodeLoad`s are built. Counted on the router side, from what it dispatched (as Dynamo's
and SGLang's routers do), so choosing a node needs no round trip. With router replicas, the other
replicas' work (`LoadTracker.peers`, kept current by `replicas.LoadExchange`) counts too, so that
replicas do not all pick the engine that looks emptiest to each of them alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from evolving_infra.routing.base import NodeLoad
from evolving_infra.types import Phase

EngineState = Literal["up", "draining", "down"]


@dataclass(slots=True)
class EngineHandle:
    """One engine as the router knows it (from `GetInfo`, then kept current by the daemon)."""

    node: int
    http_url: str  # e.g. http://127.0.0.1:30000
    phase: Phase
    bootstrap_host: str
    bootstrap_port: int
    kv_capacity_blocks: int
    state: EngineState = "up"
    reason: str = ""  # why it is not up


@dataclass(slots=True)
class NodeWork:
    """Work the router sent to one node and has not seen finish."""

    queued_prefill_s: float = 0.0
    queued_prefill_tokens: int = 0
    decode_requests: int = 0
    decode_context: int = 0  # prompt tokens of the requests decoding (the planner's context)
    kv_used_blocks: int = 0
    active_blocks: int = 0  # prompt blocks of the requests in flight here (`NodeLoad`)

    @property
    def in_flight(self) -> float:
        """A rough single figure of the work in flight: what a switch would have to drain."""
        return self.queued_prefill_s + self.decode_requests

    def figures(self) -> list[float]:
        """The fields in order, for `replicas.LoadExchange` (`of` reads them back)."""
        return [self.queued_prefill_s, self.queued_prefill_tokens, self.decode_requests,
                self.decode_context, self.kv_used_blocks, self.active_blocks]  # fmt: skip

    @classmethod
    def of(cls, figures: Sequence[float]) -> NodeWork:
        s, tokens, requests, context, kv, active = figures
        return cls(s, int(tokens), int(requests), int(context), int(kv), int(active))

    def plus(self, other: NodeWork) -> NodeWork:
        return NodeWork.of([a + b for a, b in zip(self.figures(), other.figures(), strict=True)])


@dataclass(slots=True)
class LoadTracker:
    """Per-node work the router has sent and not yet seen finish."""

    loads: dict[int, NodeWork] = field(default_factory=dict)
    # The other router replicas' work per node, summed (empty without replicas).
    peers: dict[int, NodeWork] = field(default_factory=dict)

    def _get(self, node: int) -> NodeWork:
        return self.loads.setdefault(node, NodeWork())

    def total(self, node: int) -> NodeWork:
        """This router's work on `node` and the other replicas'."""
        own = self.loads.get(node) or NodeWork()
        peer = self.peers.get(node)
        return own if peer is None else own.plus(peer)

    def add_prefill(self, node: int, seconds: float, tokens: int, prompt_blocks: int) -> None:
        load = self._get(node)
        load.queued_prefill_s += seconds
        load.queued_prefill_tokens += tokens
        load.active_blocks += prompt_blocks

    def done_prefill(self, node: int, seconds: float, tokens: int, prompt_blocks: int) -> None:
        load = self._get(node)
        load.queued_prefill_s = max(load.queued_prefill_s - seconds, 0.0)
        load.queued_prefill_tokens = max(load.queued_prefill_tokens - tokens, 0)
        load.active_blocks = max(load.active_blocks - prompt_blocks, 0)

    def add_decode(self, node: int, blocks: int, context: int, prompt_blocks: int) -> None:
        load = self._get(node)
        load.decode_requests += 1
        load.decode_context += context
        load.kv_used_blocks += blocks
        load.active_blocks += prompt_blocks

    def done_decode(self, node: int, blocks: int, context: int, prompt_blocks: int) -> None:
        load = self._get(node)
        load.decode_requests = max(load.decode_requests - 1, 0)
        load.decode_context = max(load.decode_context - context, 0)
        load.kv_used_blocks = max(load.kv_used_blocks - blocks, 0)
        load.active_blocks = max(load.active_blocks - prompt_blocks, 0)

    def used_blocks(self, node: int) -> int:
        """KV blocks used on `node` by requests this replica and the others sent."""
        own = self.loads.get(node)
        peer = self.peers.get(node)
        return (own.kv_used_blocks if own else 0) + (peer.kv_used_blocks if peer else 0)

    def view(
        self, engines: Sequence[EngineHandle], extra: Mapping[int, int] | None = None
    ) -> list[NodeLoad]:
        """The policies' view of `engines`; `extra[node]` more KV blocks count as used (the
        decode-KV gate's commitments, `DecodeGate.extra`)."""
        out = []
        for e in engines:
            load = self.total(e.node)
            used = load.kv_used_blocks + (extra.get(e.node, 0) if extra else 0)
            out.append(
                NodeLoad(
                    node=e.node,
                    phase=e.phase,
                    accepting=e.state == "up",
                    queued_prefill_s=load.queued_prefill_s,
                    queued_prefill_tokens=load.queued_prefill_tokens,
                    decode_requests=load.decode_requests,
                    kv_used_blocks=used,
                    kv_capacity_blocks=e.kv_capacity_blocks,
                    active_blocks=load.active_blocks,
                )
            )
        return out
