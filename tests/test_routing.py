"""Routing policies on a real KvDirectory and hand-built node loads: exact expected choices."""

from __future__ import annotations

import random

import pytest

from evolving_infra import KvDirectory
from evolving_infra.routing import (
    ROUTERS,
    DynamoRouter,
    EvolvingRouter,
    LeastLoadedRouter,
    NodeLoad,
    NoNodeError,
    Router,
    RouteRequest,
)
from evolving_infra.timing import DEFAULT_DEPLOYMENT
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.ttft import TTFTPredictor
from evolving_infra.types import Phase

BS = 16
KVB = DEFAULT_DEPLOYMENT.model.kv_bytes_per_token


def at(req: RouteRequest, d: KvDirectory) -> RouteRequest:
    """`req` with `d`'s match of its prompt taken now, as a driver hands it to a policy."""
    return RouteRequest.matched(
        d, req.hashes, req.prompt_tokens, req.expected_output_tokens, req.branch
    )


def load(
    node: int,
    phase: Phase = "prefill",
    *,
    accepting: bool = True,
    queue_s: float = 0.0,
    queue_tokens: int = 0,
    requests: int = 0,
    used: int = 0,
    capacity: int = 10_000,
    active: int = 0,
) -> NodeLoad:
    return NodeLoad(node, phase, accepting, queue_s, queue_tokens, requests, used, capacity, active)


def chain(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(62) for _ in range(n)]


def evolving() -> EvolvingRouter:
    return EvolvingRouter(
        IterationModel(prior=DEFAULT_DEPLOYMENT), block_size=BS, kv_bytes_per_token=KVB
    )


# -- evolving -----------------------------------------------------------------------------------


def long_prompt() -> tuple[KvDirectory, RouteRequest]:
    """A 32k-token prompt whose whole prefix node 1 holds in L1 (a ~3 s prefill saved)."""
    h = chain(2048)
    d = KvDirectory()
    d.store(1, "L1", h)
    return d, RouteRequest(h, prompt_tokens=2048 * BS + 10)


def test_evolving_prefers_the_cached_node_when_queues_are_equal() -> None:
    d, req = long_prompt()
    nodes = [load(n, queue_s=0.5) for n in range(4)]
    r = evolving()
    placed = r.choose_prefill(at(req, d), nodes)
    node, ttft = placed.node, placed.ttft_s
    assert node == 1
    assert placed.cached_blocks == d.match(req.hashes).node(1)[1]  # the chosen node's prefix
    # The same number a TTFTPredictor with those queues gives (the router adds no term).
    p = TTFTPredictor(r.model, [0, 1, 2, 3], block_size=BS, kv_bytes_per_token=KVB)
    p.queue[:] = 0.5
    expect = p.predict(d.match(req.hashes), req.prompt_tokens)
    assert ttft is not None
    assert ttft == pytest.approx(float(expect.min()))
    assert int(expect.argmin()) == 1


def test_evolving_is_not_cache_greedy() -> None:
    """The cached node loses once its queue costs more than its prefix saves."""
    d, req = long_prompt()
    r = evolving()
    uncached = r.model.predict_prefill_one(req.prompt_tokens, 0)
    assert uncached > 1.0  # the prefix is worth about that much
    nodes = [load(0, queue_s=0.2), load(1, queue_s=uncached + 5.0), load(2, queue_s=0.1)]
    assert r.choose_prefill(at(req, d), nodes).node == 2  # uncached, shortest queue
    # Queues are refreshed on every call: with node 1's queue drained it wins again.
    nodes[1] = load(1, queue_s=0.0)
    assert r.choose_prefill(at(req, d), nodes).node == 1


def test_evolving_only_chooses_accepting_nodes_of_the_phase() -> None:
    d, req = long_prompt()
    d.store(3, "L1", list(req.hashes))  # a decode node holding the prefix too
    nodes = [
        load(1, accepting=False),  # holds the prefix, draining
        load(3, "decode"),  # holds the prefix, wrong phase
        load(5, queue_s=3.0),
        load(4, queue_s=2.0),
    ]
    r = evolving()
    assert r.choose_prefill(at(req, d), nodes).node == 4
    with pytest.raises(NoNodeError):
        r.choose_prefill(at(req, d), nodes[:2])


