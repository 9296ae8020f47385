"""Router overhead against context length, with and without the turn cache (issue 29).

Agents talk to the real router front end (`build_app`, aiohttp on loopback) over the real PD
dispatch core (`PdDispatcher`, the evolving router, a `KvDirectory`) whose two engine legs answer
at once. Each agent first sends a context of about `--contexts` tokens, then `--turns` turns,
each adding an assistant reply and a user message (~`--added` tokens), as a coding agent does.
Overhead is the router's own figure (`evolving_router_overhead_seconds`: arrival to leaving for
the engines: parsing, tokenizing, hashing, the branch update, the match and the routing
decision), read per request through the dispatcher's observer; the first turn of each agent
(cold: nothing kept) is left out. Each context runs with the turn cache (the default) and
without it (`--turn-cache-mib 0`), side by side in one run, in `--rounds` rounds that each go
through every context (a 2-core VM's speed drifts by ~20% over minutes; interleaving puts the
drift into every column alike). Each context size is measured alone, on a router of its own:
one serving long and short contexts at once ran the short ones ~2x slower here (its caches
shared with the long ones' bytes), which flatters the ratio of long to short. The agents run on
the router's event loop (`--client inline`, the default) or in a process of their own
(`--client process`: the body then streams in while the router reads it, and that wait counts
as overhead, as it does in the router's metric).

Tokenizers: `bpe`, a byte-level BPE of 32k tokens trained here on the project's own sources and
docs (~3.6 characters a token; a real model's vocabulary is larger, and tokenizes ~1.5-2x
slower, so the figures without the cache are lower than with one), and `bytes`, the router's
fallback (one token per byte). Run: `.venv/bin/python benches/router_overhead.py`. Nothing is
asserted: it prints figures (and `--json FILE` writes them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import socket
import statistics
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from evolving_infra import KvDirectory, logs, malloc
from evolving_infra.planner.slices import Slices
from evolving_infra.router.app import build_app
from evolving_infra.router.branches import BranchTracker
from evolving_infra.router.dispatcher import Finished, TextPiece
from evolving_infra.router.loads import EngineHandle
from evolving_infra.router.metrics import RouterMetrics
from evolving_infra.router.observer import Observers, PlannerFeed
from evolving_infra.router.pd import PdDispatcher
from evolving_infra.router.registry import EngineRegistry
from evolving_infra.router.tokenize import ByteTokenizer, HfTokenizer, Tokenizer
from evolving_infra.router.transport import Body
from evolving_infra.routing.evolving import EvolvingRouter
from evolving_infra.timing.model import IterationModel

PAGE = 16
ROOT = Path(__file__).resolve().parent.parent


class Legs:
    """The engines' two legs, answering at once."""

    async def prefill(self, engine: EngineHandle, body: Body) -> None:
        return None

    async def decode(self, engine: EngineHandle, body: Body) -> AsyncGenerator[Any, None]:
        yield TextPiece("ok", 1)
        yield Finished("stop", 1, 0)


class Overheads(Observers):
    """Keeps every request's overhead, in seconds."""

    def __init__(self, *observers: Any) -> None:
        super().__init__(*observers)
        self.seen: list[float] = []

    def dispatched(self, overhead_s: float) -> None:
        self.seen.append(overhead_s)
        super().dispatched(overhead_s)


def corpus() -> str:
    files = sorted((ROOT / "python").rglob("*.py")) + sorted((ROOT / "docs").glob("*.md"))
    return "".join(f.read_text() for f in files)


def train_bpe(text: str) -> Tokenizer:
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = Raw(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=32000, initial_alphabet=alphabet, show_progress=False)
    raw.train_from_iterator([text], trainer)
    return HfTokenizer(raw, "bpe-32k")


