"""The simulated engine on one node: SGLang's HTTP shapes, KV bookkeeping, hints, switches.

Real parts only: `SimEngine` (the simulator's `Node` and `NodeKv` under the real-time driver),
the Rust `KvDirectory`, aiohttp on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from evolving_infra import KvDirectory, block_hashes
from evolving_infra.control.records import (
    EvictionHints,
    KvLocation,
    SwitchRequest,
    TransferRequest,
)
from evolving_infra.engines.sim import EngineSettings
from test_engine_sim_helpers import PAGE, Running, prompt, running, settings

Test = Callable[[Running], Awaitable[None]]


def run(test: Test, s: EngineSettings | None = None) -> None:
    async def main() -> None:
        async with running(s or settings()) as r:
            await test(r)

    asyncio.run(main())


def gen(ids: list[int], n: int, **extra: object) -> dict[str, object]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}, **extra}


def all_held(d: KvDirectory, node: int, tier: str) -> set[int]:
    """Every block (node, tier) holds (evicting them all: only on a directory about to go)."""
    return set(d.evict(node, tier, 10**9))  # type: ignore[arg-type]


def test_generate_counts_tokens_and_caches_the_prompt() -> None:
    async def test(r: Running) -> None:
        ids = prompt(1, 50)
        status, first = await r.post("/generate", gen(ids, 10, rid="a"))
        assert status == 200, first
        assert len(first["output_ids"]) == 10
        assert first["text"].encode() == bytes(first["output_ids"])
        meta = first["meta_info"]
        assert meta["id"] == "a"
        assert meta["prompt_tokens"] == 50
        assert meta["completion_tokens"] == 10
        assert meta["finish_reason"] == {"type": "length", "length": 10}
        assert meta["cached_tokens"] == 0
        assert meta["e2e_latency"] > 0
        status, again = await r.post("/generate", gen(ids, 10))
        assert status == 200
        assert again["output_ids"] == first["output_ids"]  # deterministic per prompt
        assert again["meta_info"]["cached_tokens"] == 48  # 12 full pages of 4
        # The prompt and the response stay cached: 60 tokens = 15 full pages.
        hashes = block_hashes(ids + first["output_ids"], PAGE)
        assert r.engine.directory.match(hashes).nodes[0] == (15, 15)
        assert r.engine.env.model.source("prefill")
        assert len(r.engine.env.recent) > 10

    run(test)


def test_streaming_is_cumulative_and_ends_with_done() -> None:
    async def test(r: Running) -> None:
        body = {"text": "hello engine", "stream": True, "sampling_params": {"max_new_tokens": 6}}
        events = await r.stream("/generate", body)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6]
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        last = chunks[-1]
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        assert last["meta_info"]["prompt_tokens"] == len(b"hello engine")
        assert last["text"] == chunks[-2]["text"] + last["text"][-1]

    run(test)


def test_chat_completions_plain_and_streamed() -> None:
    async def test(r: Running) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        status, out = await r.post("/v1/chat/completions", body)
        assert status == 200, out
        assert out["object"] == "chat.completion"
        assert out["choices"][0]["finish_reason"] == "length"
        assert len(out["choices"][0]["message"]["content"]) == 5
        assert out["usage"]["completion_tokens"] == 5
        events = await r.stream("/v1/chat/completions", {**body, "stream": True,
                                "stream_options": {"include_usage": True}})  # fmt: skip
        assert events[-1] == "[DONE]"
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(
            e["choices"][0]["delta"].get("content", "") for e in events[:-2] if e["choices"]
        )
        assert text == out["choices"][0]["message"]["content"]
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    run(test)


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        b'{"text": "a", "input_ids": [1]}',
        b'{"input_ids": [1, -2]}',
        b'{"text": "a", "sampling_params": {"max_new_tokens": "x"}}',
        b'{"text": "a", "sampling_params": {"max_new_tokens": 0}}',
        b'{"text": "a", "bootstrap_host": "127.0.0.1"}',
        b'{"text": "' + b"x" * 80 + b'", "sampling_params": {"max_new_tokens": 100}}',
    ],
)
def test_bad_requests_are_400_and_the_server_lives_on(body: bytes) -> None:
    async def test(r: Running) -> None:
        async with r.http.post(r.url + "/generate", data=body) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["message"]
        status, _ = await r.post("/generate", gen(prompt(2, 8), 2))
        assert status == 200

    run(test, settings(l1_blocks=40))


def test_queue_limit_is_503() -> None:
    async def test(r: Running) -> None:
        results = await asyncio.gather(
            *(r.post("/generate", gen(prompt(i, 20), 40)) for i in range(5))
        )
        statuses = sorted(s for s, _ in results)
        assert statuses == [200, 200, 503, 503, 503]
        assert all("error" in b for s, b in results if s == 503)
        assert r.engine.active == 0

    run(test, settings(max_requests=2))


def test_health_and_server_info() -> None:
    async def test(r: Running) -> None:
        status, h = await r.get("/health")
        assert status == 200
        assert h["state"] == "serving"
        for path in ("/server_info", "/get_server_info"):
            status, info = await r.get(path)
            assert status == 200
            assert info["page_size"] == PAGE
            assert info["disaggregation_mode"] == "prefill"
            assert info["disaggregation_bootstrap_port"] == r.port
            assert info["internal_states"][0]["l1_capacity_blocks"] == 4096

    run(test)


def test_capacity_under_load_events_replay_to_the_same_holdings() -> None:
    async def test(r: Running) -> None:
        # 12 pages per request (40 prompt + 8 output tokens), 60 pages of L1: 5 at a time.
        results = await asyncio.gather(
            *(r.post("/generate", gen(prompt(i, 40), 8)) for i in range(24))
        )
        assert [s for s, _ in results] == [200] * 24  # none lost
        assert all(len(b["output_ids"]) == 8 for _, b in results)
        e, kv = r.engine, r.engine.kv
        assert kv.evicted > 0
        assert kv.demoted > 0
        assert kv.dropped > 0
        assert kv.reserved == 0
        assert kv.pinned == 0
        assert kv.l1_held <= kv.l1_capacity
        assert kv.l2_held <= kv.l2_capacity
        held = e.holdings()
        replay = r.sink.replay(0)
        stats = replay.stats()
        assert stats["locations_l1"] == kv.l1_held == len(held["L1"])
        assert stats["locations_l2"] == kv.l2_held == len(held["L2"])
        for tier in ("L1", "L2"):
            assert all_held(replay, 0, tier) == held[tier] == all_held(e.directory, 0, tier)
        # Token ids travel with stored pages when known (a page is PAGE ids).
        stored = [ev for ev in r.sink.events if ev[0] == "stored"]
        assert all(len(ev[3]) in (0, PAGE * len(ev[1])) for ev in stored)
        assert any(ev[4] == "CPU" for ev in stored)

    run(test, settings(l1_blocks=60, l2_blocks=30))


def test_eviction_hints_protect_hinted_blocks() -> None:
    async def test(r: Running) -> None:
        keep, lose = prompt(100, 40), prompt(200, 40)
        for ids in (keep, lose):
            status, _ = await r.post("/generate", gen(ids, 4))
            assert status == 200
        keep_h, lose_h = block_hashes(keep, PAGE), block_hashes(lose, PAGE)
        # `keep` is the least recently used, so LRU alone would evict it first.
        result = await r.engine.set_eviction_hints(EvictionHints(((keep_h[-1], 5), (1, 5))))
        assert (result.applied, result.ignored) == (1, 1)
        for i in range(6):  # other prompts push the cache out
            status, _ = await r.post("/generate", gen(prompt(300 + i, 40), 4))
            assert status == 200
        held = r.engine.holdings()["L1"]
        assert set(keep_h) <= held
        assert not set(lose_h) & held
        status, out = await r.post("/generate", gen(keep, 4))
        assert out["meta_info"]["cached_tokens"] == 39  # all 10 pages; the last token runs

    run(test, settings(l1_blocks=36))


def test_phase_switch_keeps_the_kv() -> None:
    async def test(r: Running) -> None:
        for i in range(4):
            status, _ = await r.post("/generate", gen(prompt(i, 30), 5))
            assert status == 200
        e = r.engine
        before = e.holdings()
        # To its own phase: the proto's no-op (what a new planner leader fences with), at once,
        # nothing drained: a request sent meanwhile is served.
        same = await e.switch_phase(SwitchRequest("prefill", leader_epoch=3))
        assert (same.phase, same.total_s, same.l1_blocks_kept) == (
            "prefill",
            0.0,
            len(before["L1"]),
        )
        assert (await e.health()).state == "serving"
        result = await e.switch_phase(SwitchRequest("decode"))
        assert (result.previous_phase, result.phase) == ("prefill", "decode")
        assert result.switch_s == pytest.approx(2.0, rel=0.5)
        assert result.l1_blocks_kept == len(before["L1"]) > 0
        assert e.holdings() == before
        assert not any(ev[0] in ("removed", "cleared") for ev in r.sink.events)
        status, info = await r.get("/server_info")
        assert info["disaggregation_mode"] == "decode"
        status, _body = await r.post("/generate", gen(prompt(9, 8), 2))
        assert status == 400  # a decode engine serves PD requests only
        back = await e.switch_phase(SwitchRequest("prefill", keep_kv=False))
        assert back.l1_blocks_kept == 0
        assert r.sink.events[-1] == ("cleared",)

    run(test)


def test_switch_hands_queued_requests_back_with_503() -> None:
    async def test(r: Running) -> None:
        # One 2,000-token request fills the chunk budget: the rest queue behind it.
        tasks = [asyncio.create_task(r.post("/generate", gen(prompt(i, 2000), 3)))
                 for i in range(4)]  # fmt: skip
        while not r.engine.node.queue:
            await asyncio.sleep(0.001)
        result = await r.engine.switch_phase(SwitchRequest("decode"))
        statuses = sorted(s for s, _ in await asyncio.gather(*tasks))
        assert statuses[0] == 200
        assert statuses[-1] == 503
        assert result.drain_s > 0
        assert r.engine.active == 0

    run(test, settings(chunk_tokens=2048, time_scale=5.0))


def test_iteration_samples_stream() -> None:
    async def test(r: Running) -> None:
        stream = r.engine.iteration_samples()
        task = asyncio.create_task(r.post("/generate", gen(prompt(5, 30), 4)))
        first = await anext(stream)
        assert first.phase == "prefill"
        assert first.prefill == ((30, 0),)
        assert first.wall_s > 0
        phases = [first.phase] + [(await anext(stream)).phase for _ in range(3)]
        assert phases == ["prefill", "decode", "decode", "decode"]
        await task
        await stream.aclose()

    run(test)


def test_a_pull_answered_when_started_holds_the_blocks_and_its_prefills_wait() -> None:
    """`TransferKV(answer_when_started=True)`, as the router pulls: the engine answers before
    the move is over, holds the chain in L1 from then on, and a prefill of a prompt that starts
    with the chain waits until it is in (the move overlaps the prefill's queue, as in the
    simulator); a prompt that does not start with it does not wait."""
    latency = 40.0  # simulated seconds: 2 s of real time here, far more than a prefill takes

    async def test(r: Running) -> None:
        e = r.engine
        ids = prompt(1, 64 * PAGE)
        hashes = tuple(block_hashes(ids, PAGE))
        start = e.env.now
        source = KvLocation.node(5, "L1")  # another node's GPU memory, as the router vouches
        request = TransferRequest(source, KvLocation.node(0), hashes, answer_when_started=True)
        got = await e.transfer_kv(request)
        assert got.blocks_moved == len(hashes)
        assert got.seconds >= latency
        assert e.env.now - start < latency  # answered while the move goes on
        assert e.directory.match(list(hashes)).node(0)[0] == len(hashes)  # held from now on
        status, _ = await r.post("/generate", gen(prompt(3, 4 * PAGE), 1))
        assert status == 200
        assert e.env.now - start < latency  # another prompt did not wait for the move
        status, out = await r.post("/generate", gen(ids + prompt(2, 4 * PAGE), 1))
        assert status == 200
        assert out["meta_info"]["cached_tokens"] == len(ids)
        assert e.env.now >= start + got.seconds  # the prefill waited for the move

    run(test, settings(transfer_latency=latency))


def test_held_counts_the_leading_blocks_and_refuses_bad_input() -> None:
    """`POST /_sim/held`, which a peer's TransferKV asks when the pool lags this node's L2."""

    async def test(r: Running) -> None:
        ids = prompt(4, 8 * PAGE)
        hashes = block_hashes(ids, PAGE)
        assert await r.post("/_sim/held", {"hashes": hashes}) == (200, {"held": 0})
        status, _ = await r.post("/generate", gen(ids, 1))
        assert status == 200
        assert await r.post("/_sim/held", {"hashes": hashes}) == (200, {"held": len(hashes)})
        assert await r.post("/_sim/held", {"hashes": [hashes[1]]}) == (200, {"held": 0})
        for bad in ({"hashes": "x"}, {"hashes": [1.5]}, {"hashes": [2**64]}, {}, [1]):
            status, body = await r.post("/_sim/held", bad)
            assert status == 400, (bad, body)
            assert body["error"]["message"]

    run(test)
