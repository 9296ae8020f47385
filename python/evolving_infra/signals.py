"""Stopping a long-running command (router, front, engines) on Ctrl-C and on a supervisor's
SIGTERM, from its event loop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable


def on_stop_signals(handler: Callable[[], None]) -> None:
    """`handler()` on each SIGINT and SIGTERM, where the running loop can take signals (not on
    Windows' default loop)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, handler)
