"""`evolving-infra front`: the front of router replicas in the foreground (see `front.py`)."""

from __future__ import annotations

import argparse
import asyncio

import redis.asyncio as aredis
import structlog

from evolving_infra.argtypes import port, positive_int, positive_seconds
from evolving_infra.errors import CommandError
from evolving_infra.ports import check_listen, listen_error
from evolving_infra.router.app import configure_json_logging
from evolving_infra.router.config import (
    DEFAULT_MAX_BODY_MIB,
    DEFAULT_SHUTDOWN_TIMEOUT,
    LOG_LEVELS,
    redis_url,
)
from evolving_infra.router.front import Front, build_front
from evolving_infra.router.server import serve
from evolving_infra.signals import on_stop_signals

NAME = "front"
HELP = "one address in front of router replicas: each agent tree on one replica"
DESCRIPTION = (
    "One address in front of router replicas."
    + """

Passes every request on to one of the router replicas (--routers), the one rendezvous hashing
ranks first for the request's root branch (forks follow their parent) among those whose /health
answers; requests without a branch go to the replica with the fewest in flight. A replica that
cannot be reached is skipped for the next; none: 503 with Retry-After. With --coordination
(the replicas' Redis) the forks' roots are shared there, so that a restarted front, or a second
one, sends a child to its tree's replica too. Its own /health and /metrics (evolving_front_*).

example:
  evolving-infra front --port 8000 --routers http://127.0.0.1:8001 http://127.0.0.1:8002
"""
)


def router_url(text: str) -> str:
    """http://host:port of a router replica."""
    scheme, sep, rest = text.partition("://")
    if scheme not in ("http", "https") or not sep or not rest.strip("/"):
        raise argparse.ArgumentTypeError(f"a router replica is http://host:port, got {text!r}")
    return text.rstrip("/")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--routers", nargs="+", type=router_url, required=True, metavar="URL",
      help="the router replicas, http://host:port each")  # fmt: skip
    a("--coordination", metavar="URL", type=redis_url,
      help="the router replicas' Redis (redis://host:port/db): each fork's root is kept"
      " there too, for a restarted front or another (default: this front's memory)")  # fmt: skip
    a("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    a("--port", type=port, default=8000, help="port (0: any free port; default: 8000)")
    a("--max-body-mib", type=positive_int, default=DEFAULT_MAX_BODY_MIB,
      help=f"largest request body in MiB (default: {DEFAULT_MAX_BODY_MIB})")  # fmt: skip
    a("--shutdown-timeout", type=positive_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT,
      help="seconds the requests in flight get to finish on Ctrl-C"
      f" (default: {DEFAULT_SHUTDOWN_TIMEOUT:g})")  # fmt: skip
    a("--log-level", choices=LOG_LEVELS, default="info", help="least level logged (default: info)")


async def serve_front(args: argparse.Namespace) -> int:
    client = None if args.coordination is None else aredis.from_url(args.coordination)
    front = Front(args.routers, coordination=client)
    app = build_front(front, max_body_bytes=args.max_body_mib * 2**20)
    try:
        serving = await serve(app, args.host, args.port)
    except OSError as e:
        raise listen_error(e, args.host, args.port, "--port") from None
    log = structlog.get_logger("evolving_infra.front")
    log.info("front_serving", host=args.host, port=args.port, routers=args.routers)
    stop = asyncio.Event()
    on_stop_signals(stop.set)
    await stop.wait()
    await serving.stop(args.shutdown_timeout)
    if client is not None:
        await client.aclose()
    log.info("front_stopped")
    return 0


def run(args: argparse.Namespace) -> int:
    if len(set(args.routers)) != len(args.routers):
        raise CommandError(
            f"--routers: each replica once, got {' '.join(args.routers)}",
            "name each router replica's address once",
        )
    check_listen(args.host, args.port, "--port")
    configure_json_logging(args.log_level)
    return asyncio.run(serve_front(args))
