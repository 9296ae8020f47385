"""pytest-benchmark of one routing decision: directory match + TTFT of every node + the choice.

Run: `make bench-py` (= `.venv/bin/pytest benches -m bench --benchmark-only`). Goal (issue 4): a
decision for 64 nodes from Python in <= 20 µs median.

The cluster: 64 prefill nodes; every node holds a 30-block shared system prompt in L1 (so every
match names all 64 nodes, the expensive case); 2,000 agent contexts of 70 more blocks, each on 1-3
random nodes, in L1 (70%) or L2. A decision looks up one of those 2,000 prompts (100 blocks of
16 tokens plus a partial page), predicts TTFT on all 64 nodes with an `IterationModel` fitted on
the roofline ground truth and random queue drain times, and picks the least.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest

from evolving_infra import KvDirectory
from evolving_infra.timing import DEFAULT_DEPLOYMENT
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.truth import RooflineTruth
from evolving_infra.timing.ttft import TTFTPredictor

pytestmark = pytest.mark.bench

NODES = 64
CONTEXTS = 2_000
PREFIX_BLOCKS = 30
CHAIN_BLOCKS = 70
PAGE = 16
SEED = 4


@pytest.fixture(scope="module")
def cluster() -> tuple[KvDirectory, list[list[int]], TTFTPredictor]:
    rng = random.Random(SEED)
    d = KvDirectory()
    prefix = [rng.getrandbits(62) for _ in range(PREFIX_BLOCKS)]
    for n in range(NODES):
        d.store(n, "L1", prefix)
    queries = []
    for _ in range(CONTEXTS):
        chain = [rng.getrandbits(62) for _ in range(CHAIN_BLOCKS)]
        for n in rng.sample(range(NODES), rng.randint(1, 3)):
            d.store(n, "L1" if rng.random() < 0.7 else "L2", chain, prefix[-1])
        queries.append(prefix + chain)
    truth = RooflineTruth(noise=0.02, seed=SEED)
    model = IterationModel()
    for _ in range(400):
        batch = [(rng.randint(16, 4096), rng.choice((0, rng.randint(64, 30000))))]
        model.observe_prefill(batch, truth.prefill_time(batch))
    kvb = DEFAULT_DEPLOYMENT.model.kv_bytes_per_token
    predictor = TTFTPredictor(model, list(range(NODES)), block_size=PAGE, kv_bytes_per_token=kvb)
    predictor.queue[:] = np.random.default_rng(SEED).uniform(0.0, 2.0, NODES)
    return d, queries, predictor


def test_decision_64_nodes(
    benchmark: Any, cluster: tuple[KvDirectory, list[list[int]], TTFTPredictor]
) -> None:
    d, queries, predictor = cluster
    prompts = itertools.cycle(queries)
    prompt_tokens = (PREFIX_BLOCKS + CHAIN_BLOCKS) * PAGE + 7

    def decide() -> tuple[int, float]:
        return predictor.choose(d.match(next(prompts)), prompt_tokens)

    node, ttft = benchmark.pedantic(decide, rounds=20_000, iterations=1, warmup_rounds=200)
    benchmark.extra_info["nodes"] = NODES
    assert 0 <= node < NODES
    assert ttft > 0
