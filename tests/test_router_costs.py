"""The router's per-request costs, found by profiling the 200-agent soak (issue 8): each shortcut
gives exactly what the slow path gave, and the event loop stays free while a prompt is encoded.

Real parts throughout: the Rust `KvDirectory`, the `evolving` policy, the aiohttp front end on
loopback. The one stand-in is a tokenizer that holds its `encode` until the test lets it go (a
slow tokenizer on a huge prompt), so that "the loop was free meanwhile" is checked without timing.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import json
import random
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given
from hypothesis import strategies as st

from evolving_infra import KvDirectory, PagedPrompt
from evolving_infra._core import PrefixMatch
from evolving_infra.planner.slices import Slices
from evolving_infra.router import api, transport
from evolving_infra.router.daemon import SampleThinning
from evolving_infra.router.dispatcher import Finished, PreparedRequest, TextPiece
from evolving_infra.router.loads import EngineHandle
from evolving_infra.router.observer import PlannerFeed
from evolving_infra.router.pd import PdDispatcher
from evolving_infra.router.registry import EngineRegistry
from evolving_infra.router.transport import _without_output_ids
from evolving_infra.routing.evolving import EvolvingRouter
from evolving_infra.timing.model import IterationModel
from evolving_infra.types import Phase, token_ids_valid
from router_helpers import PAGE, Legs, Router, run_router

# -- the engine body's token ids ---------------------------------------------------------------


def ids_json(ids: Sequence[int]) -> bytes:
    return b"".join(transport.ids_json(ids))


@pytest.mark.parametrize(
    "ids",
    [[], [0], [255, 0, 17], list(range(300)), [2**17 - 1, 2**17, 2**32 - 1, 5]],
    ids=["empty", "zero", "bytes", "range", "large"],
)
def test_ids_json_is_the_json_array_of_the_ids(ids: list[int]) -> None:
    assert json.loads(ids_json(ids)) == ids
    assert ids_json(ids) == json.dumps(ids, separators=(",", ":")).encode()
    assert ids_json(tuple(ids)) == ids_json(ids)
    assert ids_json(collections.deque(ids)) == ids_json(ids)  # any sequence
    assert ids_json(PagedPrompt(ids, PAGE)) == ids_json(ids)  # a branch's kept prompt: its own
    assert PagedPrompt(ids, PAGE).json() == ids_json(ids)


def test_a_kept_prompts_json_is_lent_in_pieces() -> None:
    # 100k ids: the text is lent as read-only views of its chunks (~25 KB each), never copied
    # into a buffer the size of the prompt (`transport.Body`); they join into the array.
    ids = [(i * 7919) % 150_000 for i in range(100_000)]
    pieces = transport.ids_json(PagedPrompt(ids, PAGE))
    assert b"".join(pieces) == json.dumps(ids, separators=(",", ":")).encode()
    assert len(pieces) > 20
    assert max(len(p) for p in pieces) < 64 * 1024
    # A turn that extends it: the same pieces but for the last chunk's and what it adds.
    more = transport.ids_json(PagedPrompt.extend(PagedPrompt(ids, PAGE), 99_990, [1, 2, 3]))
    assert more[:-2] == pieces[:-2]
    assert more[-2] != pieces[-2]
    assert json.loads(b"".join(more)) == [*ids[:99_990], 1, 2, 3]
    # A view keeps its bytes alive after the prompt is gone, and cannot write them.
    view = pieces[1]
    assert isinstance(view, memoryview)
    assert view.readonly
    text = bytes(view)
    del pieces, more
    gc.collect()
    assert bytes(view) == text
    with pytest.raises(TypeError):
        view[0] = 0


@pytest.mark.parametrize("prompt", [False, True], ids=["list", "paged"])
def test_pd_bodies_share_the_ids_and_differ_in_stream(prompt: bool) -> None:
    ids = [3, 1, 4, 1, 5, 9, 2, 6] * 5
    seq: Sequence[int] = PagedPrompt(ids, PAGE) if prompt else ids
    req = PreparedRequest(
        request_id="r1", kind="completion", model="m", token_ids=seq, block_hashes=(),
        page_size=PAGE, branch=0, branch_info=None, sampling=api.SamplingParams(), stream=True,
        arrival=0.0,
    )  # fmt: skip
    engine = EngineHandle(0, "http://e", "prefill", "10.0.0.1", 8998, 100)
    to_prefill, to_decode = transport.pd_bodies(req, engine, 7, 1, 16)
    first, second = json.loads(bytes(to_prefill)), json.loads(bytes(to_decode))
    assert first["input_ids"] == second["input_ids"] == ids
    assert (first["stream"], second["stream"]) == (False, True)
    assert (first["rid"], first["bootstrap_room"]) == ("r1.1", 7)
    assert (first["bootstrap_host"], first["sampling_params"]) == (
        "10.0.0.1",
        {"max_new_tokens": 16},
    )
    assert len(to_prefill) == len(bytes(to_prefill))
    # The ids' text is made once, for both bodies.
    assert all(p is q for p, q in zip(to_prefill.pieces[:-1], to_decode.pieces[:-1], strict=True))
    assert b"".join(to_prefill.pieces[1:-1]) == json.dumps(ids, separators=(",", ":")).encode()


def test_http_transport_sends_a_body_of_views_with_its_length() -> None:
    # The prefill leg over real HTTP: the engine reads the exact bytes, with a Content-Length
    # (no chunked encoding: SGLang's server and ours both get a plain body).
    got: list[tuple[bytes, str | None, str | None]] = []

    async def generate(request: web.Request) -> web.Response:
        got.append(
            (
                await request.read(),
                request.headers.get("Content-Length"),
                request.headers.get("Transfer-Encoding"),
            )
        )
        return web.json_response({"text": ""})

    async def run() -> None:
        app = web.Application()
        app.router.add_post("/generate", generate)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            engine = EngineHandle(0, str(server.make_url("")).rstrip("/"), "prefill", "h", 1, 10)
            ids = [(i * 31) % 70_000 for i in range(9_000)]
            body = transport.Body(
                (b'{"input_ids": ', *transport.ids_json(PagedPrompt(ids, PAGE)), b"}")
            )
            await transport.HttpTransport(session).prefill(engine, body)
            assert got == [(bytes(body), str(len(body)), None)]
            assert json.loads(got[0][0]) == {"input_ids": ids}

    asyncio.run(run())


def test_ids_json_of_a_random_100k_token_prompt() -> None:
    rng = random.Random(8)
    ids = [rng.randrange(2**18) for _ in range(100_000)]
    assert json.loads(ids_json(ids)) == ids
    assert ids_json(PagedPrompt(ids, PAGE)) == ids_json(ids)


# -- stream chunks ------------------------------------------------------------------------------


def _chunk(text: str, n: int, done: bool = False) -> bytes:
    meta = {
        "id": "r",
        "completion_tokens": n,
        "finish_reason": {"type": "length"} if done else None,
    }
    body = {"text": text, "output_ids": list(range(n)), "meta_info": meta}
    return json.dumps(body, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    "data",
    [
        _chunk("hello", 3),
        _chunk('a "output_ids":[1,2] ] in the text', 40, done=True),
        _chunk("", 0),
        b'{"meta_info":{"completion_tokens":2},"output_ids":[7,8],"text":"ab"}',  # other order
        b'{"text":"x","output_ids": [1, 2],"meta_info":{}}',  # spaced: parsed whole
        b'{"error":{"message":"boom"}}',
    ],
)
def test_stream_chunks_parse_the_same_without_their_output_ids(data: bytes) -> None:
    whole, cut = json.loads(data), json.loads(_without_output_ids(data))
    assert {k: v for k, v in whole.items() if k != "output_ids"} == {
        k: v for k, v in cut.items() if k != "output_ids"
    }
    assert cut.get("output_ids") in (None, whole.get("output_ids"))


def test_a_long_cumulative_chunk_is_cut_before_parsing() -> None:
    data = _chunk("t" * 4000, 4000)
    cut = _without_output_ids(data)
    assert len(cut) < len(data) // 4
    assert json.loads(cut)["meta_info"]["completion_tokens"] == 4000


# -- token-id prompts ---------------------------------------------------------------------------


def test_token_id_prompts_are_checked_as_before() -> None:
    ok = api.parse_completion({"model": "m", "prompt": [0, 5, 2**32 - 1]})
    assert ok.prompt == (0, 5, 2**32 - 1)
    for bad in (True, 1.0, -1, 2**32, "7", None):
        with pytest.raises(api.ApiError, match=r"token ids must be integers in \[0, 2\^32\)") as e:
            api.parse_completion({"model": "m", "prompt": [1, 2, bad]})
        assert e.value.status == 400
        assert e.value.param == "prompt"
        assert repr(bad) in e.value.message


def _valid_reference(value: Sequence[object]) -> bool:
    return all(type(t) is int and 0 <= t < 2**32 for t in value)


class _Id(int):
    """An int subclass: not a token id (SGLang's check is on exact ints)."""


_items: st.SearchStrategy[object] = st.one_of(
    st.integers(0, 2**32 - 1),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.none(),
    st.builds(_Id, st.integers(0, 10)),
)


@given(st.data())
def test_token_ids_valid_agrees_with_its_definition(data: st.DataObject) -> None:
    # Mostly valid ids, and at times one bad item somewhere: the native check reads lists and
    # tuples in place, anything else item by item.
    ids: list[object] = list(
        data.draw(st.lists(st.integers(0, 2**32 - 1) | st.sampled_from([2**32, -1]), max_size=50))
    )
    spoil: bool = data.draw(st.booleans())
    if ids and spoil:
        ids[data.draw(st.integers(0, len(ids) - 1))] = data.draw(_items)
    want = _valid_reference(ids)
    assert token_ids_valid(ids) is want
    assert token_ids_valid(tuple(ids)) is want
    assert token_ids_valid(collections.deque(ids)) is want


def test_token_ids_valid_on_a_long_prompt_and_other_sequences() -> None:
    ids = list(range(0, 2**32, 2**32 // 100_000))
    assert token_ids_valid(ids)
    assert not token_ids_valid([*ids, 2**32])
    assert token_ids_valid(range(5))
    assert not token_ids_valid(range(-1, 5))
    assert token_ids_valid([])
    with pytest.raises(TypeError):
        token_ids_valid("123")


# -- one directory match per request -------------------------------------------------------------


class _CountingDirectory:
    """The real directory, counting `match` calls (the policy and the placement both read it)."""

    def __init__(self, directory: KvDirectory) -> None:
        self.directory, self.matches = directory, 0

    def match(self, hashes: Sequence[int]) -> PrefixMatch:
        self.matches += 1
        return self.directory.match(hashes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.directory, name)


def _dispatcher(directory: Any) -> PdDispatcher:
    phases: tuple[Phase, ...] = ("prefill", "prefill", "decode")
    engines = [
        EngineHandle(n, f"http://127.0.0.1:{9000 + n}", phase, "127.0.0.1", 9000 + n, 4096)
        for n, phase in enumerate(phases)
    ]
    model = IterationModel()
    router = EvolvingRouter(model, block_size=PAGE, kv_bytes_per_token=1024)
    registry = EngineRegistry(engines)
    return PdDispatcher(registry, directory, router, model, page_size=PAGE, transport=Legs())


def _request(ids: list[int]) -> PreparedRequest:
    from evolving_infra import block_hashes

    hashes = tuple(block_hashes(ids, PAGE))
    return PreparedRequest(
        request_id="r", kind="completion", model="m", token_ids=tuple(ids), block_hashes=hashes,
        page_size=PAGE, branch=0, branch_info=None, sampling=api.SamplingParams(max_tokens=8),
        stream=True, arrival=0.0,
    )  # fmt: skip


def test_a_request_is_matched_against_the_directory_once_and_placed_as_before() -> None:
    real = KvDirectory()
    ids = list(range(256)) * 16  # 4,096 tokens, 1,024 blocks
    req = _request(ids)
    real.store(1, "L1", list(req.block_hashes[:1000]))  # node 1 holds nearly all of it
    counting = _CountingDirectory(real)
    place = _dispatcher(cast(KvDirectory, counting))._place(req, set())
    assert counting.matches == 1
    # What the policy chooses reading the directory itself, and the same cached prefix.
    again = _dispatcher(real)._place(req, set())
    assert (place.prefill.node, place.decode.node) == (again.prefill.node, again.decode.node)
    assert (place.uncached, place.prefill_s) == (again.uncached, again.prefill_s)
    assert place.prefill.node == 1
    assert place.uncached == len(ids) - 1000 * PAGE


# -- samples ------------------------------------------------------------------------------------


def test_sample_thinning_keeps_a_slow_engine_and_caps_a_fast_one() -> None:
    thin = SampleThinning(per_s=64.0)  # binary fractions below: exact time arithmetic
    slow = [thin.admit(0, "decode", t / 32) for t in range(100)]  # 32 a second
    assert all(slow)
    fast = sum(thin.admit(1, "decode", 10.0 + t / 512) for t in range(1024))  # 512 a second
    assert fast == 128  # two seconds at 64 a second
    assert thin.admit(1, "prefill", 10.0)  # per phase
    assert thin.admit(2, "decode", 10.0)  # per engine


# -- the event loop while a prompt is encoded ------------------------------------------------------


class _HeldTokenizer:
    """Encodes as UTF-8 bytes once `go` is set (or after 20 s): a slow tokenizer on a long
    prompt. `started` is set when an encode begins."""

    name = "held"

    def __init__(self) -> None:
        self.started, self.go = threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        self.started.set()
        self.go.wait(20.0)
        return list(text.encode())


def test_the_event_loop_serves_other_requests_while_a_prompt_is_encoded() -> None:
    tokenizer = _HeldTokenizer()

    async def test(r: Router) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "x" * 100_000}]}
        chat = asyncio.create_task(r.client.post("/v1/chat/completions", json=body))
        assert await asyncio.to_thread(tokenizer.started.wait, 10.0)
        # Encoding is under way (and held): the loop still answers, well before the 20 s hold.
        health = await asyncio.wait_for(r.client.get("/health"), 5.0)
        assert health.status == 200
        assert not chat.done()
        tokenizer.go.set()
        resp = await asyncio.wait_for(chat, 30.0)
        assert resp.status == 200
        assert len(r.dispatcher.seen[0].token_ids) > 100_000

    run_router(test, tokenizer=tokenizer)


