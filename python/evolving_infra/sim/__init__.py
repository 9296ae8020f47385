"""The cluster simulator (docs/simulator.md): policies compared on a simulated PD cluster.

Modules, one purpose each: `config` (parameters and capacities), `agents` (the closed-loop
replay of a trace), `kv` (a node's KV accounting mirrored in the shared `KvDirectory`), `node`
(chunked prefill iterations, decode spans), `planning` (slices for the planner, phase
switches), `cluster` (the event loop, routing, transfers), `policies` (named policy specs),
`metrics`, `run` (`simulate`, `compare`), `plots` and `command` (`evolving-infra sim`).
"""

from evolving_infra.sim.config import SimConfig
from evolving_infra.sim.policies import PolicyContext, PolicySpec, policy, static
from evolving_infra.sim.run import BEST_STATIC, Result, compare, simulate

__all__ = [
    "BEST_STATIC",
    "PolicyContext",
    "PolicySpec",
    "Result",
    "SimConfig",
    "compare",
    "policy",
    "simulate",
    "static",
]
