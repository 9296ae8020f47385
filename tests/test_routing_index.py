"""Load indexes (`routing.index`) against the stateless routers: the same node, every time.

Random views with many ties (small value ranges), nodes leaving and joining each phase, and a
real directory where some nodes hold part of the prompt in L1 or L2; after each round of
updates every router's index must choose what its stateless method chooses on the same views.
"""

from __future__ import annotations

import random

import pytest

from evolving_infra import KvDirectory
from evolving_infra.routing import (
    DynamoRouter,
    EvolvingRouter,
    LeastLoadedRouter,
    NodeLoad,
    NoNodeError,
    Placement,
    Router,
    RouteRequest,
)
from evolving_infra.routing.index import LoadIndex
from evolving_infra.timing import DEFAULT_DEPLOYMENT
from evolving_infra.timing.model import IterationModel
from evolving_infra.types import Phase

BS = 16
KVB = DEFAULT_DEPLOYMENT.model.kv_bytes_per_token


def routers() -> list[Router]:
    return [
        EvolvingRouter(
            IterationModel(prior=DEFAULT_DEPLOYMENT), block_size=BS, kv_bytes_per_token=KVB
        ),
        DynamoRouter(block_size=BS),
        DynamoRouter(block_size=BS, prefill_load_scale=2.0),  # inexact keys: scans the views
        DynamoRouter(block_size=24),  # not a power of two: scans too
        LeastLoadedRouter(block_size=BS),
    ]


def random_load(rng: random.Random, node: int) -> NodeLoad:
    phase: Phase = "prefill" if rng.random() < 0.5 else "decode"
    capacity = rng.choice([200, 400])
    return NodeLoad(
        node=node,
        phase=phase,
        accepting=rng.random() < 0.85,
        # Few distinct values: ties are frequent, so the tie-breaks are exercised.
        queued_prefill_s=rng.choice([0.0, 0.0, 0.5, 1.0, 2.5, -1e-9]),
        queued_prefill_tokens=rng.choice([0, 0, 16, 256, 4096]),
        decode_requests=rng.randint(0, 3),
        kv_used_blocks=min(rng.choice([0, 50, 100, 190, 200, 400]), capacity),
        kv_capacity_blocks=capacity,
        active_blocks=rng.choice([0, 0, 7, 50, 51, 120]),
    )


def directory(rng: random.Random, chain: list[int], nodes: int) -> KvDirectory:
    d = KvDirectory()
    for n in range(nodes):
        if rng.random() < 0.3:
            k = rng.randint(1, len(chain))
            d.store(n, "L1", chain[:k])
            if k < len(chain) and rng.random() < 0.5:
                d.store(n, "L2", chain[k : rng.randint(k + 1, len(chain))], chain[k - 1])
    return d


@pytest.mark.parametrize("seed", range(6))
def test_every_index_chooses_as_its_router(seed: int) -> None:
    rng = random.Random(seed)
    nodes = 40
    chain = [rng.getrandbits(62) for _ in range(12)]
    # Each stateless router against its twin's index: a router that draws among ties (Dynamo's)
    # must draw the same node from the same seed on either path.
    pairs: list[tuple[Router, LoadIndex]] = [
        (r, twin.index())  # type: ignore[attr-defined]
        for r, twin in zip(routers(), routers(), strict=True)
    ]
    views = [random_load(rng, n) for n in range(nodes)]
    for index in (i for _, i in pairs):
        for v in views:
            index.put(v)
    checked = 0
    for _ in range(150):
        for _ in range(rng.randint(1, 8)):  # a few nodes change between two choices
            n = rng.randrange(nodes)
            views[n] = random_load(rng, n)
            for _, index in pairs:
                index.put(views[n])
        d = directory(rng, chain, nodes)
        req = RouteRequest.matched(
            d,
            chain[: rng.randint(0, len(chain))],
            prompt_tokens=rng.randint(1, len(chain) * BS + 5),
            expected_output_tokens=rng.choice([0, 100, 3000]),
        )
        order = rng.sample(views, len(views))  # the stateless path takes any order
        for router, index in pairs:
            for phase in ("prefill", "decode"):
                try:
                    want = stateless(router, phase, req, order)
                except NoNodeError:
                    with pytest.raises(NoNodeError):
                        indexed(index, phase, req)
                    continue
                assert indexed(index, phase, req) == want, (router, phase)
                checked += 1
    assert checked > 1000


def stateless(
    router: Router, phase: str, req: RouteRequest, views: list[NodeLoad]
) -> Placement | int:
    if phase == "prefill":
        return router.choose_prefill(req, views)
    return router.choose_decode(req, views)


def indexed(index: LoadIndex, phase: str, req: RouteRequest) -> Placement | int:
    return index.choose_prefill(req) if phase == "prefill" else index.choose_decode(req)


def test_the_requests_match_is_used_as_is() -> None:
    rng = random.Random(7)
    chain = [rng.getrandbits(62) for _ in range(8)]
    d = KvDirectory()
    d.store(3, "L1", chain)
    router = EvolvingRouter(
        IterationModel(prior=DEFAULT_DEPLOYMENT), block_size=BS, kv_bytes_per_token=KVB
    )
    index = router.index()
    for n in range(5):
        index.put(NodeLoad(n, "prefill", True, 0.0, 0, 0, 0, 100))
    req = RouteRequest.matched(d, chain, prompt_tokens=len(chain) * BS)
    placed = index.choose_prefill(req)
    assert (placed.node, placed.cached_blocks) == (3, len(chain))
    assert placed.ttft_s is not None
    assert placed.ttft_s > 0
    # The match of another moment (nothing cached) is what the index scores.
    empty = RouteRequest.matched(KvDirectory(), chain, prompt_tokens=len(chain) * BS)
    assert (index.choose_prefill(empty).node, index.choose_prefill(empty).cached_blocks) == (0, 0)
    # No match, no prefill choice: a clear error rather than a directory read behind its back.
    with pytest.raises(ValueError, match=r"RouteRequest\.matched"):
        index.choose_prefill(RouteRequest(chain, prompt_tokens=len(chain) * BS))


def test_membership_follows_state_and_phase() -> None:
    index = LeastLoadedRouter(block_size=BS).index()
    index.put(NodeLoad(2, "prefill", True, 0.0, 10, 0, 0, 100))
    index.put(NodeLoad(1, "prefill", True, 0.0, 10, 0, 0, 100))
    req = RouteRequest.matched(KvDirectory(), [], prompt_tokens=5)
    assert index.accepting("prefill") == 2
    assert index.choose_prefill(req).node == 1  # tie: lowest id
    index.put(NodeLoad(1, "prefill", False, 0.0, 0, 0, 0, 100))  # draining
    assert index.choose_prefill(req).node == 2
    index.put(NodeLoad(1, "decode", True, 0.0, 0, 0, 0, 100))  # switched
    index.put(NodeLoad(2, "decode", True, 0.0, 0, 0, 0, 100))
    assert index.accepting("prefill") == 0
    assert index.accepting("decode") == 2
    with pytest.raises(NoNodeError):
        index.choose_prefill(req)
    assert index.choose_decode(req) == 1
