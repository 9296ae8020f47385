"""Hops of one request through the live router's dispatch core (issue 26's figure).

From `PdDispatcher.generate` to its last event, with the engines' two legs stubbed (a transport
that answers at once): the Python calls that cross from one `evolving_infra` module to another
(by module pair), the modules touched and the calls into the Rust extension. Run:
`.venv/bin/python benches/request_hops.py`. Nothing is asserted: it prints figures.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from collections.abc import AsyncGenerator
from types import FrameType
from typing import Any

from evolving_infra import KvDirectory, block_hashes
from evolving_infra.planner.slices import Slices
from evolving_infra.router import api
from evolving_infra.router.dispatcher import Finished, PreparedRequest, TextPiece
from evolving_infra.router.loads import EngineHandle
from evolving_infra.router.observer import PlannerFeed
from evolving_infra.router.pd import PdDispatcher
from evolving_infra.router.registry import EngineRegistry
from evolving_infra.router.transport import Body
from evolving_infra.routing.evolving import EvolvingRouter
from evolving_infra.timing.model import IterationModel

PAGE = 16
engines = [
    EngineHandle(0, "http://127.0.0.1:9000", "prefill", "127.0.0.1", 9000, 4096),
    EngineHandle(1, "http://127.0.0.1:9001", "decode", "127.0.0.1", 9001, 4096),
]
model = IterationModel()
router = EvolvingRouter(model, block_size=PAGE, kv_bytes_per_token=1024)
directory = KvDirectory()
ids = list(range(1000))
hashes = tuple(block_hashes(ids, PAGE))
directory.store(0, "L1", list(hashes[:20]))
req = PreparedRequest(
    request_id="r",
    kind="completion",
    model="m",
    token_ids=tuple(ids),
    block_hashes=hashes,
    page_size=PAGE,
    branch=0,
    branch_info=None,
    sampling=api.SamplingParams(max_tokens=8),
    stream=True,
    arrival=0.0,
)


class Legs:
    """The engines' legs, answering at once."""

    async def prefill(self, engine: EngineHandle, body: Body) -> None:
        return None

    async def decode(self, engine: EngineHandle, body: Body) -> AsyncGenerator[Any, None]:
        yield TextPiece("hi", 1)
        yield Finished("stop", 1, 320)


d = PdDispatcher(
    EngineRegistry(engines),
    directory,
    router,
    model,
    page_size=PAGE,
    transport=Legs(),
    observer=PlannerFeed(Slices(600.0)),
)


def mod_of(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", "?"))


crossings: Counter[tuple[str, str]] = Counter()
modules: set[str] = set()
rust: Counter[str] = Counter()


def prof(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call":
        callee = mod_of(frame)
        caller = mod_of(frame.f_back) if frame.f_back else "?"
        if callee.startswith("evolving_infra"):
            modules.add(callee)
            if caller != callee and caller.startswith("evolving_infra"):
                crossings[(caller, callee)] += 1
    elif event == "c_call":
        owner = getattr(arg, "__self__", None)
        m = type(owner).__module__ if owner is not None else getattr(arg, "__module__", "")
        if m and m.startswith("evolving_infra._core"):
            rust[f"{type(owner).__name__}.{arg.__name__}"] += 1
            modules.add("evolving_infra._core")


async def one() -> None:
    async for _ in d.generate(req):
        pass


async def main() -> None:
    await one()  # warm (imports, predictor caches)
    sys.setprofile(prof)
    await one()
    sys.setprofile(None)


asyncio.run(main())
print(
    "cross-module Python calls:",
    sum(crossings.values()),
    "distinct module pairs:",
    len(crossings),
    "evolving_infra modules touched:",
    len(modules),
    "calls into Rust:",
    sum(rust.values()),
)
for (a, b), n in sorted(crossings.items()):
    print(f"  {n:3d} {a} -> {b}")
print("  rust:", dict(rust))
