"""`evolving-infra router`: the router daemon in the foreground (see `daemon.py`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

import structlog

from evolving_infra import malloc
from evolving_infra.router import config
from evolving_infra.router.app import configure_json_logging
from evolving_infra.router.daemon import RouterDaemon, RouterStartError
from evolving_infra.soak import memtrace

NAME = "router"
HELP = config.HELP
DESCRIPTION = config.DESCRIPTION


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config.add_arguments(parser)


async def serve(cfg: config.RouterConfig) -> int:
    daemon = RouterDaemon(cfg)
    memtrace.watch(daemon.memory_stats)
    try:
        await daemon.start()
    except (RouterStartError, OSError) as e:
        await daemon.stop()
        print(f"evolving-infra router: error: {e}", file=sys.stderr)
        return 2
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, lambda: loop.create_task(daemon.stop()))
    await daemon.wait()
    structlog.get_logger("evolving_infra.router").info("router_stopped", **_counts(daemon))
    return 0


def _counts(daemon: RouterDaemon) -> dict[str, object]:
    status = daemon.status()
    return {k: str(v) for k, v in status.items()}


def run(args: argparse.Namespace) -> int:
    cfg = config.RouterConfig.from_args(args)
    configure_json_logging(cfg.log_level)
    malloc.tune()
    memtrace.install("router")  # opt-in: EVOLVING_INFRA_MEMTRACE
    return asyncio.run(serve(cfg))