class Text:
    """Pieces of the corpus, `tokens` long as `tokenizer` counts, from random places. The
    contexts and the turns' additions are drawn from two generators, so that every context size
    gets the same additions (what a turn adds is tokenized; its text sets that cost)."""

    def __init__(
        self, text: str, tokenizer: Tokenizer, seed: int, args: argparse.Namespace
    ) -> None:
        self.text = text
        self.tokenizer = tokenizer
        self.args = args
        sample = text[:200_000]
        self.chars_per_token = len(sample) / len(tokenizer.encode(sample))
        self.contexts = random.Random(f"{seed}/contexts")
        self.added = random.Random(f"{seed}/added")

    def take(self, tokens: int, rng: random.Random) -> str:
        n = int(tokens * self.chars_per_token)
        start = rng.randrange(0, max(len(self.text) - n, 1))
        return self.text[start : start + n]


async def agent(
    session: aiohttp.ClientSession, url: str, name: str, text: Text, context: int, turns: int
) -> None:
    """One agent's first turn and `turns` more, each adding ~`added` tokens."""
    args = text.args
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": text.take(context, text.contexts)},
    ]
    ids = text.tokenizer.encode(messages[1]["content"])
    headers = {"X-Agent-Branch": name}
    for _ in range(turns + 1):
        if args.api == "chat":
            body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 1}
            resp = await session.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        else:  # token ids, as the replayer sends them
            body = {"model": "m", "prompt": ids, "max_tokens": 1}
            resp = await session.post(f"{url}/v1/completions", json=body, headers=headers)
        assert resp.status == 200, await resp.text()
        await resp.read()
        reply = text.take(args.added // 5, text.added)
        user = text.take(args.added - args.added // 5, text.added)
        messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": user})
        ids = [*ids, *text.tokenizer.encode(reply), *text.tokenizer.encode(user)]


async def agents(url: str, text: Text, context: int) -> None:
    """Every agent of a context, one after another."""
    async with aiohttp.ClientSession() as session:
        for a in range(text.args.agents):
            await agent(session, url, f"a{a}", text, context, text.args.turns)


def client_process(url: str, text: Text, context: int) -> None:
    asyncio.run(agents(url, text, context))


def router_app(tokenizer: Tokenizer, seen: Overheads, cache_mib: int) -> web.Application:
    """The router's front end and PD core, its engine legs answering at once."""
    engines = [
        EngineHandle(0, "http://127.0.0.1:9000", "prefill", "127.0.0.1", 9000, 10**7),
        EngineHandle(1, "http://127.0.0.1:9001", "decode", "127.0.0.1", 9001, 10**7),
    ]
    model = IterationModel()
    directory = KvDirectory()
    dispatcher = PdDispatcher(
        EngineRegistry(engines),
        directory,
        EvolvingRouter(model, block_size=PAGE, kv_bytes_per_token=1024),
        model,
        page_size=PAGE,
        transport=Legs(),
        observer=seen,
    )
    return build_app(
        dispatcher,
        BranchTracker(directory),
        tokenizer,
        RouterMetrics(),
        page_size=PAGE,
        max_body_bytes=256 * 2**20,
        turn_cache_bytes=cache_mib << 20,
    )


def measure(tokenizer: Tokenizer, text: Text, context: int, cache_mib: int) -> list[float]:
    """The warm turns' overheads, in seconds, of `--agents` agents of `context` tokens on a
    router of their own; the agents on its event loop or in a process of their own
    (`--client`)."""
    seen = Overheads(PlannerFeed(Slices(600.0, block_tokens=PAGE)))  # as `LivePlanner` keeps it
    app = router_app(tokenizer, seen, cache_mib)
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    client = None
    if text.args.client == "process":  # forked before the router's event loop runs
        client = multiprocessing.get_context("fork").Process(
            target=client_process, args=(url, text, context)
        )
        client.start()

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        try:
            if client is None:
                await agents(url, text, context)
            else:
                await asyncio.get_running_loop().run_in_executor(None, client.join)
                assert client.exitcode == 0, f"the agents' process failed ({client.exitcode})"
        finally:
            await runner.cleanup()

    asyncio.run(serve())
    # Agents take turns one request at a time: each agent's first (cold) turn is left out.
    per = text.args.turns + 1
    assert len(seen.seen) == per * text.args.agents, "a request was not dispatched"
    return [x for i, x in enumerate(seen.seen) if i % per]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="1000,10000,50000,100000",
                   help="first-turn context sizes, tokens (default: %(default)s)")  # fmt: skip
    p.add_argument("--turns", type=int, default=10, help="warm turns per agent (default: 10)")
    p.add_argument("--added", type=int, default=600, help="tokens a turn adds (default: 600)")
    p.add_argument("--agents", type=int, default=3, help="agents per context (default: 3)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the contexts (default: 3)")
    p.add_argument("--tokenizer", choices=("bpe", "bytes"), default="bpe")
    p.add_argument("--api", choices=("chat", "completions"), default="chat",
                   help="chat messages (as harnesses send), or completions of token ids (as"
                   " the replayer sends): default %(default)s")  # fmt: skip
    p.add_argument("--cache-only", action="store_true",
                   help="leave out the runs without the turn cache (the slow ones)")  # fmt: skip
    p.add_argument("--client", choices=("inline", "process"), default="inline",
                   help="the agents on the router's event loop (default: their JSON encoding"
                   " runs between the router's requests and leaves its caches cold), or in a"
                   " process of their own (the body then streams in while the router reads it,"
                   " and the read counts that time)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    logs.configure(level="warning")  # the router logs a line per request
    # The agents' process is forked from this one: Hugging Face tokenizers' threads must not
    # have started before (it would turn them off, with a warning, in the child).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The allocator as `evolving-infra router` sets it (`EVOLVING_INFRA_MALLOC=default`: glibc's
    # own): its fixed mmap threshold maps every buffer over 128 KiB afresh, so a 100k-token
    # turn's body as received (~0.5 MB) faults its pages in again each request.
    tuned = malloc.tune()
    text = corpus()
    tokenizer = train_bpe(text) if args.tokenizer == "bpe" else ByteTokenizer()
    # A busy router's BPE word cache is full (Hugging Face `tokenizers` keeps the first 10,000
    # words it meets and no more), so fill it first: else the contexts measured before the
    # first long one find the turns' words cached and the others do not (~2x per word).
    tokenizer.encode(text[:1_000_000])
    contexts = [int(c) for c in args.contexts.split(",")]
    seen: dict[tuple[int, str], list[float]] = {}
    for r in range(args.rounds):
        for context in contexts:
            for label, mib in (("cache", 512), ("no_cache", 0))[: 1 if args.cache_only else 2]:
                text_at = Text(text, tokenizer, args.seed + r, args)
                got = measure(tokenizer, text_at, context, mib)
                seen.setdefault((context, label), []).extend(x * 1e3 for x in got)
    rows = []
    print(f"tokenizer {tokenizer.name}, {args.api}, malloc {'router' if tuned else 'default'};"
          " overhead per warm turn, ms (P50 / P95)")  # fmt: skip
    print(f"{'context':>8} | {'turn cache':>17} | {'no turn cache':>17} | P50 ratio")
    for context in contexts:
        figures = {}
        for label in ("cache", "no_cache"):
            ms = sorted(seen.get((context, label), [float("nan")]))
            figures[label] = {
                "p50_ms": statistics.median(ms),
                "p95_ms": ms[int(0.95 * (len(ms) - 1))],
                "n": len(ms),
            }
        c, n = figures["cache"], figures["no_cache"]
        ratio = n["p50_ms"] / c["p50_ms"]
        print(f"{context:>8} | {c['p50_ms']:7.2f} / {c['p95_ms']:7.2f} | "
              f"{n['p50_ms']:7.2f} / {n['p95_ms']:7.2f} | {ratio:.1f}x")  # fmt: skip
        rows.append({"context_tokens": context, **figures})
    base = seen[contexts[0], "cache"]
    for context in contexts[1:]:
        grown = statistics.median(seen[context, "cache"]) / statistics.median(base)
        print(f"turn cache: P50 at {context} tokens / at {contexts[0]}: {grown:.2f}x")
    if args.json is not None:
        out = {"tokenizer": tokenizer.name, "api": args.api, "malloc_tuned": tuned, "rows": rows}
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
