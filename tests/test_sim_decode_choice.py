"""The decode node a request is sent to: a node whose queue is blocked is not the most free.

SGLang's decode node pre-allocates FIFO (`DecodePreallocQueue.pop_preallocated` stops at the
first request that does not fit), so a request sent to a node with a waiting head waits behind
it whatever its own size. The routers see the requests waiting at a node as taking their KV
there (`Node.load`, as the live router counts a request from dispatch): otherwise the node whose
head waits for most of its KV stays the most free, and every later request queues behind that
head while other nodes have room (at 3,072 GPUs thousands of requests did, one node each).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from evolving_infra.planner.base import Split
from evolving_infra.sim.cluster import Cluster
from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.policies import ARROW, static
from evolving_infra.types import blocks_for
from evolving_infra.workloads.generators import SlotPlan, generate


@pytest.mark.parametrize("gate", [True, False], ids=["evolving-router-gate", "least-loaded"])
def test_no_request_waits_behind_a_head_while_another_node_has_room(gate: bool) -> None:
    trace = generate("cc", SlotPlan(agents=60, duration=600, seed=5))
    config = SimConfig(gpus=24, duration=300, seed=3)
    split = Split(2, 4)
    spec = static(split) if gate else replace(ARROW, planner=None, split=split)
    cluster = Cluster(trace, config, spec)
    bs = cluster.block_size
    seen = {"waited": 0, "admitted": 0, "waiting_loads": 0}
    route = cluster._route_decode

    def checked(req):  # type: ignore[no-untyped-def]
        route(req)
        if req.decode_node < 0:
            return
        d = cluster.nodes[req.decode_node]
        if req not in d.waiting:
            seen["admitted"] += 1
            return
        seen["waited"] += 1
        total = blocks_for(req.prompt_tokens + req.output_tokens, bs)
        for n in cluster.nodes:
            if n is d or n.phase != "decode" or not n.accepting:
                continue
            # `n` would have admitted the request at once.
            assert n.waiting or not n.kv.room(total), (
                f"request {req.id} ({total} blocks) waits on node {d.id} behind "
                f"{len(d.waiting) - 1} while node {n.id} has room"
            )
        # The waiting requests' KV counts in the node's load.
        load = d.load()
        assert load.kv_used_blocks == min(
            d.kv.reserved + d.kv.pinned + d.waiting_blocks, d.kv.l1_capacity
        )
        assert d.waiting_blocks == sum(
            blocks_for(r.prompt_tokens + r.output_tokens, bs) for r in d.waiting
        )
        seen["waiting_loads"] += 1

    cluster._route_decode = checked  # type: ignore[method-assign]
    cluster.run()
    assert seen["admitted"] > 100
    assert seen["waited"] > 10  # the test saw heads wait
    assert cluster.metrics.completed > 100
