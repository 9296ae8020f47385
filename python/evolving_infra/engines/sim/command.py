"""`evolving-infra engine`: one engine node, simulated (`--backend sim`, here) or a patched SGLang
0.5.23 with its sidecar (`--backend sglang`, `engines/sglang/command.py`).

The parser holds both backends' options. An option of one backend given to the other is an
error, not silently ignored: such options default to None here (their real defaults are applied
by the backend that takes them: `SIM_DEFAULTS`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from dataclasses import replace
from typing import Any

import structlog
import zmq
from aiohttp import web

from evolving_infra import logs, malloc, memtrace
from evolving_infra.argtypes import (
    natural_int,
    natural_seconds,
    port,
    positive_float,
    positive_int,
    secret,
)
from evolving_infra.control.server import CONTROL_API_KEY_ENV
from evolving_infra.control.server import serve as serve_control
from evolving_infra.engines.events import DEFAULT_REPLAY_BYTES, KvEventPublisher
from evolving_infra.engines.pool import (
    DEFAULT_SCALE,
    MasterAddress,
    MooncakeMissingError,
    PoolError,
    PoolUnavailableError,
)
from evolving_infra.engines.samples import ForwardPassMetricsPublisher
from evolving_infra.engines.sglang import command as sglang_command
from evolving_infra.engines.sim.core import EngineSettings
from evolving_infra.engines.sim.http import build_app
from evolving_infra.engines.sim.pool import parse_master, pool_config
from evolving_infra.engines.sim.publish import ZmqKvSink
from evolving_infra.engines.sim.service import SimEngine
from evolving_infra.errors import CommandError
from evolving_infra.ports import check_listen, listen_error
from evolving_infra.signals import on_stop_signals
from evolving_infra.timing.specs import GPUS, MODELS, Deployment

NAME = "engine"
HELP = "run one engine node (--backend sim: simulated; --backend sglang: SGLang 0.5.23 on GPUs)"
DESCRIPTION = """\
Run one engine node with SGLang 0.5.23's HTTP data API (/generate with the PD bootstrap fields,
/v1/chat/completions, /health, /server_info) and the EngineControl gRPC service.

--backend sim runs no model: iteration times come from a hidden roofline ground truth of
--model on --gpu x --tp (with noise), KV is real bookkeeping (L1/L2 capacities, radix-style
eviction, demotion to host memory), and a request returns exactly max_new_tokens
deterministic tokens. --time-scale N runs simulated time N times faster than the clock.

A prefill/decode pair: start one engine with --phase prefill and one with --phase decode, then
send the same /generate body with bootstrap_host/bootstrap_port (the prefill engine's HTTP
address) and bootstrap_room to both. Without bootstrap fields a prefill engine serves the
request alone (prefill, then decode).

--pool-master HOST:PORT joins the shared L2 pool of a running mooncake_master: the engine's L2
blocks are put there (payloads of the real block size / --pool-scale), and a prompt's blocks
that this node lacks are fetched from it when another engine put them (pool hits).

example:
  evolving-infra engine --backend sim --node-id 0 --phase prefill --port 30000