def test_evolving_keeps_one_predictor_per_node_set() -> None:
    d, req = long_prompt()
    r = evolving()
    a = [load(n) for n in (0, 1, 2)]
    r.choose_prefill(at(req, d), a)
    r.choose_prefill(at(req, d), list(reversed(a)))  # same set, other order
    r.choose_prefill(at(req, d), a[:2])
    assert len(r._predictors) == 2
    r.observe_fetch("l2", 10**9, 0.1)  # 10 GB/s measured: every predictor sees the estimate
    assert all(p.bandwidth is r.bandwidth for p in r._predictors.values())
    assert r.bandwidth["l2"] < 50e9


def test_evolving_decode_takes_the_most_free_node_that_fits() -> None:
    r = evolving()
    nodes = [
        load(5, "decode", requests=2, used=900, capacity=1000),  # 100 free
        load(6, "decode", requests=10, used=500, capacity=1000),  # 500 free
        load(7, "decode", requests=3, used=500, capacity=1000),  # 500 free, fewer running
        load(8, "decode", accepting=False),  # all free, but draining
        load(9, requests=0),  # a prefill node
    ]
    small = RouteRequest(chain(10), prompt_tokens=1000, expected_output_tokens=600)  # 100 blocks
    assert r.choose_decode(small, nodes) == 7
    # Nothing fits 600 blocks: the least KV-loaded node takes it (it frees up first).
    big = RouteRequest(chain(10), prompt_tokens=9000, expected_output_tokens=600)
    nodes[1] = load(6, "decode", requests=10, used=450, capacity=1000)
    assert r.choose_decode(big, nodes) == 6


def test_decode_capacity_decides_over_request_count() -> None:
    """A node with fewer running requests but no room loses to one with room."""
    req = RouteRequest(chain(4), prompt_tokens=64 * BS, expected_output_tokens=16 * BS)  # 80
    nodes = [
        load(0, "decode", requests=1, used=950, capacity=1000),
        load(1, "decode", requests=30, used=800, capacity=1000),
    ]
    assert evolving().choose_decode(req, nodes) == 1
    assert LeastLoadedRouter(block_size=BS).choose_decode(req, nodes) == 1


# -- dynamo -------------------------------------------------------------------------------------


def dynamo_cluster() -> tuple[KvDirectory, RouteRequest, list[NodeLoad]]:
    """Prompt of 150 tokens: 9 full blocks hashed, 10 blocks occupied (ceil)."""
    h = chain(9, seed=3)
    d = KvDirectory()
    d.store(0, "L1", h[:6])  # device overlap 6
    d.store(1, "L1", h[:4])  # device overlap 4, host overlap 4
    d.store(1, "L2", h[4:8], parent=h[3])
    # `used` (the engine's KV, generated tokens included) differs from `active` (the prompt
    # blocks Dynamo's router tracks): its cost reads only the latter.
    nodes = [
        load(0, queue_tokens=320, active=50, used=500),
        load(1, queue_tokens=0, active=70, used=0),
        load(2, queue_tokens=64, active=60, used=90),
        load(3, "decode", active=0),
    ]
    return d, RouteRequest(h, prompt_tokens=150), nodes


def test_dynamo_cost_matches_the_formula() -> None:
    d, req, nodes = dynamo_cluster()
    # raw = (queued + 150) / 16; credit = l1 + 0.75 (l12 - l1); decode = active + ceil(150/16)
    # node 0: raw 470/16 = 29.375, credit 6,  adjusted 23.375, decode 60
    # node 1: raw 150/16 =  9.375, credit 7,  adjusted  2.375, decode 80
    # node 2: raw 214/16 = 13.375, credit 0,  adjusted 13.375, decode 70
    r = DynamoRouter(block_size=BS)
    assert r.costs(at(req, d), nodes) == {0: 83.375, 1: 82.375, 2: 83.375}
    assert r.choose_prefill(at(req, d), nodes).node == 1
    heavy = DynamoRouter(block_size=BS, prefill_load_scale=2.0)
    assert heavy.costs(at(req, d), nodes) == {0: 106.75, 1: 84.75, 2: 96.75}
    light = DynamoRouter(block_size=BS, prefill_load_scale=0.5)
    assert light.costs(at(req, d), nodes) == {0: 71.6875, 1: 81.1875, 2: 76.6875}
    assert light.choose_prefill(at(req, d), nodes).node == 0
    # Host blocks credited like device blocks: node 1's credit is 8, adjusted 1.375.
    flat = DynamoRouter(block_size=BS, host_credit=1.0)
    assert flat.costs(at(req, d), nodes)[1] == 81.375


