"""The request record the node mechanics work on (`node.Node`, `kv.NodeKv`): one request of an
agent's branch, its prompt's blocks, and every time and place it got on its way through a node.
The simulator's replay (`sim/agents.py`) and the simulated engine (`engines/sim/requests.py`)
make them; both drivers read the times back.
"""

from __future__ import annotations

from evolving_infra.workloads.model import Agent, Branch, Request


class SimRequest:
    """One request as it goes through the cluster: its prompt and every time and place it got.

    A plain slotted class rather than a dataclass: the simulator touches these fields on every
    event, and a request's node-side bookkeeping (pinned and reserved blocks per node) lives
    here so that releasing it cannot drift from what was taken.
    """

    __slots__ = (
        "agent",
        "bootstrapped",
        "branch",
        "cached_blocks",
        "context",
        "credit",
        "decode_node",
        "done",
        "fetch_ready",
        "first_token",
        "h_d",
        "hashes",
        "id",
        "index",
        "issued",
        "key",
        "left",
        "made",
        "out_hashes",
        "output_tokens",
        "pin_d",
        "pin_p",
        "pred_s",
        "prefetched",
        "prefill_done",
        "prefill_node",
        "prompt_tokens",
        "ready_floor",
        "remaining",
        "res_d",
        "res_p",
        "spec",
        "uncached",
    )

    def __init__(
        self, rid: int, agent: Agent, branch: Branch, index: int, hashes: list[int]
    ) -> None:
        spec = branch.requests[index]
        self.id = rid
        self.agent = agent
        self.branch = branch
        self.index = index
        self.spec: Request = spec
        self.key = f"{agent.id}/{branch.id}"  # the directory's branch id
        self.hashes = hashes
        self.prompt_tokens = spec.prompt_tokens
        self.output_tokens = spec.output_tokens
        self.issued = -1.0  # when it became ready (-1: not yet)
        self.prefill_node = self.decode_node = -1
        # Prefill: cached prefix (blocks), uncached tokens, those still to compute, the
        # predicted seconds it added to its node's queue, when its fetched blocks are in L1.
        self.cached_blocks = 0
        self.uncached = self.remaining = 0
        self.pred_s = 0.0
        self.fetch_ready = 0.0
        # The earliest its prefill may start: blocks it counts as cached that a move begun
        # from outside the node model is still bringing in (the live engine's TransferKV
        # answered when started, `engines/sim/service.py`). The simulator leaves it at 0.
        self.ready_floor = 0.0
        self.prefetched = False
        # Early decode allocation: its decode node has reserved its KV (the prefill may run).
        self.bootstrapped = False
        # Blocks pinned and reserved on the prefill and decode nodes; the decode node's own
        # leading L1 blocks of the prompt when the transfer started.
        self.pin_p = self.res_p = self.pin_d = self.res_d = self.h_d = 0
        self.prefill_done = self.first_token = self.done = -1.0
        self.context = 0  # tokens of KV while decoding
        self.left = 0  # tokens still to decode
        self.credit = 0.0  # a fraction of a token gained (multi-token prediction)
        self.made = 0  # tokens the last decode span gave it
        self.out_hashes: list[int] = []

    def __repr__(self) -> str:
        return f"SimRequest({self.id}, {self.key}#{self.index})"