# -- what the planner hears ---------------------------------------------------------------------


def test_the_planner_hears_the_estimate_at_placement_and_what_the_prefill_found() -> None:
    """Arrivals carry the cached prefix the directory promised at placement; the finished
    request's `cached_tokens` (the prefill's own count, relayed by the decode side) is what the
    prefill really computed: the planner's `hits.SplitMemory` compares the two."""
    real = KvDirectory()
    ids = list(range(256)) * 16  # 4,096 tokens
    # The agent thought 9 s since its branch's last answer; it arrived just now.
    req = dataclasses.replace(_request(ids), think_s=9.0, arrival=time.monotonic())
    real.store(1, "L1", list(req.block_hashes[:1000]))  # promised: 4,000 tokens cached
    d = _dispatcher(real)
    slices = Slices(600.0)
    d.observer = PlannerFeed(slices)

    async def prefill(engine: Any, body: bytes) -> None:
        return None

    async def decode(engine: Any, body: bytes) -> AsyncIterator[Any]:
        yield TextPiece("hi", 1)
        yield Finished("stop", 1, 1_000)  # the blocks were gone: 1,000 cached, not 4,000

    d.transport = Legs(prefill, decode)

    async def run() -> list[Any]:
        return [e async for e in d.generate(req)]

    events = asyncio.run(run())
    assert isinstance(events[-1], Finished)
    s = slices.close(1.0)
    assert (s.requests, s.prompt_tokens) == (1, len(ids))
    assert (s.uncached_tokens, s.cached_tokens) == (len(ids) - 4_000, 4_000)
    assert (s.prefills, s.prefilled_prompt_tokens) == (1, len(ids))
    assert s.prefilled_uncached_tokens == len(ids) - 1_000
    assert s.output_tokens == 1
    # The closed loop: the think time as the request carried it, and the answer it got.
    assert (s.think_requests, s.think_s) == (1, 9.0)
    assert s.answered == 1
    assert 0.0 < s.ttft_s <= s.response_s < 5.0
