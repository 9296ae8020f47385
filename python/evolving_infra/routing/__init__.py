"""Routing policies: which node prefills and which decodes a request (pure decisions)."""

from evolving_infra.routing.base import NodeLoad, Router, RouteRequest

__all__ = ["NodeLoad", "RouteRequest", "Router"]
