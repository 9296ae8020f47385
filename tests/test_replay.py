"""`evolving-infra replay`: prompt tokens, summary math, and closed-loop runs on a live cluster.

The live tests start real processes on loopback (`cluster_helpers.start_cluster`: two simulated
engines, prefill and decode, and the router, as `evolving-infra cluster up` runs them) and replay
traces through the real HTTP API.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from cluster_helpers import start_cluster
from evolving_infra import block_hashes, logs
from evolving_infra.cluster.command import Cluster
from evolving_infra.replay import command
from evolving_infra.replay.client import (
    HEADER_BRANCH,
    HEADER_EVENT,
    HEADER_PARENT,
    UNKNOWN_BRANCH,
    completion_body,
)
from evolving_infra.replay.prompts import PromptTokens
from evolving_infra.replay.runner import Replayer, ReplaySettings, scale_time
from evolving_infra.replay.summary import Outcome, Summary, summarize
from evolving_infra.router import api as router_api
from evolving_infra.router import branches as router_branches
from evolving_infra.workloads.blocks import PromptHasher, chain_hashes
from evolving_infra.workloads.model import (
    Agent,
    AgentId,
    BlockId,
    Branch,
    BranchId,
    BranchKind,
    Request,
    Trace,
    validate,
)
from evolving_infra.workloads.stats import IdealCache, trace_stats
from evolving_infra.workloads.timeline import trace_timeline

CLAUDE_CODE = Path(__file__).resolve().parent.parent / "data" / "traces" / "claude-code"


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# -- prompt tokens ----------------------------------------------------------------------------


def test_shared_blocks_give_shared_tokens_and_pages() -> None:
    bs, page = 64, 16
    tokens = PromptTokens(bs, salt="s")
    a = chain_hashes("ns", [BlockId(i) for i in (1, 2, 3, 4, 5)])
    b = chain_hashes("ns", [BlockId(i) for i in (1, 2, 3, 9, 5)])  # diverges at block 3
    ta = tokens.prompt(a, 5 * bs + 10, "a#0")
    tb = tokens.prompt(b, 5 * bs + 10, "b#0")
    assert len(ta) == len(tb) == 5 * bs + 10
    assert ta[: 3 * bs] == tb[: 3 * bs]
    assert _common(ta, tb) < 3 * bs + 8  # they part within the first tokens of block 3
    # Each 64-token block is exactly 4 router pages: the shared prefix is 12 pages, no more.
    pa, pb = block_hashes(ta, page), block_hashes(tb, page)
    assert len(pa) == len(pb) == (5 * bs + 10) // page
    assert _common(pa, pb) == 3 * bs // page
    # The unblocked tails (10 tokens) belong to each request alone.
    assert ta[5 * bs :] != tb[5 * bs :]
    assert all(32 <= t <= 126 for t in ta + tb)


def test_prompt_tokens_are_deterministic_and_salted() -> None:
    h = chain_hashes("ns", [BlockId(7), BlockId(8)])
    assert PromptTokens(16, "x").prompt(h, 40, "r") == PromptTokens(16, "x").prompt(h, 40, "r")
    assert (
        PromptTokens(16, "x").prompt(h, 40, "r")[:32]
        != PromptTokens(16, "y").prompt(h, 40, "r")[:32]
    )
    # A partial last block (Mooncake counts it) is cut to the prompt's tokens.
    assert PromptTokens(16, "x").prompt(h, 20, "r") == PromptTokens(16, "x").prompt(h, 40, "r")[:20]
    assert len(PromptTokens(16).prompt([], 0, "r")) == 1  # never an empty prompt


def test_a_continued_conversation_shares_its_full_blocks_and_a_new_namespace_nothing() -> None:
    trace = _tree_trace()
    hasher = PromptHasher(trace)
    agent = trace.agents[0]
    main = agent.root
    tokens = PromptTokens(trace.block_size)
    prompts = [
        tokens.prompt(hasher.hashes(agent, main, r), r.prompt_tokens, f"main#{i}")
        for i, r in enumerate(main.requests)
    ]
    bs = trace.block_size
    # Request 1 extends request 0: all of request 0's 6 blocks, not its unblocked tail.
    assert _common(prompts[0], prompts[1]) // bs == 6
    # Request 2 is a compaction: only the shared system prefix (4 blocks) is left in common.
    assert _common(prompts[1], prompts[2]) // bs == 4
    other = Agent(AgentId("u"), "test", "u", agent.branches, prefix="sys")
    h = PromptHasher(trace).hashes(other, main, main.requests[0])
    assert _common(tokens.prompt(h, main.requests[0].prompt_tokens, "u"), prompts[0]) // bs == 4


def test_the_next_prompt_carries_the_engines_answer() -> None:
    """A continued prompt's blocks over the previous prompt's unblocked tail and its response are
    the tokens the engine cached (tail + output), not the trace's; a prompt that does not
    continue the previous one (a compaction) takes nothing; the first answer of a block stays."""
    bs = 16
    tokens = PromptTokens(bs, salt="s")
    first = chain_hashes("ns", [BlockId(i) for i in (1, 2, 3)])
    prompt = tokens.prompt(first, 3 * bs + 5, "r#0")  # 5 tokens past the last full block
    output = b"O" * 40  # 5 + 40 = 45 tokens: blocks 3 and 4 whole, 13 tokens left over
    following = chain_hashes("ns", [BlockId(i) for i in (1, 2, 3, 4, 5, 6, 7)])
    before = tokens.prompt(following, 7 * bs, "r#1")
    assert tokens.answered(first, prompt, output, following) == 2
    after = tokens.prompt(following, 7 * bs, "r#1")
    cached = prompt + list(output)  # what the decode engine holds after the first request
    assert after[: 5 * bs] == cached[: 5 * bs]
    assert before[: 3 * bs] == after[: 3 * bs]
    assert before[3 * bs :] != after[3 * bs :]
    assert after[5 * bs :] == before[5 * bs :]  # past the answer: the trace's own blocks
    # Another prompt holding those blocks (a fork of the next turn) gets the same tokens.
    fork = chain_hashes("ns", [BlockId(i) for i in (1, 2, 3, 4, 5, 9)])
    assert tokens.prompt(fork, 6 * bs, "f#0")[: 5 * bs] == after[: 5 * bs]
    # A second answer for the same blocks changes nothing: prompts already sent them.
    assert tokens.answered(first, prompt, b"X" * 40, following) == 0
    assert tokens.prompt(following, 7 * bs, "r#1") == after
    # A compaction (the next prompt drops the history) and a branch's last request: nothing.
    compacted = chain_hashes("ns", [BlockId(i) for i in (1, 8, 9, 10)])
    assert tokens.answered(first, prompt, output, compacted) == 0
    assert tokens.answered(first, prompt, output, first) == 0


def test_completion_body_is_the_json_the_router_parses() -> None:
    body = json.loads(completion_body("m", [32, 65, 126, 300], 7))
    assert body == {
        "model": "m",
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt": [32, 65, 126, 300],
    }
    parsed = router_api.parse_completion(body)
    assert parsed.prompt == (32, 65, 126, 300)
    assert parsed.include_usage


def test_headers_and_codes_are_the_routers() -> None:
    assert HEADER_BRANCH == router_branches.HEADER_BRANCH
    assert HEADER_PARENT == router_branches.HEADER_PARENT
    assert HEADER_EVENT == router_branches.HEADER_EVENT
    assert UNKNOWN_BRANCH == router_api.UNKNOWN_BRANCH


# -- summary ------------------------------------------------------------------------------------


def test_summary_math() -> None:
    outcomes = [
        Outcome(
            True,
            ttft=0.1,
            e2e=1.0,
            prompt_tokens=100,
            cached_tokens=50,
            output_tokens=10,
            blocks=6,
            cached_blocks=3,
        ),
        Outcome(
            True,
            ttft=0.3,
            e2e=2.0,
            prompt_tokens=300,
            cached_tokens=250,
            output_tokens=30,
            blocks=18,
            cached_blocks=9,
        ),
        Outcome(True, ttft=0.2, e2e=3.0, prompt_tokens=0, cached_tokens=0, output_tokens=20),
        Outcome.failure("http_503:no_engine"),
        Outcome.failure("timeout", e2e=600.0),
        Outcome.failure("http_503:no_engine"),
        Outcome.failure("http_429:overloaded"),
        Outcome.failure("http_400:context_length_exceeded"),
        Outcome.failure("connection_refused"),
        Outcome.failure("connection"),
    ]
    s = summarize(
        outcomes, agents=2, duration_s=10, elapsed_s=4.0, issued=11, unissued=3, ideal_hit_rate=0.9
    )
    assert (s.completed, s.failed, s.lost, s.unissued) == (3, 7, 1, 3)
    assert s.shed == 1  # the 429: refused before dispatch
    assert (s.rejected, s.unreachable) == (1, 1)  # the 400; the router never reached
    assert s.failed_late == 4  # the 503s, the timeout and the dropped connection
    assert s.hit_rate_all == 300 / 400  # as reported
    assert s.hit_rate == 12 / 24  # in blocks, capped at h*'s: the simulator's h
    assert s.lost_kv_reuse == pytest.approx(1 - 0.5 / 0.9)
    assert s.requests_per_s == 3 / 4
    assert s.output_tokens_per_s == 60 / 4
    assert s.p50_ttft_s == pytest.approx(0.2)
    assert s.p95_ttft_s == pytest.approx(0.2 + 0.9 * 0.1)  # interpolated, as `trace stats`
    assert s.mean_e2e_s == 2.0  # completed requests only
    assert s.errors == {
        "connection": 1,
        "connection_refused": 1,
        "http_400:context_length_exceeded": 1,
        "http_429:overloaded": 1,
        "http_503:no_engine": 2,
        "timeout": 1,
    }
    d = s.to_dict()
    assert json.loads(json.dumps(d)) == d
    for key in ("completed", "failed", "lost", "hit_rate", "p95_ttft_s", "mean_e2e_s"):
        assert key in d
    empty = summarize([], agents=1, duration_s=1, elapsed_s=0.0, issued=0)
    assert (
        empty.hit_rate,
        empty.lost_kv_reuse,
        empty.p50_ttft_s,
        empty.mean_e2e_s,
        empty.requests_per_s,
    ) == (
        None,
        None,
        None,
        None,
        0.0,
    )


def test_ideal_cache_is_trace_stats_h_star() -> None:
    trace = _tree_trace()
    hasher = PromptHasher(trace)
    branches = {(a.id, b.id): b for a in trace.agents for b in a.branches}
    cache = IdealCache()
    for x in trace_timeline(trace):
        cache.add(hasher.hashes(x.agent, branches[(x.agent.id, x.branch)], x.request))
    assert cache.rate == trace_stats(trace).ideal_hit_rate


def test_ideal_cache_bisects_chained_ids_and_scans_raw_ones() -> None:
    """Chained ids: the seen blocks are a prefix, found by bisection. Raw ids: a block seen
    before after an unseen one is no hit (the scan stops at the first miss)."""
    chained = IdealCache()
    assert chained.add([1, 2, 3]) == 0
    assert chained.add([1, 2, 4, 5]) == 2
    assert (chained.hits, chained.blocks, chained.rate) == (2, 7, 2 / 7)
    raw = IdealCache(chained=False)
    assert raw.add([1, 2, 3]) == 0
    assert raw.add([9, 2, 3]) == 0
    assert raw.add([1, 2, 3, 9]) == 4
    assert IdealCache().rate is None


def test_scale_time_divides_waits_and_delays() -> None:
    trace = _tree_trace()
    fast = scale_time(trace, 4.0)
    validate(fast)
    for a, b in zip(trace.agents[0].branches, fast.agents[0].branches, strict=True):
        assert b.delay == a.delay / 4
        assert [r.wait for r in b.requests] == [r.wait / 4 for r in a.requests]
        assert [r.blocks for r in b.requests] == [r.blocks for r in a.requests]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _replay_against(trace: Trace, run_id: str, completions: Handler, end: Handler) -> Summary:
    """Replays `trace` against a stand-in router on loopback serving these two endpoints."""
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/branches/{branch}/end", end)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as http:
        url = str(server.make_url("")).rstrip("/")
        settings = ReplaySettings(url, "m", duration=30.0, run_id=run_id)
        return await Replayer(trace, settings, http).run()


def test_failed_requests_count_with_their_reason_and_the_branches_go_on() -> None:
    """A stand-in router (real aiohttp on loopback: the real router cannot be made to fail in
    these ways on demand) answers its n-th request in one of five ways, in turn: the replay
    counts each failure by reason, loses none, and the failed requests' branches go on, so
    every request of the trace is still sent."""
    modes = ["ok", "http_503", "stream_error", "broken", "no_usage"]
    arrivals: list[int] = []  # prompt lengths, in arrival order
    ended: list[str] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        mode = modes[len(arrivals) % len(modes)]
        arrivals.append(len(body["prompt"]))
        if mode == "http_503":
            error = {"error": {"message": "no engine", "code": "no_engine"}}
            return web.json_response(error, status=503)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(router_api.sse({"choices": [{"index": 0, "text": "ab"}]}))
        if mode == "stream_error":
            await resp.write(router_api.sse({"error": {"code": "engine_failed"}}))
        elif mode == "ok":
            usage = {"prompt_tokens": 10, "completion_tokens": 8,
                     "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
            await resp.write(router_api.sse({"choices": [], "usage": usage}))
        if mode != "broken":
            await resp.write(router_api.SSE_DONE)
        return resp

    async def end(request: web.Request) -> web.Response:
        ended.append(request.match_info["branch"])
        return web.json_response({"ended": True})

    async def main() -> None:
        summary = await _replay_against(_tree_trace(), "f", completions, end)
        assert (summary.issued, summary.completed, summary.failed, summary.lost) == (8, 2, 6, 0)
        assert summary.errors == {
            "broken_stream": 1,
            "http_503:no_engine": 2,
            "no_usage": 1,
            "stream_error:engine_failed": 2,
        }
        assert summary.hit_rate_all == 0.4
        # 4 cached tokens are no whole 32-token trace block: h counts none of them.
        assert summary.hit_rate == 0.0
        # Branches whose last request failed, and the one-request fork, are ended by POST.
        assert set(ended) <= {f"f.t/{b}" for b in ("main", "f1", "f2", "sub")}
        assert "f.t/f2" in ended

    asyncio.run(main())


def test_a_session_past_its_until_is_not_sent_and_its_follower_is() -> None:
    """The live replayer's closed loop is the simulator's (`AgentReplay`): agent b follows a
    but may start only until 0 s, so it is skipped; c follows b and runs. A stand-in router
    answers every request."""
    sent: list[str] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        sent.append(request.headers[HEADER_BRANCH].split("/")[0])  # "u.<agent>"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        usage = {"prompt_tokens": 10, "completion_tokens": 8}
        await resp.write(router_api.sse({"choices": [{"index": 0, "text": "ab"}]}))
        await resp.write(router_api.sse({"choices": [], "usage": usage}))
        await resp.write(router_api.SSE_DONE)
        return resp

    async def end(request: web.Request) -> web.Response:
        return web.json_response({"ended": True})

    tree = _tree_trace()
    (a,) = tree.agents
    b = dataclasses.replace(a, id=AgentId("b"), namespace="b", follows=a.id, until=0.0)
    c = dataclasses.replace(a, id=AgentId("c"), namespace="c", follows=b.id)
    trace = dataclasses.replace(tree, agents=(a, b, c))
    validate(trace)

    async def main() -> None:
        summary = await _replay_against(trace, "u", completions, end)
        assert (summary.issued, summary.completed, summary.lost) == (16, 16, 0)

    asyncio.run(main())
    assert {x: sent.count(f"u.{x}") for x in ("t", "b", "c")} == {"t": 8, "b": 0, "c": 8}


# -- live ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("live"), time_scale=50.0)
    try:
        yield c
    finally:
        c.stop()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        data: bytes = r.read()
        return data


def _branch_events(cluster: Cluster) -> dict[str, float]:
    text = _get(f"{cluster.router_url}/metrics").decode()
    pattern = r'^evolving_branch_events_total\{event="(\w+)"\} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


def _live_branches(cluster: Cluster) -> int:
    named: int = json.loads(_get(f"{cluster.router_url}/health"))["branches"]["named"]
    return named


def test_replay_claude_code_traces_hits_kv_end_to_end(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    logs.configure()  # as cli.main does: logs on stderr, stdout for the JSON
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    files = sorted(CLAUDE_CODE.glob("*.json.xz"))[:3]
    args = parser.parse_args(
        [*map(str, files), "--router", cluster.router_url, "--agents", "3", "--duration", "6",
         "--speed", "100", "--drain-timeout", "20", "--json"]
    )  # fmt: skip
    assert command.run(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["completed"] > 0
    assert summary["failed"] == 0, summary["errors"]
    assert summary["lost"] == 0
    # KV hits end to end: the router learned the engines' holdings from their KV events and the
    # engines served the cached prefixes; a long conversation's prefix is most of each prompt.
    assert summary["hit_rate"] > 0.3
    assert summary["hit_rate"] <= summary["ideal_hit_rate"] + 0.01
    assert summary["p95_ttft_s"] > 0
    # Every branch the run began is ended, cut off by the duration or not.
    assert _live_branches(cluster) == 0


def test_the_next_turn_sends_the_answer_back() -> None:
    """A two-turn conversation whose second prompt holds the first answer (4 blocks of it),
    against a stand-in router that answers with its own text: the second prompt carries the
    first prompt's tail and that text where the trace has the answer's blocks, as a harness
    sends back what the model wrote (so the pages a decode engine kept are hit, as the
    simulator's decode node's are), and its own blocks after."""
    bs = 32
    answer = "".join(chr(65 + i % 26) for i in range(4 * bs - 5))
    prompts: list[list[int]] = []

    def req(blocks: tuple[int, ...], output: int, *, end: bool = False) -> Request:
        ids = tuple(BlockId(b) for b in blocks)
        return Request(
            wait=0.02, prompt_tokens=len(ids) * bs + 5, output_tokens=output, blocks=ids,
            end=end,
        )  # fmt: skip

    async def completions(request: web.Request) -> web.StreamResponse:
        prompts.append((await request.json())["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        usage = {"prompt_tokens": len(prompts[-1]), "completion_tokens": len(answer)}
        for k in range(0, len(answer), 10):  # streamed in pieces
            chunk = {"choices": [{"index": 0, "text": answer[k : k + 10]}]}
            await resp.write(router_api.sse(chunk))
        await resp.write(router_api.sse({"choices": [], "usage": usage}))
        await resp.write(router_api.SSE_DONE)
        return resp

    async def end(request: web.Request) -> web.Response:
        return web.json_response({"ended": True})

    # Turn 0: 6 blocks + 5 tokens, then the answer: blocks 6..9 of turn 1 are its tail and the
    # answer; turn 1 adds 2 blocks of its own.
    turns = (req(tuple(range(1, 7)), len(answer)), req(tuple(range(1, 13)), 8, end=True))
    root = Branch(BranchId("main"), BranchKind.ROOT, requests=turns)
    trace = Trace("answer", bs, (Agent(AgentId("t"), "test", "t", (root,)),))
    validate(trace)
    summary = asyncio.run(_replay_against(trace, "answer", completions, end))
    assert (summary.completed, summary.failed) == (2, 0), summary
    first, second = prompts
    sent_back = first + list(answer.encode())
    assert second[: 10 * bs] == sent_back[: 10 * bs]
    # Past the answer, the trace's own blocks: what the first turn never sent.
    assert second[10 * bs : 10 * bs + 8] != sent_back[10 * bs : 10 * bs + 8]
    assert len(second) == 12 * bs + 5


def test_replay_sends_the_branch_events_of_forks_sub_agents_and_compactions(
    cluster: Cluster,
) -> None:
    trace = _tree_trace()
    before = _branch_events(cluster)

    async def main() -> Replayer:
        settings = ReplaySettings(cluster.router_url, "m", duration=30.0, run_id="tree")
        async with aiohttp.ClientSession() as session:
            replayer = Replayer(trace, settings, session)
            summary = await replayer.run()
        assert (summary.issued, summary.completed, summary.failed) == (8, 8, 0), summary
        assert summary.elapsed_s < 20  # the trace ran out: the replay did not wait for 30 s
        return replayer

    asyncio.run(main())
    after = _branch_events(cluster)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("fork", "compaction", "end")}
    # Two forks; one compaction; four branches ended, three by their last request's event and
    # the one-request fork by POST (its request said `fork`).
    assert delta == {"fork": 2.0, "compaction": 1.0, "end": 4.0}
    assert _live_branches(cluster) == 0


def _tree_trace() -> Trace:
    """One agent: main (4 requests; the third joins a fork and a sub-agent and is a compaction),
    fork f1 (2 requests) and fork f2 (1) spawned after main's first response, sub-agent `sub`
    (1) after main's second; 32-token blocks after a 4-block shared system prompt."""
    bs = 32

    def req(
        blocks: tuple[int, ...],
        *,
        join: tuple[BranchId, ...] = (),
        compaction: bool = False,
        end: bool = False,
    ) -> Request:
        ids = tuple(BlockId(b) for b in blocks)
        # 5 tokens past the last full block: an unblocked tail, as Claude Code prompts have.
        return Request(
            wait=0.02, prompt_tokens=(4 + len(ids)) * bs + 5, output_tokens=8, blocks=ids,
            shared=4, join=join, compaction=compaction, end=end,
        )  # fmt: skip

    main = Branch(
        BranchId("main"),
        BranchKind.ROOT,
        requests=(
            req((1, 2)),
            req((1, 2, 3, 4)),
            req((9,), join=(BranchId("f1"), BranchId("sub")), compaction=True),
            req((9, 10), end=True),
        ),
    )
    f1 = Branch(
        BranchId("f1"),
        BranchKind.FORK,
        parent=BranchId("main"),
        after=0,
        requests=(req((1, 2, 7)), req((1, 2, 7, 8), end=True)),
    )
    f2 = Branch(
        BranchId("f2"),
        BranchKind.FORK,
        parent=BranchId("main"),
        after=0,
        delay=0.01,
        requests=(req((1, 2, 5), end=True),),
    )
    sub = Branch(
        BranchId("sub"),
        BranchKind.SUBAGENT,
        parent=BranchId("main"),
        after=1,
        requests=(req((20,), end=True),),
    )
    agent = Agent(AgentId("t"), "test", "t", (main, f1, f2, sub), prefix="sys")
    trace = Trace("tree", bs, (agent,), prefixes={"sys": 4})
    validate(trace)
    return trace