def test_dynamo_clamps_the_prefill_term() -> None:
    h = chain(9, seed=4)
    d = KvDirectory()
    d.store(2, "L1", h)
    req = RouteRequest(h, prompt_tokens=144)  # exactly 9 blocks
    r = DynamoRouter(block_size=BS, overlap_score_credit=2.0)  # credit 18 > raw 9
    nodes = [load(1, active=9), load(2, active=9)]
    assert r.costs(at(req, d), nodes) == {1: 9.0 + 18.0, 2: 0.0 + 18.0}


def test_dynamo_breaks_ties_at_random_and_reproducibly() -> None:
    """Temperature 0: equal costs are drawn uniformly (reservoir sampling upstream); a node
    that costs more is never chosen; the same seed draws the same nodes."""
    h = chain(9, seed=4)
    d = KvDirectory()
    req = RouteRequest(h, prompt_tokens=144)
    prefill = [load(4, active=5), load(3, active=5), load(5, active=6), load(6, active=5)]
    decode = [load(n, "decode", active=a, used=u) for n, a, u in [(7, 2, 90), (8, 2, 0), (9, 3, 0)]]

    def draws(seed: int) -> tuple[list[int], list[int]]:
        r = DynamoRouter(block_size=BS, seed=seed)
        p = [r.choose_prefill(at(req, d), prefill).node for _ in range(600)]
        return p, [r.choose_decode(req, decode) for _ in range(600)]

    p, dec = draws(0)
    assert set(p) == {3, 4, 6}
    assert all(150 < p.count(n) < 250 for n in (3, 4, 6))
    assert set(dec) == {7, 8}
    assert 240 < dec.count(7) < 360
    assert draws(0) == (p, dec)
    assert draws(1) != (p, dec)


def test_dynamo_shared_cache_credit_is_off_unless_asked() -> None:
    h = chain(9, seed=5)
    d = KvDirectory()
    d.store(7, "L2", h)  # the whole prompt in some node's host memory: the pool holds it
    req = RouteRequest(h, prompt_tokens=144)
    nodes = [load(0)]
    assert DynamoRouter(block_size=BS).costs(at(req, d), nodes) == {0: 9.0 + 9.0}
    shared = DynamoRouter(block_size=BS, count_shared_cache=True)
    assert shared.costs(at(req, d), nodes) == {0: 9.0 - 9 * 0.5 + 9.0}


def test_dynamo_decode_is_the_fewest_active_blocks() -> None:
    _, req, _ = dynamo_cluster()
    nodes = [
        load(4, "decode", active=300, requests=1),
        load(5, "decode", active=120, used=900, requests=9),
        load(6, "decode", active=121, used=0, requests=4),
        load(7, "decode", active=0, accepting=False),
        load(8, active=0),
    ]
    assert DynamoRouter(block_size=BS).choose_decode(req, nodes) == 5


# -- least-loaded and the registry ------------------------------------------------------------


def test_least_loaded_picks_the_emptiest() -> None:
    d, req = long_prompt()  # node 1 holds the prefix: ignored
    r = LeastLoadedRouter(block_size=BS)
    nodes = [
        load(0, queue_tokens=500),
        load(1, queue_tokens=400),
        load(2, queue_tokens=100),
        load(3, queue_tokens=0, accepting=False),
    ]
    assert r.choose_prefill(at(req, d), nodes).node == 2
    dec = [load(4, "decode", requests=3, used=10), load(5, "decode", requests=2, used=900)]
    assert r.choose_decode(RouteRequest([], prompt_tokens=16), dec) == 5
    with pytest.raises(NoNodeError):
        r.choose_decode(req, nodes)


def test_a_prefill_choice_needs_the_requests_match() -> None:
    """Policies read the match the driver took (`RouteRequest.matched`), never the directory:
    a request built without one is a clear error, whatever the policy."""
    nodes = [load(0), load(1)]
    for make in ROUTERS.values():
        router = make(IterationModel(prior=DEFAULT_DEPLOYMENT), BS, KVB)
        with pytest.raises(ValueError, match=r"RouteRequest\.matched"):
            router.choose_prefill(RouteRequest(chain(3), prompt_tokens=3 * BS), nodes)


def test_registry_builds_every_router() -> None:
    model = IterationModel(prior=DEFAULT_DEPLOYMENT)
    d, req, nodes = dynamo_cluster()
    for name, factory in ROUTERS.items():
        router: Router = factory(model, BS, KVB)
        assert router.name == name
        assert router.choose_prefill(at(req, d), nodes).node in {0, 1, 2}
        assert router.choose_decode(req, nodes) == 3
