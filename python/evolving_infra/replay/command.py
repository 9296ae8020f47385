"""`evolving-infra replay`: closed-loop load on a live router from agent traces."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import structlog
from rich.console import Console
from rich.live import Live
from rich.table import Table

from evolving_infra.argtypes import positive_float, positive_int, positive_seconds
from evolving_infra.errors import CommandError, one_line
from evolving_infra.replay.client import RouterInfo, probe
from evolving_infra.replay.runner import Progress, Replayer, ReplaySettings, scale_time
from evolving_infra.replay.summary import Summary
from evolving_infra.workloads.generators.common import SlotPlan
from evolving_infra.workloads.model import Trace
from evolving_infra.workloads.sampling import load_pool, sample_agents
from evolving_infra.workloads.stats import percentile

log = structlog.get_logger(__name__)

NAME = "replay"
HELP = "closed-loop load on a live router from agent traces, with the branch headers"
DESCRIPTION = """\
Replays N concurrent agents drawn from traces against a running router: every request is sent
when the trace's closed loop says (its wait after the previous response, its joins, its
branch's spawn), as /v1/completions of token ids with the agent branch headers
(X-Agent-Branch, X-Agent-Parent-Branch, X-Agent-Event: fork|compaction|end).

Sessions are drawn as `trace sample` draws them: --agents slots of back-to-back sessions (with
replacement, each copy in its own block namespace) for --duration seconds of nominal time, after
dividing every wait by --speed. At --duration seconds of wall time no more requests are sent;
those in flight get --drain-timeout seconds to finish.

