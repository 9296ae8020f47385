"""Helpers every routing policy shares: candidate filtering and KV-capacity arithmetic.

A router only ever chooses among nodes of the right phase that accept work (`NodeLoad.accepting`
is False while a node drains, switches phase or is down); when there is none the driver asked an
impossible question, which is an error rather than a silent fallback.
"""

from __future__ import annotations

from collections.abc import Sequence

from evolving_infra.routing.base import NodeLoad, RouteRequest
from evolving_infra.types import Phase, blocks_for


class NoNodeError(LookupError):
    """No accepting node of the requested phase: the driver must hold the request."""

    def __init__(self, phase: Phase) -> None:
        super().__init__(f"no accepting {phase} node")
        self.phase = phase


def candidates(nodes: Sequence[NodeLoad], phase: Phase) -> list[NodeLoad]:
    """Accepting nodes of `phase`, by node id (so every tie-break 'first' means 'lowest id')."""
    out = sorted((n for n in nodes if n.accepting and n.phase == phase), key=lambda n: n.node)
    if not out:
        raise NoNodeError(phase)
    return out


def decode_blocks_needed(request: RouteRequest, block_size: int) -> int:
    """Blocks a request holds on its decode node at the end: prompt plus expected output."""
    return blocks_for(request.prompt_tokens + request.expected_output_tokens, block_size)


def free_blocks(node: NodeLoad) -> int:
    return node.kv_capacity_blocks - node.kv_used_blocks


def most_free_decode(request: RouteRequest, nodes: Sequence[NodeLoad], block_size: int) -> int:
    """The accepting decode node with the most free KV blocks among those that can hold the
    request (ties: fewer running requests, then lowest id); if none can, the least KV-loaded
    one, which admits the request first as its running requests finish.

    Most-free rather than best-fit: decode batches grow by a block per request every
    `block_size` tokens, so headroom is what keeps a node from preempting (SGLang retracts
    requests when KV runs out mid-decode).
    """
    cands = candidates(nodes, "decode")
    need = decode_blocks_needed(request, block_size)
    fitting = [n for n in cands if free_blocks(n) >= need] or cands
    best = min(fitting, key=lambda n: (-free_blocks(n), n.decode_requests, n.node))
    return best.node