--backend sglang runs a real SGLang 0.5.23 server on this node's GPUs (sglang==0.5.23
installed), patched so that a phase switch keeps the KV cache (docs/sglang.md), with every
argument after -- passed to SGLang, and serves EngineControl for it by driving SGLang's own
endpoints. evolving-infra sets SGLang's --host/--port, PD mode with in-place role switch,
bootstrap port, KV events, forward-pass metrics, page size, priority eviction and (with
--pool-master) HiCache on the Mooncake pool: do not repeat those after --. Ctrl-C/SIGTERM stops
SGLang; if SGLang exits, so does the command (status 1, with SGLang's last lines).

example (a node with 4 GPUs, starting as prefill; the router runs elsewhere):
  evolving-infra engine --backend sglang --node-id 0 --phase prefill \\
      --host 0.0.0.0 --advertise-host 10.0.0.2 --port 30000 --grpc-port 50051 \\
      --bootstrap-port 8998 --pool-master 10.0.0.1:50051 \\
      -- --model-path meta-llama/Llama-3.1-70B-Instruct --tp 4
"""

# Options of the simulated engine only, with their defaults (None in the parser, see above).
SIM_DEFAULTS: dict[str, Any] = {
    "model": "llama-3-70b",
    "gpu": "h100-sxm",
    "tp": 4,
    "time_scale": 1.0,
    "seed": 0,
    "noise": 0.02,
    "l1_blocks": None,  # HBM left after weights
    "l2_blocks": None,  # 1 TiB per 8 GPUs, pro rata
    "kv_bandwidth": None,  # 25 GB/s per GPU x tp
    "switch_seconds": 6.2,
    "chunk_tokens": 8192,
    "max_requests": 1024,
    "no_prefetch": False,
    "kv_hold_seconds": 60.0,
    "pool_scale": DEFAULT_SCALE,
    "kv_replay_mib": DEFAULT_REPLAY_BYTES / 2**20,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--backend", choices=["sim", "sglang"], default="sim",
      help="sim: the simulated engine; sglang: SGLang 0.5.23 and its sidecar"
      " (default: sim)")  # fmt: skip
    a("--node-id", type=natural_int, default=0,
      help="this node's id in the cluster (default: 0)")  # fmt: skip
    a("--phase", choices=["prefill", "decode"], default="prefill", help="initial phase")
    a("--host", default="127.0.0.1", help="HTTP address to listen on (default: 127.0.0.1)")
    a("--port", type=port, default=30000, help="HTTP port (0: any free port; default: 30000)")
    a("--grpc-port", type=port, default=0,
      help="EngineControl gRPC port, what the router's --engines names (0: any free port,"
      " logged at start; default: 0)")  # fmt: skip
    a("--control-api-key", metavar="KEY",
      help="require this key on every EngineControl call (the router's --control-api-key);"
      f" also from {CONTROL_API_KEY_ENV} (default: none)")  # fmt: skip
    a("--kv-events-port", type=port, default=0,
      help="ZMQ port of the KV events, in SGLang's wire format (0: any free port)")  # fmt: skip
    a("--kv-replay-port", type=port, default=0,
      help="ZMQ port of the KV-event replay service (0: any free port; default: 0)")  # fmt: skip
    a("--samples-port", type=port, default=0,
      help="ZMQ port of the forward-pass metrics (sglang: a relay of SGLang's; 0: any free"
      " port; default: 0)")  # fmt: skip
    a("--page-size", type=positive_int, default=16, help="tokens per KV page (default: 16)")
    a("--pool-master", type=master_address, default=None, metavar="HOST:PORT",
      help="mooncake_master RPC address of the shared L2 pool (sglang: HiCache's Mooncake"
      " store; default: no pool)")  # fmt: skip
    s = parser.add_argument_group("--backend sim only").add_argument
    d = SIM_DEFAULTS
    s("--model", choices=sorted(MODELS), default=None, help=f"model (default: {d['model']})")
    s("--gpu", choices=sorted(GPUS), default=None, help=f"GPU kind (default: {d['gpu']})")
    s("--tp", type=positive_int, default=None,
      help=f"tensor-parallel GPUs per node (default: {d['tp']})")  # fmt: skip
    s("--time-scale", type=positive_float, default=None,
      help="simulated seconds per real second (default: 1; e.g. 50 for tests)")  # fmt: skip
    s("--seed", type=int, default=None, help="seed of timing noise and outputs (default: 0)")
    s("--noise", type=float, default=None,
      help=f"lognormal sigma of iteration times (default: {d['noise']})")  # fmt: skip
    s("--l1-blocks", type=positive_int, default=None,
      help="GPU KV capacity in pages (default: HBM left after weights)")  # fmt: skip
    s("--l2-blocks", type=natural_int, default=None,
      help="host KV capacity in pages (default: 1 TiB per 8 GPUs, pro rata; 0: none)")  # fmt: skip
    s("--kv-bandwidth", type=positive_float, default=None,
      help="P->D KV transfer bytes/s (default: 25 GB/s per GPU x tp)")  # fmt: skip
    s("--switch-seconds", type=natural_seconds, default=None,
      help="simulated seconds of an in-place phase switch once drained (default: 6.2)")  # fmt: skip
    s("--chunk-tokens", type=positive_int, default=None,
      help=f"chunked prefill budget (default: {d['chunk_tokens']})")  # fmt: skip
    s("--max-requests", type=positive_int, default=None,
      help="requests in the engine at once; more get HTTP 503 (default: 1024)")  # fmt: skip
    s("--no-prefetch", action="store_true", default=None,
      help="do not fetch L2 blocks while queued")  # fmt: skip
    s("--kv-hold-seconds", type=positive_float, default=None,
      help="real seconds a prefill's KV waits for its decode engine (default: 60)")  # fmt: skip
    s("--kv-replay-mib", type=positive_float, default=None, metavar="MIB",
      help="KV-event batches kept for replay, at most this many MiB (and 10,000 batches, as"
      f" SGLang; default: {d['kv_replay_mib']:g})")  # fmt: skip
    s("--pool-scale", type=positive_int, default=None,
      help=f"pool payload = real block bytes / this (default: {d['pool_scale']})")  # fmt: skip
    sglang_command.add_arguments(parser)


def master_address(text: str) -> MasterAddress:
    try:
        return parse_master(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_ports(args: argparse.Namespace, zmq_host: str) -> None:
    """Every port given (not 0) must be free, before anything binds (`ports.check_listen`)."""
    check_listen(args.host, args.port, "--port")
    check_listen(args.host, args.grpc_port, "--grpc-port")
    for flag in ("--kv-events-port", "--kv-replay-port", "--samples-port"):
        number = getattr(args, flag[2:].replace("-", "_"))
        if number:
            check_listen(zmq_host, number, flag)


def check_deployment(settings: EngineSettings) -> None:
    """Raises `CommandError` when the deployment cannot run (the weights fill the GPUs)."""
    try:
        settings.hardware()
    except ValueError as e:
        d = settings.deployment
        raise CommandError(
            f"{e} ({d.model.name} on {d.tp} x {d.gpu.name})",
            "give more GPUs per engine with --tp, a smaller --model or another --gpu",
        ) from None


def misplaced_options(args: argparse.Namespace) -> list[str]:
    """The options given that the chosen backend does not take, as flags (`--time-scale`)."""
    other = sglang_command.OPTIONS if args.backend == "sim" else tuple(SIM_DEFAULTS)
    given = [f"--{name.replace('_', '-')}" for name in other if getattr(args, name) is not None]
    if args.backend == "sim" and args.sglang_args:
        given.append("SGLang flags after --")
    return given


def settings_from(args: argparse.Namespace, url: str = "") -> EngineSettings:
    v = {k: d if getattr(args, k) is None else getattr(args, k) for k, d in SIM_DEFAULTS.items()}
    deployment = Deployment(MODELS[v["model"]], GPUS[v["gpu"]], v["tp"])
    return EngineSettings(
        node_id=args.node_id,
        phase=args.phase,
        deployment=deployment,
        page_size=args.page_size,
        time_scale=v["time_scale"],
        seed=v["seed"],
        noise=v["noise"],
        l1_blocks=v["l1_blocks"],
        l2_blocks=v["l2_blocks"],
        chunk_tokens=v["chunk_tokens"],
        kv_bandwidth=v["kv_bandwidth"],
        switch_seconds=v["switch_seconds"],
        prefetch=not v["no_prefetch"],
        max_requests=v["max_requests"],
        kv_hold_real_s=v["kv_hold_seconds"],
        http_url=url,
        pool=None
        if args.pool_master is None
        else pool_config(args.pool_master, deployment.model, args.page_size, v["pool_scale"]),
    )


async def serve(args: argparse.Namespace) -> int:
    log = structlog.get_logger("evolving_infra.engines.sim")
    host = f"[{args.host}]" if ":" in args.host else args.host
    # KV events and pass metrics on ZMQ, as SGLang publishes them (ports 0: any free port; the
    # bound endpoints are what GetInfo reports).
    zmq_host = "127.0.0.1" if args.host in ("", "0.0.0.0", "::") else host
    check_deployment(settings_from(args))
    check_ports(args, zmq_host)
    try:
        kv_pub = KvEventPublisher(
            f"tcp://{zmq_host}:{args.kv_events_port or '*'}",
            f"tcp://{zmq_host}:{args.kv_replay_port or '*'}",
            bind=True,
            buffer_bytes=replay_bytes(args),
        )
        fpm = ForwardPassMetricsPublisher(f"tcp://{zmq_host}:{args.samples_port or '*'}")
    except zmq.ZMQError as e:
        raise CommandError(
            f"cannot bind the KV event and sample streams on {zmq_host}: {e}",
            "check --host and --kv-events-port, --kv-replay-port, --samples-port",
        ) from None
    settings = replace(
        settings_from(args, f"http://{host}:{args.port}"),
        kv_events_endpoint=kv_pub.endpoint,
        kv_replay_endpoint=kv_pub.replay_endpoint or "",
        samples_endpoint=fpm.endpoint,
    )
    sink = ZmqKvSink(kv_pub, args.page_size)
    engine = SimEngine(settings, kv_sink=sink, sample_sink=fpm)
    memtrace.watch(lambda: _memory_stats(engine, kv_pub))
    # A (re)started engine holds nothing: say so first, as SGLang's cache reset does, so that a
    # router that knew a previous incarnation forgets it.
    sink.all_blocks_cleared()
    try:
        await engine.start()
    except PoolError as e:  # a pool named at start that cannot be joined: say so, do not serve
        await engine.close()
        kv_pub.close()
        fpm.close()
        raise _pool_error(e, args.pool_master) from None
    runner = web.AppRunner(build_app(engine), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    grpc_server = None
    grpc_port = None
    try:
        try:
            await site.start()
        except OSError as e:  # taken since `check_ports` (a cluster's engines race for them)
            raise listen_error(e, args.host, args.port, "--port") from None
        try:
            grpc_server, grpc_port = await serve_control(
                engine, args.host, args.grpc_port, secret(args.control_api_key, CONTROL_API_KEY_ENV)
            )
        except OSError as e:
            raise listen_error(e, args.host, args.grpc_port, "--grpc-port") from None
    except CommandError:
        await runner.cleanup()
        await engine.close()
        kv_pub.close()
        fpm.close()
        raise
    port = runner.addresses[0][1] if runner.addresses else args.port
    engine.settings = replace(engine.settings, http_url=f"http://{host}:{port}")
    log.info("engine_serving", node=args.node_id, phase=args.phase, host=args.host, port=port,
             grpc_port=grpc_port, kv_events=kv_pub.endpoint, samples=fpm.endpoint,
             l1_blocks=engine.kv.l1_capacity, l2_blocks=engine.kv.l2_capacity)  # fmt: skip
    stop = asyncio.Event()
    on_stop_signals(stop.set)
    await stop.wait()
    # What the pool did over the engine's life, for whoever reads the log after a run.
    pool = dataclasses.asdict(engine.pool.counters) if engine.pool is not None else None
    log.info("engine_stopping", node=args.node_id, running=engine.active, pool=pool)
    await grpc_server.stop(1.0)
    await engine.close()
    await runner.cleanup()
    sink.flush()
    kv_pub.close()
    fpm.close()
    return 0


def _pool_error(e: PoolError, master: MasterAddress) -> CommandError:
    """The error line of a pool that cannot be joined at start (`--pool-master`)."""
    if isinstance(e, MooncakeMissingError):
        return e.otherwise("run without --pool-master")
    reason = e.reason if isinstance(e, PoolUnavailableError) else str(e)
    return CommandError(
        f"cannot join the pool at {master.rpc}: {reason}",
        "start its mooncake_master first, or check --pool-master",
    )


def replay_bytes(args: argparse.Namespace) -> int:
    mib = args.kv_replay_mib if args.kv_replay_mib is not None else SIM_DEFAULTS["kv_replay_mib"]
    return max(1, int(mib * 2**20))


def _memory_stats(engine: SimEngine, kv_pub: KvEventPublisher) -> dict[str, int]:
    batches, size = kv_pub.replay_buffer()
    return {**engine.memory_stats(), "replay_batches": batches, "replay_bytes": size}


def run(args: argparse.Namespace) -> int:
    misplaced = misplaced_options(args)
    if misplaced:
        other = "sglang" if args.backend == "sim" else "sim"
        raise CommandError(
            f"{', '.join(misplaced)}: only --backend {other} takes"
            f" {'it' if len(misplaced) == 1 else 'them'} (this is --backend {args.backend})",
            "leave out the options of the other backend",
        )
    logs.configure(json=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if args.backend == "sglang":
        return sglang_command.run(args)
    malloc.tune()
    memtrace.install(f"engine-{args.node_id}")  # opt-in: EVOLVING_INFRA_MEMTRACE
    return asyncio.run(serve(args))
