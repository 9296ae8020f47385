"""`evolving-infra router`: the router daemon in the foreground (see `daemon.py`).

A port taken, a tokenizer that cannot be read and engines that cannot be used are errors of one
line, status 2, found before the daemon serves (the port before anything else).
"""

from __future__ import annotations

import argparse
import asyncio

import structlog

from evolving_infra import malloc, memtrace
from evolving_infra.ports import check_listen, listen_error
from evolving_infra.router import config
from evolving_infra.router.app import configure_json_logging
from evolving_infra.router.daemon import RouterDaemon
from evolving_infra.signals import on_stop_signals

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
    except OSError as e:  # the port, taken since `run` checked it (cli.main reports the rest)
        await daemon.stop()
        raise listen_error(e, cfg.host, cfg.port, "--port") from None
    except BaseException:
        await daemon.stop()
        raise
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def on_signal() -> None:
        # The first signal drains (requests in flight finish); a second cuts them now.
        if stopping:
            daemon.cut()
        else:
            stopping.append(loop.create_task(daemon.stop()))

    on_stop_signals(on_signal)
    await daemon.wait()
    structlog.get_logger("evolving_infra.router").info("router_stopped", **_counts(daemon))
    return 0


def _counts(daemon: RouterDaemon) -> dict[str, object]:
    status = daemon.status()
    return {k: str(v) for k, v in status.items()}


def run(args: argparse.Namespace) -> int:
    cfg = config.RouterConfig.from_args(args)
    if len(cfg.engines) < 2:  # the planner splits them into prefill and decode
        raise config.RouterConfigError(
            "engines: the router needs at least two, a prefill and a decode engine; got one:"
            " give another with --engines"
        )
    check_listen(cfg.host, cfg.port, "--port")
    configure_json_logging(cfg.log_level)
    malloc.tune()
    memtrace.install("router")  # opt-in: EVOLVING_INFRA_MEMTRACE
    return asyncio.run(serve(cfg))
