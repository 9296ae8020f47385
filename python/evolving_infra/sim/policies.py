"""The policies a run compares (docs/simulator.md, "Policies"): routing, planner and KV handling.

| name | router | planner | eviction | shared pool | prefetch | decode-KV admission |
|---|---|---|---|---|---|---|
| `evolving` | `routing.evolving` | `planner.evolving` | branch-aware | yes | yes | yes |
| `dynamo` | `routing.dynamo` | `planner.dynamo`, target `throughput` | LRU | no | no | no |
| `dynamo-load` | as `dynamo` | `planner.dynamo`, the SLA loop | LRU | no | no | no |
| `dynamo-hicache` | `routing.dynamo`, shared x 0.5 | as `dynamo` | LRU | yes | no | no |
| `arrow` | `routing.least_loaded` | `planner.arrow` | LRU | yes | no | no |
| `static:xPyD` | as `evolving` | none (fixed split) | as `evolving` |  |  |  |

The ablations (`ABLATIONS`): `evolving` with one of the paper's mechanisms switched off, the rest
kept: `evolving-lru` (LRU eviction instead of branch-aware), `evolving-dynamo-cost` (Dynamo's
router cost instead of TTFT balancing, shared hits credited x 0.5 as the pool exists),
`evolving-no-pool` (no shared pool, no prefetch: a node reads only its own L1 and L2),
`evolving-drop` (switches lose the node's KV, as Arrow's do) and `evolving-fixed` (no planner:
the start split all run).

`best-static` is not a policy but a comparison: every split run as `static` (`run.compare`);
`best-dynamo-static`, `best-dynamo-hicache-static` and `best-arrow-static` the same on Dynamo's
(without and with HiCache) and Arrow's infrastructure (`dynamo-static:xPyD`, ...: their
routing, eviction and pool, no planner).

The switch mode comes with the planner (`Planner.switch_mode`). Policy classes are imported
inside the factories: the simulator imports without them, and a test may hand in its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from evolving_infra.planner.base import Planner, Split
from evolving_infra.routing.base import Router
from evolving_infra.sim.config import SimConfig
from evolving_infra.timing.model import IterationModel

Eviction = Literal["branch-aware", "lru"]


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a factory may build a router or planner from."""

    nodes: int
    block_size: int
    config: SimConfig
    model: IterationModel  # the cluster's fitted iteration model (the policies' view)


RouterFactory = Callable[[PolicyContext], Router]
PlannerFactory = Callable[[PolicyContext], Planner]


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """One policy: its router and planner factories and how it treats KV.

    - `eviction`: the directory's order is branch-aware exactly when branches are registered,
      so `branch-aware` requires `branch_counts` and `lru` forbids it;
    - `shared_pool`: a prefill may read blocks any node holds (another node's L1 over the
      network, any L2: the pool); without it only its own L1 and L2;
    - `prefetch`: blocks outside L1 are fetched while the request waits in the prefill queue;
    - `split`: the starting split (None: `SimConfig.split()`); `planner` None keeps it;
    - `admission`: the router dispatches a request only once a decode node has room for its KV
      (the live router's decode-KV gate, `router.admission`). Under early decode allocation its
      decode node then reserves first and its prefill node is chosen once it has; without the
      gate both are chosen at dispatch (SGLang's gateway, Dynamo's router) and the prefill
      node holds the request until its decode node has reserved (`Node.hold`). Under
      `prefill_complete` allocation it changes nothing.
    """

    name: str
    router: RouterFactory
    planner: PlannerFactory | None
    eviction: Eviction
    shared_pool: bool
    prefetch: bool
    branch_counts: bool
    split: Split | None = None
    admission: bool = False

    def __post_init__(self) -> None:
        if (self.eviction == "branch-aware") != self.branch_counts:
            raise ValueError(
                f"policy {self.name!r}: eviction {self.eviction!r} with branch_counts="
                f"{self.branch_counts}: the directory's order counts branches exactly when they"
                " are registered"
            )


def _evolving_router(ctx: PolicyContext) -> Router:
    from evolving_infra.routing.evolving import EvolvingRouter

    c = ctx.config
    return EvolvingRouter(
        ctx.model,
        block_size=ctx.block_size,
        kv_bytes_per_token=c.kv_bytes_per_token,
        l2_bandwidth=c.l2_bandwidth,
        pool_bandwidth=c.pool_bandwidth,
    )


def _dynamo_router(ctx: PolicyContext) -> Router:
    from evolving_infra.routing.dynamo import DynamoRouter

    # Ties are drawn at random (Dynamo's temperature 0), from the run's seed.
    return DynamoRouter(block_size=ctx.block_size, seed=ctx.config.seed)


def _dynamo_hicache_router(ctx: PolicyContext) -> Router:
    from evolving_infra.routing.dynamo import DynamoRouter

    # `--shared-cache-type hicache`: shared blocks beyond the worker's own earn x 0.5.
    return DynamoRouter(block_size=ctx.block_size, count_shared_cache=True, seed=ctx.config.seed)


def _least_loaded_router(ctx: PolicyContext) -> Router:
    from evolving_infra.routing.least_loaded import LeastLoadedRouter

    return LeastLoadedRouter(block_size=ctx.block_size)