Prompts: each trace block becomes block_size token ids drawn from its block hash (printable
bytes, so the router's byte tokenizer and the simulated engines take them as they are): equal
prefixes give equal tokens, so the engines' KV cache hits what the trace shares. --page-size
must be the router's (checked against its /health); a trace block of 64 tokens is 4 pages of 16.

Output: live progress on a terminal; at the end a summary (--json: one JSON object on stdout
with completed, failed, lost, unissued, requests_per_s, output_tokens_per_s, hit_rate and
ideal_hit_rate (h and h* as the simulator defines them, in trace blocks, over the completed
requests), lost_kv_reuse (1 - h/h*), hit_rate_all (cached / prompt tokens as the engines report),
p50/p95/p99_ttft_s, mean_e2e_s, errors by reason; see evolving_infra.replay.summary).
Exit status 0 when at least one request completed and none was lost, else 1; 2 for bad input
or a router that cannot be used.

example:
  evolving-infra replay data/traces/claude-code --agents 8 --duration 60 --speed 10 --json"""

DEFAULT_ROUTER = "http://127.0.0.1:8000"
DEFAULT_MODEL = "default"  # what is sent when the router lists no model names
PROBE_TIMEOUT_S = 10.0  # the router's /health and /v1/models before the run


class RouterUnusableError(CommandError):
    """The router cannot be reached, is not healthy, or disagrees with the options."""


def router_url(text: str) -> str:
    """`--router`: an http(s) URL with a host, without a trailing slash."""
    url = urlsplit(text)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise argparse.ArgumentTypeError(
            f"expected an http:// URL such as {DEFAULT_ROUTER}, got {text!r}"
        )
    try:
        url.port  # noqa: B018 (a bad port raises here)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port in {text!r}") from None
    return text.rstrip("/")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "paths",
        type=Path,
        nargs="+",
        metavar="TRACE",
        help="trace files or folders (our format, raw Claude Code, Mooncake), as `trace sample`",
    )
    a(
        "--router",
        type=router_url,
        default=DEFAULT_ROUTER,
        metavar="URL",
        help=f"the router's base URL (default: {DEFAULT_ROUTER})",
    )
    a(
        "--agents",
        type=positive_int,
        default=1,
        metavar="N",
        help="concurrent agent slots (default: 1)",
    )
    a(
        "--duration",
        type=positive_seconds,
        default=60.0,
        metavar="S",
        help="seconds of sessions drawn, and of wall time before no more requests are sent"
        " (default: 60)",
    )
    a("--seed", type=int, default=0, metavar="K", help="seed of the sessions drawn (default: 0)")
    a(
        "--page-size",
        type=positive_int,
        default=16,
        metavar="TOKENS",
        help="the router's tokens per KV page; must equal the router's (default: 16)",
    )
    a(
        "--speed",
        type=positive_float,
        default=1.0,
        metavar="X",
        help="divide every trace wait and spawn delay by X: think time compressed (default: 1)",
    )
    a(
        "--drain-timeout",
        type=positive_seconds,
        default=60.0,
        metavar="S",
        help="seconds the requests in flight at the end get before they are cancelled as failed"
        " (default: 60)",
    )
    a(
        "--max-inflight",
        type=positive_int,
        default=256,
        metavar="N",
        help="at most N requests in flight, a safety cap over the closed loop (default: 256)",
    )
    a(
        "--request-timeout",
        type=positive_seconds,
        default=600.0,
        metavar="S",
        help="seconds one request may take before it fails as `timeout` (default: 600)",
    )
    a(
        "--model",
        default=None,
        metavar="NAME",
        help=f"model name sent (default: the router's first listed model, else {DEFAULT_MODEL!r})",
    )
    a(
        "--run-id",
        default=None,
        metavar="ID",
        help="prefix of branch ids and salt of the prompt tokens; the same id and seed send the"
        " same tokens (default: random, so a run never hits the KV of an earlier one)",
    )
    a("--json", action="store_true", help="print the summary as one JSON object on stdout")


def draw(paths: list[Path], agents: int, duration: float, seed: int, speed: float) -> Trace:
    """The sessions of a run: waits scaled first, so that slots fill `duration` at that pace."""
    pool = scale_time(load_pool(paths), speed)
    return sample_agents(pool, SlotPlan(agents=agents, duration=duration, seed=seed))


def run(args: argparse.Namespace) -> int:
    trace = draw(args.paths, args.agents, args.duration, args.seed, args.speed)
    if trace.block_size % args.page_size:
        log.warning(
            "trace blocks are not whole pages: a page across two blocks hits only if both do",
            block_size=trace.block_size,
            page_size=args.page_size,
        )
    router = args.router.rstrip("/")
    summary = asyncio.run(_run(trace, router, args))
    if args.json:
        sys.stdout.write(json.dumps(summary.to_dict()) + "\n")
    else:
        _render(summary, Console())
    return 0 if summary.completed and not summary.lost else 1


async def _probe(session: aiohttp.ClientSession, router: str) -> RouterInfo:
    """The router's `probe`, or `RouterUnusableError` saying why it cannot be used."""
    fix = "start it (evolving-infra cluster up) or give its address with --router"
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            return await probe(session, router)
    except TimeoutError:
        raise RouterUnusableError(
            f"{router}: no answer from the router within {PROBE_TIMEOUT_S:g} s", fix
        ) from None
    except aiohttp.ClientConnectorError as e:
        reason = (e.strerror or str(e)).lower()
        raise RouterUnusableError(f"{router}: cannot connect ({reason})", fix) from None
    except (aiohttp.ClientError, ValueError, AttributeError) as e:
        said = e.message if isinstance(e, aiohttp.ClientResponseError) else str(e)
        reason = one_line(said)[:200].rstrip(":") or type(e).__name__
        raise RouterUnusableError(
            f"{router}: not an evolving-infra router ({reason})", "check --router"
        ) from None


async def _run(trace: Trace, router: str, args: argparse.Namespace) -> Summary:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    # limit=0: the replay's own cap holds requests back, a second cap in the pool would only
    # add unmeasured queueing.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        info = await _probe(session, router)
        if info.page_size is not None and info.page_size != args.page_size:
            raise RouterUnusableError(
                f"--page-size {args.page_size} is not the router's page size {info.page_size}",
                f"run with --page-size {info.page_size}",
            )
        if not info.healthy:
            raise RouterUnusableError(
                f"{router}/health is not ok", "wait until its engines are up, then run again"
            )
        settings = ReplaySettings(
            router=router,
            model=args.model or (info.models[0] if info.models else DEFAULT_MODEL),
            duration=args.duration,
            drain_timeout=args.drain_timeout,
            max_inflight=args.max_inflight,
            request_timeout=args.request_timeout,
            run_id=args.run_id or secrets.token_hex(3),
        )
        replayer = Replayer(trace, settings, session)
        log.info(
            "replay starting",
            router=router,
            agents=args.agents,
            sessions=len(trace.agents),
            requests=trace.request_count,
            run_id=settings.run_id,
        )
        console = Console()
        show = console.is_terminal and not args.json
        async with _live(replayer.progress, args.duration, console, show):
            return await replayer.run()


@contextlib.asynccontextmanager
async def _live(
    progress: Progress, duration: float, console: Console, show: bool
) -> AsyncIterator[None]:
    """A live status line on a terminal, refreshed twice a second; nothing otherwise."""
    if not show:
        yield
        return
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with Live(_status(progress, 0.0, duration), console=console, transient=True) as live:

        async def refresh() -> None:
            while True:
                await asyncio.sleep(0.5)
                live.update(_status(progress, loop.time() - t0, duration))

        task = asyncio.create_task(refresh())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _status(p: Progress, elapsed: float, duration: float) -> Table:
    ttft = sorted(p.recent_ttft)
    table = Table.grid(padding=(0, 2))
    table.add_row(
        f"[bold]{elapsed:5.0f}/{duration:.0f} s[/]",
        f"done {p.completed:,}",
        f"[red]failed {p.failed:,}[/]" if p.failed else "failed 0",
        f"in flight {p.in_flight}",
        f"held {p.held}" if p.held else "",
        f"TTFT p50 {_s(percentile(ttft, 50))} p95 {_s(percentile(ttft, 95))}",
        f"hit {p.hit_rate:.1%}" if p.hit_rate is not None else "hit -",
    )
    return table


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


def _render(summary: Summary, console: Console) -> None:
    table = Table(title="Replay summary", show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in summary.to_dict().items():
        table.add_row(key, _value(value))
    console.print(table)


def _value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) or "none"
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"{value:,}" if isinstance(value, int) else str(value)
