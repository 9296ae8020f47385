"""A cached prefix another node holds is pulled to the chosen prefill engine before its prefill
(`router/kvpull.py`, issue 27): which node it comes from, that the dispatcher pulls before it
sends the prefill and counts the pulled prefix as cached, that it pulls only when that pays,
and a real pull between two live engines over EngineControl that the next prefill hits. Also
the dispatcher's other continuation across engines: a broken decode stream's migration, on the
same stub legs."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog

from evolving_infra import KvDirectory, block_hashes
from evolving_infra.control.client import EngineClient
from evolving_infra.router import api
from evolving_infra.router.dispatcher import BrokenStreamError, Finished, PreparedRequest, TextPiece
from evolving_infra.router.kvpull import ControlPuller, Pull, PullCost, best_source
from evolving_infra.router.loads import EngineHandle
from evolving_infra.router.pd import PdDispatcher
from evolving_infra.router.registry import EngineRegistry
from evolving_infra.routing.evolving import EvolvingRouter
from evolving_infra.timing.model import IterationModel
from evolving_infra.types import Phase
from router_helpers import PAGE, Legs


def test_best_source_is_the_longest_prefix_elsewhere() -> None:
    d = KvDirectory()
    h = list(range(1, 11))
    d.store(0, "L1", h[:3])  # the chosen node holds 3
    d.store(1, "L1", h[:6])
    d.store(2, "L1", h[:4])
    d.store(2, "L2", h[4:9], parent=h[3])  # node 2: 4 in GPU memory, 9 with its host memory
    m = d.match(h)
    assert best_source(m, 0, 3) == Pull(2, "L2", 9)
    assert best_source(m, 2, 9) is None  # nobody holds more than node 2 itself
    assert best_source(m, 0, 9) is None
    d.store(1, "L1", h[6:10], parent=h[5])
    assert best_source(d.match(h), 0, 3) == Pull(1, "L1", 10)  # all of it in GPU memory


class _Recorder:
    def __init__(self, cost: float | None = None) -> None:
        self.pulls: list[tuple[int, Pull, int]] = []
        self.order: list[str] = []
        self.cost = cost
        self.skips = 0

    def cost_s(self, blocks: int) -> float | None:
        return self.cost

    def skipped(self) -> None:
        self.skips += 1

    async def pull(self, dest: int, pull: Pull, hashes: Sequence[int]) -> int:
        self.order.append("pull")
        self.pulls.append((dest, pull, len(hashes)))
        return pull.blocks


def _dispatcher(directory: KvDirectory, puller: _Recorder | None, legs: Legs) -> PdDispatcher:
    phases: tuple[Phase, ...] = ("prefill", "prefill", "decode")
    engines = [
        EngineHandle(n, f"http://127.0.0.1:{9000 + n}", phase, "127.0.0.1", 9000 + n, 1 << 16)
        for n, phase in enumerate(phases)
    ]
    model = IterationModel()
    router = EvolvingRouter(model, block_size=PAGE, kv_bytes_per_token=1024)
    return PdDispatcher(
        EngineRegistry(engines), directory, router, model, page_size=PAGE, transport=legs,
        puller=puller, admission=False,
    )  # fmt: skip


def _request(ids: list[int]) -> PreparedRequest:
    return PreparedRequest(
        request_id="r", kind="completion", model="m", token_ids=tuple(ids),
        block_hashes=tuple(block_hashes(ids, PAGE)), page_size=PAGE, branch=0,
        branch_info=None, sampling=api.SamplingParams(max_tokens=4), stream=True, arrival=0.0,
    )  # fmt: skip


def test_the_dispatcher_pulls_the_prefix_before_it_sends_the_prefill() -> None:
    ids = list(range(256)) * 8  # 2,048 tokens
    req = _request(ids)
    n = len(req.block_hashes)
    directory = KvDirectory()
    directory.store(2, "L1", list(req.block_hashes[: n - 4]))  # the decode node holds it
    recorder = _Recorder()

    async def prefill(engine: Any, body: bytes) -> None:
        recorder.order.append(f"prefill on {engine.node}")

    async def decode(engine: Any, body: bytes) -> Any:
        yield Finished("stop", completion_tokens=1, cached_tokens=0)

    dispatcher = _dispatcher(directory, recorder, Legs(prefill, decode))
    place = dispatcher._place(req, set())
    assert place.pull == Pull(2, "L1", n - 4)
    assert place.uncached == len(ids) - (n - 4) * PAGE  # the pulled prefix counts as cached

    async def run() -> None:
        async for _ in dispatcher.generate(req):
            pass
        structlog.get_logger().info("request")  # as the front end logs it, in the same task

    with structlog.testing.capture_logs([structlog.contextvars.merge_contextvars]) as logs:
        asyncio.run(run())
    assert recorder.pulls == [(place.prefill.node, Pull(2, "L1", n - 4), n)]
    assert recorder.order == ["pull", f"prefill on {place.prefill.node}"]
    # The request's log line says where it went and what it cost.
    [line] = logs
    assert line["prefill"] == place.prefill.node
    assert line["decode"] == 2
    assert line["prompt_tokens"] == len(ids)
    assert line["uncached"] == place.uncached
    assert line["pulled"] is True
    assert line["cached_tokens"] == 0  # what the decode side reported the prefill found
    assert line["held_s"] == 0.0
    assert line["predicted_ttft_s"] > 0
    assert line["ttft_s"] >= 0
    # Without a puller (--no-kv-pull) nothing moves and the prefill counts only its own.
    bare = _dispatcher(directory, None, Legs())._place(req, set())
    assert bare.pull is None
    assert bare.uncached == len(ids)


def test_a_pull_that_costs_more_than_it_saves_is_not_asked_for() -> None:
    """The decode node holds the prompt's prefix; a pull of it is asked for only while its
    predicted seconds are under the prefill seconds it saves."""
    ids = list(range(256)) * 8  # 2,048 tokens
    req = _request(ids)
    n = len(req.block_hashes)
    directory = KvDirectory()
    directory.store(2, "L1", list(req.block_hashes[: n - 4]))
    model = IterationModel()
    saved = model.predict_prefill_one(len(ids), 0) - model.predict_prefill_one(64, len(ids) - 64)
    assert saved > 0
    cheap, dear = _Recorder(cost=saved / 2), _Recorder(cost=saved * 2)
    assert _dispatcher(directory, cheap, Legs())._place(req, set()).pull == Pull(2, "L1", n - 4)
    place = _dispatcher(directory, dear, Legs())._place(req, set())
    assert place.pull is None
    assert place.uncached == len(ids)  # computed whole, as without a puller
    assert (cheap.skips, dear.skips) == (0, 1)


def test_the_pull_cost_is_fitted_to_the_pulls_seen() -> None:
    cost = PullCost()
    for blocks in (10, 20, 40, 80):
        cost.add(blocks, 0.015 + blocks * 0.001)
    assert cost.predict(50) is None  # too few pulls yet
    cost.add(160, 0.015 + 160 * 0.001)
    assert cost.predict(0) == pytest.approx(0.015)
    assert cost.predict(100) == pytest.approx(0.115)
    # Pulls of one size: the mean, whatever the size asked.
    same = PullCost()
    for _ in range(6):
        same.add(8, 0.02)
    assert same.predict(1000) == pytest.approx(0.02)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        answer: dict[str, Any] = json.loads(r.read())
        return answer


def test_a_pull_between_two_live_engines_is_hit_by_the_next_prefill(tmp_path: Path) -> None:
    """Two simulated engines (real processes, EngineControl over gRPC): engine 0 prefills a
    prompt; engine 1 pulls it from engine 0's GPU memory through `ControlPuller`; engine 1's
    own prefill of the prompt and more then finds it cached."""
    from cluster_helpers import start_cluster

    cluster = start_cluster(tmp_path, engines=3, prefill=2)
    try:
        page = 16  # `cluster up`'s
        ids = [33 + (i * 7) % 90 for i in range(64 * page)]
        hashes = block_hashes(ids, page)
        first = _post(f"{cluster.engine_urls[0]}/generate",
                      {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
        assert first["meta_info"]["cached_tokens"] == 0

        async def pull() -> tuple[int, dict[str, int]]:
            async with EngineClient(cluster.control[1]) as client:
                puller = ControlPuller({1: client})
                moved = await puller.pull(1, Pull(0, "L1", len(hashes)), hashes)
                return moved, puller.counts

        moved, counts = asyncio.run(pull())
        assert moved == len(hashes)
        assert counts == {"ok": 1, "failed": 0, "skipped": 0, "blocks": len(hashes)}
        more = ids + [40] * (4 * page)
        second = _post(f"{cluster.engine_urls[1]}/generate",
                       {"input_ids": more, "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
        assert second["meta_info"]["cached_tokens"] == len(ids)

        async def unknown_engine() -> tuple[int, dict[str, int]]:
            puller = ControlPuller({})
            return await puller.pull(1, Pull(0, "L1", 3), hashes), puller.counts

        assert asyncio.run(unknown_engine()) == (
            0,
            {"ok": 0, "failed": 1, "skipped": 0, "blocks": 0},
        )
    finally:
        cluster.stop()


def test_a_broken_decode_stream_goes_on_from_the_tokens_streamed() -> None:
    """Migration (`PdDispatcher.generate`): the first decode leg streams 3 tokens and breaks;
    the request goes on with those tokens appended to its prompt and the budget left (4 - 3),
    and the client sees one unbroken answer whose usage counts all 4 tokens. With the budget
    used up, the lost end is only the finish; past the limit, the break is the client's error."""
    ids = list(range(256)) * 2
    req = _request(ids)  # max_tokens 4
    bodies: list[dict[str, Any]] = []

    async def decode(engine: Any, body: bytes) -> Any:
        bodies.append(json.loads(body))
        if len(bodies) == 1:
            for t in "abc":
                yield TextPiece(t)
            raise BrokenStreamError("engine 2 broke the stream", node=2, output_ids=(7, 8, 9))
        yield TextPiece("d")
        yield Finished("length", completion_tokens=1, cached_tokens=len(ids) + 3)

    dispatcher = _dispatcher(KvDirectory(), None, Legs(decode=decode))

    async def run(d: PdDispatcher, r: PreparedRequest) -> list[Any]:
        return [e async for e in d.generate(r)]

    events = asyncio.run(run(dispatcher, req))
    assert "".join(e.text for e in events if isinstance(e, TextPiece)) == "abcd"
    assert events[-1] == Finished("length", completion_tokens=4, cached_tokens=len(ids))
    first, second = bodies
    assert second["input_ids"] == [*first["input_ids"], 7, 8, 9]
    assert second["sampling_params"]["max_new_tokens"] == 1
    assert second["rid"] != first["rid"]

    async def all_streamed(engine: Any, body: bytes) -> Any:
        yield TextPiece("abcd", tokens=4)
        raise BrokenStreamError("broke", node=2, output_ids=(1, 2, 3, 4))

    done = asyncio.run(run(_dispatcher(KvDirectory(), None, Legs(decode=all_streamed)), req))
    assert done[-1] == Finished("length", completion_tokens=4, cached_tokens=None)
    limited = _dispatcher(KvDirectory(), None, Legs(decode=decode))
    limited.migration_limit = 0
    bodies.clear()
    with pytest.raises(BrokenStreamError):
        asyncio.run(run(limited, req))
