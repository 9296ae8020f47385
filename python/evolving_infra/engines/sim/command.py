"""`evolving-infra engine --backend sim`: one simulated engine node on HTTP (and gRPC control)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from dataclasses import replace

import structlog
import zmq
from aiohttp import web

from evolving_infra import logs
from evolving_infra.argtypes import natural_int, positive_float, positive_int
from evolving_infra.control.server import serve as serve_control
from evolving_infra.engines.events import KvEventPublisher
from evolving_infra.engines.pool import DEFAULT_SCALE, MasterAddress, PoolError
from evolving_infra.engines.samples import ForwardPassMetricsPublisher
from evolving_infra.engines.sim.core import EngineSettings
from evolving_infra.engines.sim.http import build_app
from evolving_infra.engines.sim.pool import parse_master, pool_config
from evolving_infra.engines.sim.publish import ZmqKvSink
from evolving_infra.engines.sim.service import SimEngine
from evolving_infra.timing.specs import GPUS, MODELS, Deployment

NAME = "engine"
HELP = "run one engine node (simulated: --backend sim)"
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
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--backend", choices=["sim"], default="sim", help="engine backend (default: sim)")
    a("--node-id", type=int, default=0, help="this node's id in the cluster (default: 0)")
    a("--phase", choices=["prefill", "decode"], default="prefill", help="initial phase")
    a("--host", default="127.0.0.1", help="HTTP address to listen on (default: 127.0.0.1)")
    a("--port", type=int, default=30000, help="HTTP port (0: any free port; default: 30000)")
    a("--grpc-port", type=natural_int, default=0,
      help="EngineControl gRPC port, what the router's --engines names (0: any free port,"
      " logged at start; default: 0)")  # fmt: skip
    a("--kv-events-port", type=natural_int, default=0,
      help="ZMQ port of the KV events, in SGLang's wire format (0: any free port)")  # fmt: skip
    a("--kv-replay-port", type=natural_int, default=0,
      help="ZMQ port of the KV-event replay service (0: any free port; default: 0)")  # fmt: skip
    a("--samples-port", type=natural_int, default=0,
      help="ZMQ port of the forward-pass metrics (0: any free port; default: 0)")  # fmt: skip
    a("--model", choices=sorted(MODELS), default="llama-3-70b", help="model (default: %(default)s)")
    a("--gpu", choices=sorted(GPUS), default="h100-sxm", help="GPU kind (default: %(default)s)")
    a("--tp", type=positive_int, default=4, help="tensor-parallel GPUs per node (default: 4)")
    a("--page-size", type=positive_int, default=16, help="tokens per KV page (default: 16)")
    a("--time-scale", type=positive_float, default=1.0,
      help="simulated seconds per real second (default: 1; e.g. 50 for tests)")  # fmt: skip
    a("--seed", type=int, default=0, help="seed of timing noise and outputs (default: 0)")
    a("--noise", type=float, default=0.02, help="lognormal sigma of iteration times")
    a("--l1-blocks", type=positive_int, default=None,
      help="GPU KV capacity in pages (default: HBM left after weights)")  # fmt: skip
    a("--l2-blocks", type=natural_int, default=None,
      help="host KV capacity in pages (default: 1 TiB per 8 GPUs, pro rata; 0: none)")  # fmt: skip
    a("--kv-bandwidth", type=positive_float, default=None,
      help="P->D KV transfer bytes/s (default: 25 GB/s per GPU x tp)")  # fmt: skip
    a("--switch-seconds", type=float, default=6.2,
      help="simulated seconds of an in-place phase switch once drained (default: 6.2)")  # fmt: skip
    a("--chunk-tokens", type=positive_int, default=8192, help="chunked prefill budget")
    a("--max-requests", type=positive_int, default=1024,
      help="requests in the engine at once; more get HTTP 503 (default: 1024)")  # fmt: skip
    a("--no-prefetch", action="store_true", help="do not fetch L2 blocks while queued")
    a("--kv-hold-seconds", type=positive_float, default=60.0,
      help="real seconds a prefill's KV waits for its decode engine (default: 60)")  # fmt: skip
    a("--pool-master", type=master_address, default=None, metavar="HOST:PORT",
      help="mooncake_master RPC address of the shared L2 pool (default: no pool)")  # fmt: skip
    a("--pool-scale", type=positive_int, default=DEFAULT_SCALE,
      help="pool payload = real block bytes / this (default: %(default)s)")  # fmt: skip


def master_address(text: str) -> MasterAddress:
    try:
        return parse_master(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def settings_from(args: argparse.Namespace, url: str = "") -> EngineSettings:
    deployment = Deployment(MODELS[args.model], GPUS[args.gpu], args.tp)
    return EngineSettings(
        node_id=args.node_id,
        phase=args.phase,
        deployment=deployment,
        page_size=args.page_size,
        time_scale=args.time_scale,
        seed=args.seed,
        noise=args.noise,
        l1_blocks=args.l1_blocks,
        l2_blocks=args.l2_blocks,
        chunk_tokens=args.chunk_tokens,
        kv_bandwidth=args.kv_bandwidth,
        switch_seconds=args.switch_seconds,
        prefetch=not args.no_prefetch,
        max_requests=args.max_requests,
        kv_hold_real_s=args.kv_hold_seconds,
        http_url=url,
        pool=None
        if args.pool_master is None
        else pool_config(args.pool_master, deployment.model, args.page_size, args.pool_scale),
    )


async def serve(args: argparse.Namespace) -> int:
    log = structlog.get_logger("evolving_infra.engines.sim")
    host = f"[{args.host}]" if ":" in args.host else args.host
    # KV events and pass metrics on ZMQ, as SGLang publishes them (ports 0: any free port; the
    # bound endpoints are what GetInfo reports).
    zmq_host = "127.0.0.1" if args.host in ("", "0.0.0.0", "::") else host
    try:
        kv_pub = KvEventPublisher(
            f"tcp://{zmq_host}:{args.kv_events_port or '*'}",
            f"tcp://{zmq_host}:{args.kv_replay_port or '*'}",
            bind=True,
        )
        fpm = ForwardPassMetricsPublisher(f"tcp://{zmq_host}:{args.samples_port or '*'}")
    except zmq.ZMQError as e:
        print(f"evolving-infra engine: error: cannot bind ZMQ endpoints: {e}", file=sys.stderr)
        return 2
    settings = replace(
        settings_from(args, f"http://{host}:{args.port}"),
        kv_events_endpoint=kv_pub.endpoint,
        kv_replay_endpoint=kv_pub.replay_endpoint or "",
        samples_endpoint=fpm.endpoint,
    )
    sink = ZmqKvSink(kv_pub, args.page_size)
    engine = SimEngine(settings, kv_sink=sink, sample_sink=fpm)
    # A (re)started engine holds nothing: say so first, as SGLang's cache reset does, so that a
    # router that knew a previous incarnation forgets it.
    sink.all_blocks_cleared()
    try:
        await engine.start()
    except PoolError as e:  # a pool named at start that cannot be joined: say so, do not serve
        await engine.close()
        kv_pub.close()
        fpm.close()
        print(f"evolving-infra engine: error: cannot join the pool: {e}", file=sys.stderr)
        return 2
    runner = web.AppRunner(build_app(engine), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    grpc_server = None
    grpc_port = None
    try:
        await site.start()
        grpc_server, grpc_port = await serve_control(engine, args.host, args.grpc_port)
    except OSError as e:
        await runner.cleanup()
        await engine.close()
        kv_pub.close()
        fpm.close()
        print(f"evolving-infra engine: error: cannot listen: {e}", file=sys.stderr)
        return 2
    port = runner.addresses[0][1] if runner.addresses else args.port
    engine.settings = replace(engine.settings, http_url=f"http://{host}:{port}")
    log.info("engine_serving", node=args.node_id, phase=args.phase, host=args.host, port=port,
             grpc_port=grpc_port, kv_events=kv_pub.endpoint, samples=fpm.endpoint,
             l1_blocks=engine.kv.l1_capacity, l2_blocks=engine.kv.l2_capacity)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("engine_stopping", node=args.node_id, running=engine.active)
    await grpc_server.stop(1.0)
    await engine.close()
    await runner.cleanup()
    sink.flush()
    kv_pub.close()
    fpm.close()
    return 0


def run(args: argparse.Namespace) -> int:
    logs.configure(json=True)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    return asyncio.run(serve(args))
