"""`evolving-infra engine --backend sglang`: a patched SGLang 0.5.23 server and its sidecar.

`serve` starts SGLang in a child process (`launcher.SglangProcess`) with the user's SGLang flags
(after `--`) plus the ones the control plane needs (`flags.sglang_flags`: PD mode with role
switch, bootstrap port, KV events, forward-pass metrics, page size, priority eviction, HiCache
on the Mooncake pool) and `--host/--port`; waits for SGLang's `/health`; then serves
EngineControl for it (`sidecar.SglangSidecar`) until Ctrl-C/SIGTERM, which stops SGLang's whole
process group. If SGLang exits by itself, the command exits with 1 and SGLang's last lines.
SGLang not installed (or another version) and a port given that is taken are found before
anything starts: one line, status 2 (`require_sglang`, `check_ports`).

The `engine` subcommand's parser lives in `engines/sim/command.py`; this module adds the
options only this backend takes (`add_arguments`) and runs it (`run`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import math
import os
import socket
import sys
import tempfile
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import structlog
import zmq

from evolving_infra.argtypes import secret
from evolving_infra.control.server import CONTROL_API_KEY_ENV
from evolving_infra.control.server import serve as serve_control
from evolving_infra.engines.sglang.launcher import SERVER_COMMAND, SglangProcess, SglangStartError
from evolving_infra.engines.sglang.server_info import WILDCARD_HOSTS, bracket
from evolving_infra.engines.sglang.sidecar import SglangSidecar, SidecarConfig
from evolving_infra.engines.sglang.streams import HINTS_ENDPOINT_ENV
from evolving_infra.errors import CommandError
from evolving_infra.ports import check_listen, free_ports
from evolving_infra.signals import on_stop_signals

log = structlog.get_logger("evolving_infra.engines.sglang")

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's own default
DEFAULT_DRAIN_TIMEOUT_S = 300.0
DEFAULT_START_TIMEOUT_S = 1800.0  # loading a 70B model from a cold disk takes minutes
DEFAULT_STOP_TIMEOUT_S = 30.0
# Options of this backend only; `None` means not given (the sim backend rejects given ones).
OPTIONS = (
    "bootstrap_port",
    "advertise_host",
    "drain_timeout",
    "decode_graph_memory_gb",
    "start_timeout",
    "stop_timeout",
)


class UsageError(ValueError):
    """SGLang flags that clash with the ones evolving-infra sets; the message names them."""


class SglangMissingError(CommandError):
    """SGLang is not installed, or not the version the backend's patch is written for."""


def require_sglang() -> None:
    """Raises `SglangMissingError` unless SGLang `SGLANG_VERSION` is installed: checked here,
    before the child that imports it starts (the parent never imports SGLang)."""
    from evolving_infra.engines.sglang.patch import SGLANG_VERSION

    install = (
        f"pip install 'evolving-infra[sglang]' && pip install --no-deps sglang=={SGLANG_VERSION}"
        " (on a GPU node: pip install 'evolving-infra[sglang-gpu]')"
    )
    try:
        found = importlib.metadata.version("sglang") if importlib.util.find_spec("sglang") else None
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found is None:
        raise SglangMissingError(f"--backend sglang needs SGLang {SGLANG_VERSION}", install)
    if found != SGLANG_VERSION:
        raise SglangMissingError(
            f"--backend sglang needs SGLang {SGLANG_VERSION}, not the {found} installed",
            f"pip install sglang=={SGLANG_VERSION}",
        )


def check_ports(args: argparse.Namespace) -> None:
    """Every port this node listens on that was given (and SGLang's bootstrap port, which always
    is) must be free before SGLang starts: SGLang would find out only after loading the model."""
    host = "" if _wildcard(args.host) else args.host
    check_listen(host, args.port, "--port")
    check_listen(host, args.grpc_port, "--grpc-port")
    check_listen(host, args.bootstrap_port or DEFAULT_BOOTSTRAP_PORT, "--bootstrap-port")
    for flag in ("--kv-events-port", "--kv-replay-port", "--samples-port"):
        number = getattr(args, flag[2:].replace("-", "_"))
        if number:
            check_listen(host, number, flag)