def _evolving_planner(ctx: PolicyContext) -> Planner:
    from evolving_infra.planner.evolving import EvolvingPlanner

    return EvolvingPlanner(
        ctx.nodes,
        chunk_tokens=ctx.config.chunk_tokens,
        early_allocation=ctx.config.decode_allocation == "early",
        **ctx.config.evolving_options,
    )


def _dynamo_planner(ctx: PolicyContext) -> Planner:
    from evolving_infra.planner.dynamo import DynamoPlanner

    return DynamoPlanner(
        context_length=ctx.config.deployment.model.context_length,
        chunk_tokens=ctx.config.chunk_tokens,
    )


def _dynamo_load_planner(ctx: PolicyContext) -> Planner:
    from evolving_infra.planner.dynamo import DynamoPlanner

    return DynamoPlanner(mode="load", chunk_tokens=ctx.config.chunk_tokens)


def _arrow_planner(ctx: PolicyContext) -> Planner:
    from evolving_infra.planner.arrow import ArrowPlanner

    return ArrowPlanner(chunk_tokens=ctx.config.chunk_tokens)


def parse_split(text: str) -> Split:
    """'3P5D' -> Split(3, 5)."""
    from evolving_infra.planner.static import parse_split as parse

    return parse(text)


def static(split: Split, name: str | None = None) -> PolicySpec:
    """`static:xPyD`: the evolving router and KV handling on a fixed split."""

    def planner(ctx: PolicyContext) -> Planner:
        from evolving_infra.planner.static import StaticPlanner

        return StaticPlanner(split)

    return PolicySpec(
        name=name or f"static:{split}",
        router=_evolving_router,
        planner=planner,
        eviction="branch-aware",
        shared_pool=True,
        prefetch=True,
        branch_counts=True,
        split=split,
        admission=True,
    )


EVOLVING = PolicySpec(
    "evolving",
    _evolving_router,
    _evolving_planner,
    "branch-aware",
    True,
    True,
    True,
    admission=True,
)
DYNAMO = PolicySpec("dynamo", _dynamo_router, _dynamo_planner, "lru", False, False, False)
DYNAMO_LOAD = replace(DYNAMO, name="dynamo-load", planner=_dynamo_load_planner)
# Dynamo with SGLang's HiCache and a Mooncake store, as Dynamo's HiCache guide deploys it (opt-in,
# docs/baselines.md §4): every worker reads blocks any worker stored (the simulator's shared
# pool: with HiCache's write-through policy what one worker caches is in the store), and the
# router credits them.
DYNAMO_HICACHE = replace(
    DYNAMO, name="dynamo-hicache", router=_dynamo_hicache_router, shared_pool=True
)
ARROW = PolicySpec("arrow", _least_loaded_router, _arrow_planner, "lru", True, False, False)


def _dropping_planner(ctx: PolicyContext) -> Planner:
    planner = _evolving_planner(ctx)
    planner.switch_mode = "in-place-drop"
    return planner


ABLATIONS = (
    replace(EVOLVING, name="evolving-lru", eviction="lru", branch_counts=False),
    replace(EVOLVING, name="evolving-dynamo-cost", router=_dynamo_hicache_router),
    replace(EVOLVING, name="evolving-no-pool", shared_pool=False, prefetch=False),
    replace(EVOLVING, name="evolving-drop", planner=_dropping_planner),
    replace(EVOLVING, name="evolving-fixed", planner=None),
)
NAMED = {p.name: p for p in (EVOLVING, DYNAMO, DYNAMO_LOAD, DYNAMO_HICACHE, ARROW, *ABLATIONS)}


# A static split on a baseline's own infrastructure (its router, eviction, pool and gate, no
# planner): what that system reaches at its best split, so that the planner's worth and the
# infrastructure's are told apart (issue 24). `static:xPyD` is Evolving Infra's.
STATIC_ON = {
    "static": None,
    "dynamo-static": DYNAMO,
    "dynamo-hicache-static": DYNAMO_HICACHE,
    "arrow-static": ARROW,
}


# Every split of the cluster on one infrastructure, the best reported (`run.compare`):
# `best-static`, `best-dynamo-static`, ...
SWEEPS = {f"best-{infra}": infra for infra in STATIC_ON}


def static_on(infra: str, split: Split) -> PolicySpec:
    """`static:xPyD` (ours), `dynamo-static:xPyD` or `arrow-static:xPyD`."""
    base = STATIC_ON[infra]
    if base is None:
        return static(split)
    return replace(base, name=f"{infra}:{split}", planner=None, split=split)


def policy(name: str, nodes: int) -> PolicySpec:
    """The named policy (`evolving`, `dynamo`, `dynamo-load`, `arrow`, or a static split on an
    infrastructure, `static:xPyD`, `dynamo-static:xPyD`, `arrow-static:xPyD`, on `nodes`)."""
    infra, sep, text = name.partition(":")
    if sep and infra in STATIC_ON:
        split = parse_split(text)
        if split.prefill + split.decode != nodes or split.prefill < 1 or split.decode < 1:
            raise ValueError(f"{name} is not a split of {nodes} nodes with both phases")
        return static_on(infra, split)
    if name not in NAMED:
        known = ", ".join([*NAMED, *(f"{i}:xPyD" for i in STATIC_ON), *SWEEPS])
        raise ValueError(f"unknown policy {name!r} (known: {known})")
    return NAMED[name]


def static_splits(nodes: int) -> list[Split]:
    """Every split with both phases: what `best-static` runs."""
    return [Split(p, nodes - p) for p in range(1, nodes)]
