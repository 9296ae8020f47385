"""The TTFT predictor: its arithmetic against a plain-Python reference on real directory matches."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from evolving_infra import KvDirectory
from evolving_infra.timing import DEFAULT_DEPLOYMENT, TimingError
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.truth import RooflineTruth
from evolving_infra.timing.ttft import TTFTPredictor

BS = 16
KVB = DEFAULT_DEPLOYMENT.model.kv_bytes_per_token


def fitted_model() -> IterationModel:
    """A model fitted on the roofline truth, so that every coefficient (hinge too) is in play."""
    truth = RooflineTruth(noise=0.0)
    m = IterationModel()
    rng = random.Random(1)
    for _ in range(300):
        batch = [(rng.randint(1, 4096), rng.choice((0, rng.randint(1, 30000))))]
        m.observe_prefill(batch, truth.prefill_time(batch))
    return m


def reference(
    p: TTFTPredictor, nodes: dict[int, tuple[int, int]], pool: int, prompt: int
) -> dict[int, float]:
    """TTFT per candidate straight from the definition, one node at a time."""
    b0, b1, b2, b3, b4, knee = p.model.prefill_form()
    block_bytes = BS * KVB

    def prefill(u: float, c: float) -> float:
        return b0 + b1 * u + b2 * max(0.0, u - knee) + b3 * (u * c + u * (u + 1) / 2) + b4 * c

    out = {}
    for k, node in enumerate(p.nodes.tolist()):
        l1, l12 = nodes.get(node, (0, 0))
        cached = min(max(l12, pool) * BS, prompt - 1)
        fetch = (l12 - l1) * block_bytes / p.bandwidth["l2"]
        fetch += max(pool - l12, 0) * block_bytes / p.bandwidth["pool"]
        out[node] = max(float(p.queue[k]), fetch) + prefill(prompt - cached, cached)
    return out


def random_cluster(seed: int, nodes: int) -> tuple[KvDirectory, list[list[int]]]:
    rng = random.Random(seed)
    d = KvDirectory()
    prefix = [rng.getrandbits(62) for _ in range(8)]
    queries = []
    for n in range(nodes):
        if rng.random() < 0.7:
            d.store(n, "L1", prefix)
    for _ in range(40):
        chain = [rng.getrandbits(62) for _ in range(rng.randint(1, 30))]
        for n in rng.sample(range(nodes + 4), rng.randint(1, 4)):  # some are not candidates
            d.store(n, "L1", prefix, now=0.0)
            keep = rng.randint(0, len(chain))
            d.store(n, "L1", chain[:keep], prefix[-1]) if keep else None
            d.store(n, "L2", chain, prefix[-1])
        queries.append(prefix + chain + [rng.getrandbits(62)])
    return d, queries


@pytest.mark.parametrize("seed", range(4))
def test_predict_matches_the_definition_on_real_matches(seed: int) -> None:
    d, queries = random_cluster(seed, nodes=12)
    p = TTFTPredictor(fitted_model(), list(range(12)), block_size=BS, kv_bytes_per_token=KVB)
    rng = random.Random(seed)
    p.queue[:] = [rng.uniform(0, 0.5) for _ in range(12)]
    for q in queries:
        m = d.match(q)
        for prompt in (len(q) * BS + 5, (len(q) - 1) * BS, 3):
            got = p.predict(m, prompt)
            want = reference(p, m.nodes, m.pool, prompt)
            assert got.tolist() == pytest.approx([want[n] for n in range(12)], rel=1e-12)
            node, ttft = p.choose(m, prompt)
            best = min(range(12), key=lambda n: (want[n], n))
            assert node == best
            assert ttft == pytest.approx(want[best], rel=1e-12)


def test_l1_hits_are_free_and_l2_fetches_overlap_the_queue() -> None:
    d = KvDirectory()
    chain = list(range(1, 101))
    d.store(0, "L1", chain)
    d.store(1, "L2", chain)
    p = TTFTPredictor(fitted_model(), [0, 1, 2], block_size=BS, kv_bytes_per_token=KVB)
    m = d.match(chain)
    prompt = 100 * BS + 10
    t = p.predict(m, prompt)
    fetch = 100 * BS * KVB / p.bandwidth["l2"]
    computed = p.model.predict_prefill_one(10, 100 * BS)
    assert t[0] == pytest.approx(computed)
    assert t[1] == pytest.approx(fetch + computed)
    # Node 1's L2 is also the shared pool: node 2 fetches the chain from it, more slowly.
    assert m.pool == 100
    pool_fetch = 100 * BS * KVB / p.bandwidth["pool"]
    assert t[2] == pytest.approx(pool_fetch + computed)
    # A queue shorter than the fetch costs nothing more on node 1; a longer one replaces it.
    p.set_queue(1, fetch / 2)
    assert p.predict(m, prompt)[1] == pytest.approx(fetch + computed)
    p.set_queue(1, 2 * fetch)
    assert p.predict(m, prompt)[1] == pytest.approx(2 * fetch + computed)
    # The cache-greedy choice is not always right: a long queue on node 0 moves the request.
    p.set_queue(0, 10.0)
    assert p.choose(m, prompt)[0] == 1


def test_pool_blocks_serve_every_node_at_the_pool_bandwidth() -> None:
    d = KvDirectory()
    chain = list(range(1, 51))
    d.store(5, "L2", chain)  # node 5 is not a candidate: its L2 is still part of the pool
    p = TTFTPredictor(fitted_model(), [0, 1], block_size=BS, kv_bytes_per_token=KVB)
    m = d.match(chain)
    assert m.pool == 50
    t = p.predict(m, 50 * BS + 1)
    want = 50 * BS * KVB / p.bandwidth["pool"] + p.model.predict_prefill_one(1, 50 * BS)
    assert t.tolist() == pytest.approx([want, want])


def test_fetch_bandwidth_follows_measurements() -> None:
    p = TTFTPredictor(fitted_model(), [0], block_size=BS, kv_bytes_per_token=KVB)
    for _ in range(60):
        p.observe_fetch("l2", 10_000_000, 0.001)  # 10 GB/s
    assert p.bandwidth["l2"] == pytest.approx(10e9, rel=1e-3)
    with pytest.raises(TimingError):
        p.observe_fetch("l2", 0, 1.0)
    with pytest.raises(TimingError):
        p.observe_fetch("l2", 1, math.nan)


def test_bad_arguments_are_typed_errors() -> None:
    m = fitted_model()
    with pytest.raises(TimingError):
        TTFTPredictor(m, [], block_size=BS, kv_bytes_per_token=KVB)
    with pytest.raises(TimingError):
        TTFTPredictor(m, [1, 1], block_size=BS, kv_bytes_per_token=KVB)
    p = TTFTPredictor(m, [0, 3], block_size=BS, kv_bytes_per_token=KVB)
    with pytest.raises(TimingError):
        p.set_queue(2, 1.0)
    with pytest.raises(TimingError):
        p.set_queue(0, -1.0)
    with pytest.raises(TimingError):
        p.predict(KvDirectory().match([1]), 0)
    # A miss everywhere: every node pays the whole prompt, the emptiest queue wins.
    p.queue[:] = np.array([0.2, 0.1])
    assert p.choose(KvDirectory().match([1]), 100)[0] == 3