def _port(text: str) -> int:
    value = int(text) if text.strip().lstrip("+-").isdigit() else -1
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"expected a port in 1..65535, got {text!r}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan  # rejected by the range checks below


def _seconds(text: str) -> float:
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def _gigabytes(text: str) -> float:
    value = _number(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number of GB >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `--backend sglang` only, and SGLang's own flags after `--`."""
    g = parser.add_argument_group("--backend sglang only")
    a = g.add_argument
    a("--bootstrap-port", type=_port, default=None,
      help="SGLang's PD bootstrap server port, where decode engines fetch this node's KV"
      f" (default: {DEFAULT_BOOTSTRAP_PORT})")  # fmt: skip
    a("--advertise-host", default=None,
      help="host the router reaches this node at (default: --host, or this machine's name"
      " when --host is 0.0.0.0/::)")  # fmt: skip
    a("--drain-timeout", type=_seconds, default=None,
      help="seconds a phase switch waits for running requests when the caller gives no"
      f" timeout (default: {DEFAULT_DRAIN_TIMEOUT_S:g})")  # fmt: skip
    a("--decode-graph-memory-gb", type=_gigabytes, default=None,
      help="GPU memory SGLang must find free before capturing decode CUDA graphs on a switch"
      " to decode (a decode peer's figure; default: 0, no check)")  # fmt: skip
    a(
        "--start-timeout",
        type=_seconds,
        default=None,
        help=f"seconds to wait for SGLang's /health (default: {DEFAULT_START_TIMEOUT_S:g})",
    )
    a("--stop-timeout", type=_seconds, default=None,
      help="seconds between SIGTERM and SIGKILL to SGLang's process group"
      f" (default: {DEFAULT_STOP_TIMEOUT_S:g})")  # fmt: skip
    parser.add_argument("sglang_args", nargs="*", metavar="-- SGLANG_ARG",
                        help="SGLang's own flags after --, e.g. --model-path M --tp 4")  # fmt: skip


def option_names(argv: Sequence[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def _wildcard(host: str) -> bool:
    return host in WILDCARD_HOSTS


def sglang_argv(
    args: argparse.Namespace, *, port: int, kv_port: int, replay_port: int, fpm_endpoint: str
) -> list[str]:
    """The child's SGLang flags: the user's, then ours. Raises `UsageError` on a clash."""
    # part A's module builds SGLang's flags; imported here so --help needs nothing of SGLang.
    from evolving_infra.engines.sglang.flags import sglang_flags

    zmq_host = "*" if _wildcard(args.host) else bracket(args.host)
    ours = [
        *sglang_flags(
            phase=args.phase,
            bootstrap_port=args.bootstrap_port or DEFAULT_BOOTSTRAP_PORT,
            kv_events_endpoint=f"tcp://{zmq_host}:{kv_port}",
            kv_replay_endpoint=f"tcp://{zmq_host}:{replay_port}",
            fpm_endpoint=fpm_endpoint,
            page_size=args.page_size,
            hicache_mooncake=args.pool_master is not None,
        ),
        "--host",
        args.host,
        "--port",
        str(port),
    ]
    user = list(args.sglang_args)
    if user[:1] == ["--"]:
        user = user[1:]
    clash = sorted(option_names(user) & option_names(ours))
    if clash:
        raise UsageError(
            f"{', '.join(clash)} after --: evolving-infra sets these SGLang flags itself (use"
            " its own options: --host, --port, --phase, --bootstrap-port, --page-size, ...)"
        )
    return [*user, *ours]


async def serve(
    args: argparse.Namespace,
    *,
    server_command: Sequence[str] = SERVER_COMMAND,
    stop: asyncio.Event | None = None,
) -> int:
    """Runs SGLang and its sidecar until `stop` is set (Ctrl-C/SIGTERM when None) or SGLang
    exits. `server_command` is the child's program (a stand-in in tests)."""
    if stop is None:
        stop = asyncio.Event()
        on_stop_signals(stop.set)
    with tempfile.TemporaryDirectory(prefix="evolving-infra-sglang-") as tmp:
        return await _serve(args, Path(tmp), server_command, stop)


def _fail(message: str, code: int = 2) -> int:
    print(f"evolving-infra engine: error: {message}", file=sys.stderr)
    return code


async def _serve(
    args: argparse.Namespace, tmp: Path, server_command: Sequence[str], stop: asyncio.Event
) -> int:
    check_ports(args)
    host = args.host
    local = "127.0.0.1" if _wildcard(host) else host
    advertise = args.advertise_host or (socket.getfqdn() if _wildcard(host) else host)
    # Ports not given are picked together, apart from each other and from those given (the
    # control's `--grpc-port` too: it binds after SGLang has bound what is picked here).
    given = [args.port, args.kv_events_port, args.kv_replay_port]
    taken = {p for p in (*given, args.grpc_port) if p}
    spare = [p for p in free_ports(3 + len(taken), host) if p not in taken]
    port, kv_port, replay_port = (p or spare.pop() for p in given)
    hints, fpm = f"ipc://{tmp / 'hints'}", f"ipc://{tmp / 'fpm'}"
    try:
        argv = sglang_argv(
            args, port=port, kv_port=kv_port, replay_port=replay_port, fpm_endpoint=fpm
        )
    except UsageError as e:
        return _fail(str(e))
    env = {**os.environ, HINTS_ENDPOINT_ENV: hints}
    if args.pool_master is not None:  # SGLang's Mooncake store reads its master from here too
        env["MOONCAKE_MASTER"] = args.pool_master.rpc
    proc = SglangProcess(argv, env=env, command=server_command)
    await proc.start()
    url = f"http://{bracket(local)}:{port}"
    timeout = args.start_timeout or DEFAULT_START_TIMEOUT_S
    try:
        if not await _until(proc.wait_healthy(url, timeout), stop):
            await proc.stop(args.stop_timeout or DEFAULT_STOP_TIMEOUT_S)
            return 0
    except SglangStartError as e:
        await proc.stop(args.stop_timeout or DEFAULT_STOP_TIMEOUT_S)
        return _fail(str(e), 1)
    zmq_host = "*" if _wildcard(host) else bracket(host)
    config = SidecarConfig(
        node_id=args.node_id,
        sglang_url=url,
        advertise_host=advertise,
        phase=args.phase,
        hints_endpoint=hints,
        samples_relay=f"tcp://{zmq_host}:{args.samples_port or '*'}",
        drain_timeout_s=args.drain_timeout or DEFAULT_DRAIN_TIMEOUT_S,
        decode_graph_memory_gb=args.decode_graph_memory_gb or 0.0,
    )
    sidecar = SglangSidecar(config)
    try:
        await sidecar.start()
        key = secret(args.control_api_key, CONTROL_API_KEY_ENV)
        grpc_server, grpc_port = await serve_control(sidecar, host, args.grpc_port, key)
    except (OSError, zmq.ZMQError) as e:
        await sidecar.close()
        await proc.stop(args.stop_timeout or DEFAULT_STOP_TIMEOUT_S)
        return _fail(f"cannot listen: {e}")
    log.info("engine_serving", backend="sglang", node=args.node_id, phase=args.phase, host=host,
             port=port, grpc_port=grpc_port, advertise=advertise, sglang_pid=proc.pid,
             samples=sidecar.samples_relay_endpoint)  # fmt: skip
    exited = await _until(proc.wait(), stop)
    log.info("engine_stopping", node=args.node_id, sglang_exited=exited)
    await grpc_server.stop(1.0)
    await sidecar.close()
    if exited:
        return _fail(proc.exit_message(proc.returncode or 0), 1)
    await proc.stop(args.stop_timeout or DEFAULT_STOP_TIMEOUT_S)
    return 0


async def _until(work: Coroutine[Any, Any, object], stop: asyncio.Event) -> bool:
    """True once `work` is done (its exception raised here), False when `stop` is set first
    (`work` is then cancelled)."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in (task, stopping):
            if not waiting.done():
                waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
    if task.cancelled():
        return False
    task.result()
    return True


def run(args: argparse.Namespace) -> int:
    """The command (logging is configured by the `engine` command that dispatches here)."""
    require_sglang()
    return asyncio.run(serve(args))
