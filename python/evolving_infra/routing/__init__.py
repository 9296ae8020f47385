"""Routing policies: which node prefills and which decodes a request (pure decisions).

`ROUTERS` maps each policy's routing name to a factory taking the node's iteration-time model,
the KV block size (tokens per page) and the KV bytes per token, so a driver can build any of
them the same way; policies ignore what they do not use.
"""

from collections.abc import Callable

from evolving_infra.routing.base import NodeLoad, Placement, Router, RouteRequest
from evolving_infra.routing.common import NoNodeError
from evolving_infra.routing.dynamo import DynamoRouter
from evolving_infra.routing.evolving import EvolvingRouter
from evolving_infra.routing.least_loaded import LeastLoadedRouter
from evolving_infra.timing.model import IterationModel

RouterFactory = Callable[[IterationModel, int, int], Router]

ROUTERS: dict[str, RouterFactory] = {
    "evolving": lambda model, bs, kvb: EvolvingRouter(model, block_size=bs, kv_bytes_per_token=kvb),
    "dynamo": lambda model, bs, kvb: DynamoRouter(block_size=bs),
    "least-loaded": lambda model, bs, kvb: LeastLoadedRouter(block_size=bs),
}

__all__ = [
    "ROUTERS",
    "DynamoRouter",
    "EvolvingRouter",
    "LeastLoadedRouter",
    "NoNodeError",
    "NodeLoad",
    "Placement",
    "RouteRequest",
    "Router",
    "RouterFactory",
]
