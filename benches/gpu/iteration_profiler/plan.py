"""The plan of a profile run: the options, the compositions (iteration shapes) to time, and the
seeded plan that picks them, sized to the GPU's memory and to the time budget by a roofline
estimate of each. Pure Python: the dry run imports no torch.

The model and GPU figures are `evolving_infra.timing.specs`' (loaded from the checkout), plus a
`tiny` model for CPU smoke runs; the byte counts below are those of what the profile allocates.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from iteration_profiler.tree import timing_module

if TYPE_CHECKING:
    from evolving_infra.timing import specs
    from evolving_infra.timing.specs import GpuSpec, ModelConfig
else:
    specs = timing_module("specs")

PHASES = ("prefill-single", "prefill-batch", "decode")
# Share of the budget each phase is planned with; what one leaves unused goes to the others.
PHASE_SHARE = {"prefill-single": 0.5, "prefill-batch": 0.2, "decode": 0.3}
GiB = 1 << 30

# ---------------------------------------------------------------------------------------------
# Model and GPU figures

TINY = specs.ModelConfig("tiny", 2, 256, 4, 2, 64, 512, 1024)


def models() -> dict[str, ModelConfig]:
    """The models the profile can build: dense GQA ones (its torch layers have neither experts
    nor latent attention, so a mixture of experts would be profiled as the wrong model)."""
    dense = {k: m for k, m in specs.MODELS.items() if not m.experts and not m.kv_lora_rank}
    return {**dense, "tiny": TINY}


def gpus() -> dict[str, GpuSpec]:
    return dict(specs.GPUS)


def weight_bytes(arch: ModelConfig, layers: int, dtype_bytes: int = 2) -> int:
    """Every weight tensor the profile allocates: `layers` layers, embedding, LM head and norms
    (`ModelConfig.weight_bytes` counts what an iteration reads, over all layers)."""
    per_layer = arch.linear_params_per_layer + 2 * arch.hidden
    return (layers * per_layer + 2 * arch.vocab * arch.hidden + arch.hidden) * dtype_bytes


def kv_bytes_per_token(arch: ModelConfig, layers: int, dtype_bytes: int = 2) -> int:
    """K and V of one token over `layers` layers."""
    return 2 * layers * arch.kv_heads * arch.head_dim * dtype_bytes


def activation_bytes_per_token(arch: ModelConfig, dtype_bytes: int = 2) -> int:
    """Live activations of one token in one layer (the peak, roughly, with fp32 norms)."""
    qkv = (arch.heads + 2 * arch.kv_heads) * arch.head_dim
    widths = 4 * arch.hidden + 2 * qkv + 2 * arch.heads * arch.head_dim
    return widths * dtype_bytes + 2 * arch.hidden * 4 + 4 * arch.intermediate * dtype_bytes


# ---------------------------------------------------------------------------------------------
# Options


@dataclass(frozen=True, slots=True)
class Limits:
    """The grids' upper ends; the tiny model has its own so it runs on a CPU."""

    max_uncached: int = 32768
    max_cached: int = 131072
    max_batch: int = 256
    max_context: int = 32768
    max_batch_requests: int = 16


_LIMITS = {"tiny": Limits(512, 2048, 16, 1024, 8)}


@dataclass(frozen=True, slots=True)
class Options:
    model: str = "llama-3-8b"
    layers: int | None = None
    quick: bool = False
    seed: int = 0
    budget_s: float | None = None
    warmup: int | None = None
    repeats: int | None = None
    slow_s: float = 1.0
    gpu: str = "h200-sxm"
    memory_gb: float | None = None
    batches: int | None = None
    decode_random: int | None = None
    decode_groups: int = 4
    cuda_graph: bool = True
    max_uncached: int | None = None
    max_cached: int | None = None
    max_batch: int | None = None
    max_context: int | None = None

    @property
    def budget(self) -> float:
        if self.budget_s is not None:
            return self.budget_s
        return 100.0 if self.quick else 480.0

    @property
    def warmups(self) -> int:
        return self.warmup if self.warmup is not None else (1 if self.quick else 2)

    @property
    def runs(self) -> int:
        return self.repeats if self.repeats is not None else (3 if self.quick else 5)

    @property
    def batch_count(self) -> int:
        return self.batches if self.batches is not None else (12 if self.quick else 48)

    @property
    def decode_random_count(self) -> int:
        if self.decode_random is not None:
            return self.decode_random
        return 4 if self.quick else 16

    def limits(self) -> Limits:
        base = _LIMITS.get(self.model, Limits())
        return Limits(
            self.max_uncached or base.max_uncached,
            self.max_cached if self.max_cached is not None else base.max_cached,
            self.max_batch or base.max_batch,
            self.max_context or base.max_context,
            base.max_batch_requests,
        )


# ---------------------------------------------------------------------------------------------
# Compositions and the plan


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Requests `first .. first+count-1` (contexts sorted ascending) laid out as `count` slots of
    `length` KV positions from pool position `offset`; `masked` when their lengths differ."""

    first: int
    count: int
    length: int
    offset: int
    masked: bool


def decode_groups(contexts: Sequence[int], groups: int) -> list[DecodeGroup]:
    """The padded layout of the SDPA decode path: sorted requests in `groups` near-equal chunks,
    each padded to its longest (request j attends to its `contexts[j] + 1` keys)."""
    n = len(contexts)
    groups = max(1, min(groups, n))
    out: list[DecodeGroup] = []
    offset = first = 0
    for g in range(groups):
        count = n * (g + 1) // groups - first
        lengths = [c + 1 for c in contexts[first : first + count]]
        masked = min(lengths) != max(lengths)
        length = -(-max(lengths) // 16) * 16 if masked else max(lengths)
        out.append(DecodeGroup(first, count, length, offset, masked))
        offset += count * length
        first += count
    return out


@dataclass(frozen=True, slots=True)
class Composition:
    """One iteration shape to time. Prefill: `batch` of (uncached, cached) per request. Decode:
    `contexts` (sorted), the KV tokens each request holds before its new token."""

    phase: str  # "prefill" | "decode"
    group: str  # one of PHASES
    level: int  # 0: on the coarse (quick) grid, 1: the rest of the grid, 2: drawn
    batch: tuple[tuple[int, int], ...] = ()
    contexts: tuple[int, ...] = ()
    kv_tokens: int = 0  # KV pool positions the layout uses (the padded decode layout's)
    estimate_s: float = 0.0  # one iteration, planning roofline
    warmup: int = 0
    repeats: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.batch) if self.phase == "prefill" else len(self.contexts)

    @property
    def context_tokens(self) -> int:
        return sum(self.contexts)

    @property
    def new_tokens(self) -> int:
        return sum(u for u, _ in self.batch) if self.phase == "prefill" else len(self.contexts)

    @property
    def max_position(self) -> int:
        if self.phase == "prefill":
            return max(u + c for u, c in self.batch)
        return max(self.contexts) + 1

    def label(self) -> str:
        if self.phase == "prefill":
            if len(self.batch) == 1:
                u, c = self.batch[0]
                return f"prefill t_uc={u} t_c={c}"
            u = sum(b[0] for b in self.batch)
            c = sum(b[1] for b in self.batch)
            return f"prefill {len(self.batch)} requests, t_uc={u} t_c={c} in all"
        b, ctx = self.batch_size, self.context_tokens
        return f"decode B={b} C={ctx} (~{ctx // b} a request)"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"phase": self.phase, "group": self.group}
        if self.phase == "prefill":
            out["batch"] = [list(p) for p in self.batch]
        else:
            out["batch_size"] = self.batch_size
            out["context_tokens"] = self.context_tokens
            out["contexts"] = list(self.contexts)
        out["estimate_s"] = self.estimate_s
        return out


@dataclass(slots=True)
class Plan:
    options: Options
    arch: ModelConfig
    layers: int
    gpu: GpuSpec
    memory_bytes: float
    kv_capacity_tokens: int
    compositions: list[Composition]  # in run order
    candidates: dict[str, int] = field(default_factory=dict)
    over_memory: dict[str, int] = field(default_factory=dict)
    over_budget: dict[str, int] = field(default_factory=dict)

    def count(self, group: str) -> int:
        return sum(c.group == group for c in self.compositions)

    @property
    def estimate_s(self) -> float:
        return sum(composition_cost(c, self.options) for c in self.compositions)

    @property
    def max_kv_tokens(self) -> int:
        return max((c.kv_tokens for c in self.compositions), default=0)

    @property
    def max_positions(self) -> int:
        return max((c.max_position for c in self.compositions), default=1)

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.arch.name,
            "layers": self.layers,
            "full_layers": self.arch.layers,
            "planning_gpu": self.gpu.name,
            "memory_bytes": self.memory_bytes,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "counts": {g: self.count(g) for g in PHASES},
            "candidates": self.candidates,
            "over_memory": self.over_memory,
            "over_budget": self.over_budget,
            "total": len(self.compositions),
            "estimate_s": round(self.estimate_s, 1),
            "budget_s": self.options.budget,
            "seed": self.options.seed,
            "quick": self.options.quick,
            "warmup": self.options.warmups,
            "repeats": self.options.runs,
        }


class PlanError(ValueError):
    """Options that make no plan (a model that does not fit, a bad layer count)."""


def _pow2(lo: int, hi: int) -> list[int]:
    out, v = [], 1
    while v <= hi:
        if v >= lo:
            out.append(v)
        v *= 2
    return out


def _fit_total(values: list[int], total: int, floor: int = 16) -> list[int]:
    """`values` scaled down to add up to at most `total`, none below `floor` (where it can)."""
    if sum(values) <= total:
        return values
    out = [max(floor, v * total // sum(values)) for v in values]
    excess = sum(out) - total
    for i in sorted(range(len(out)), key=lambda i: -out[i]):
        take = min(excess, out[i] - floor)
        out[i] -= take
        excess -= take
    return out


def _coarse(grid: Sequence[int]) -> set[int]:
    """Every other point of a log2 grid, from its top end down (4x steps, the largest kept)."""
    return set(grid[::-1][::2])


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def split_contexts(total: int, n: int, rng: random.Random) -> tuple[int, ...]:
    """`n` per-request contexts (>= 1 each, log-normal spread) that add up to `total`, sorted."""
    if n == 1:
        return (total,)
    weights = [rng.lognormvariate(0.0, 0.5) for _ in range(n)]
    scale = (total - n) / sum(weights)
    parts = [1 + math.floor(w * scale) for w in weights]
    for i in rng.sample(range(n), total - sum(parts)):
        parts[i] += 1
    return tuple(sorted(parts))


ESTIMATE_FLOPS_EFFICIENCY = 0.55
ESTIMATE_BANDWIDTH_EFFICIENCY = 0.75
LAUNCH_S = 5e-6  # one eager kernel launch (PyTorch dispatch included)
GRAPH_LAUNCH_S = 1.5e-6  # one kernel inside a CUDA graph
KERNELS_PER_LAYER = 30
SETUP_S = 0.05  # building a composition's inputs, per composition


def estimate_seconds(
    arch: ModelConfig,
    layers: int,
    gpu: GpuSpec,
    comp: Composition,
    attention_calls: int,
    graph: bool,
) -> float:
    """A roofline guess of one iteration on the planning GPU: max(compute, memory) + launches."""
    t = comp.new_tokens
    seqs = comp.batch_size
    if comp.phase == "prefill":
        pairs = sum(u * c + u * (u + 1) // 2 for u, c in comp.batch)
        kv_read = sum(u + c for u, c in comp.batch)
    else:
        pairs = comp.context_tokens + seqs
        kv_read = comp.kv_tokens
    flops = 2 * arch.linear_params_per_layer * layers * t + 2 * arch.hidden * arch.vocab * seqs
    flops += 4 * layers * arch.heads * arch.head_dim * pairs
    weights = weight_bytes(arch, layers) - arch.vocab * arch.hidden * 2  # the embedding: lookups
    traffic = weights + kv_read * kv_bytes_per_token(arch, layers)
    traffic += t * layers * activation_bytes_per_token(arch)
    compute = flops / (gpu.flops * ESTIMATE_FLOPS_EFFICIENCY)
    memory = traffic / (gpu.hbm_bandwidth * ESTIMATE_BANDWIDTH_EFFICIENCY)
    launch = GRAPH_LAUNCH_S if graph else LAUNCH_S
    return max(compute, memory) + layers * (KERNELS_PER_LAYER + 3 * attention_calls) * launch


def runs_for(estimate_s: float, warmup: int, repeats: int, slow_s: float) -> tuple[int, int]:
    """Warm-up and timed runs: one warm-up for iterations over 0.1 s, at most 3 timed runs for
    iterations over `slow_s` (the median of 3 is still robust; the budget goes further)."""
    w = warmup if estimate_s < 0.1 else min(warmup, 1)
    r = repeats if estimate_s < slow_s else min(repeats, 3)
    return w, r


def composition_cost(comp: Composition, options: Options) -> float:
    """Planned seconds of wall time for one composition: its runs, a graph capture, the set-up."""
    runs = comp.warmup + comp.repeats
    if comp.phase == "decode" and options.cuda_graph:
        runs += 2  # the capture's side-stream warm-up and the captured run
    return runs * comp.estimate_s + SETUP_S


def _usable_memory(memory: float) -> float:
    """What the model, the KV pool and activations may take: 92 %, less 3 GiB for the CUDA
    context, cuBLAS workspaces and the allocator's slack."""
    return 0.92 * memory - 3 * GiB


def make_plan(options: Options) -> Plan:
    """The seeded list of compositions to time, sized to the memory and the budget."""
    all_models = models()
    if options.model not in all_models:
        raise PlanError(f"unknown model {options.model!r}; one of {', '.join(all_models)}")
    arch = all_models[options.model]
    layers = options.layers if options.layers is not None else arch.layers
    if not 1 <= layers <= arch.layers:
        raise PlanError(f"--layers must be 1..{arch.layers} for {arch.name}, got {layers}")
    all_gpus = gpus()
    if options.gpu not in all_gpus:
        raise PlanError(f"unknown GPU {options.gpu!r}; one of {', '.join(all_gpus)}")
    gpu = all_gpus[options.gpu]
    memory = options.memory_gb * 1e9 if options.memory_gb is not None else gpu.memory
    limits = options.limits()
    rng = random.Random(options.seed)

    # Memory: weights, activations of the largest prefill, then the KV pool gets the rest.
    act = limits.max_uncached * activation_bytes_per_token(arch) + 64 * arch.vocab * 4
    free = _usable_memory(memory) - weight_bytes(arch, layers) - act
    per_token = kv_bytes_per_token(arch, layers)
    if free < 4096 * per_token:
        # The most layers that leave a KV pool of 256k tokens.
        per_layer = weight_bytes(arch, 1) - weight_bytes(arch, 0) + 262144 * (per_token // layers)
        fit = int((_usable_memory(memory) - weight_bytes(arch, 0) - act) // per_layer)
        raise PlanError(
            f"{arch.name} with {layers} layers does not fit {memory / 1e9:.0f} GB "
            f"(weights {weight_bytes(arch, layers) / 1e9:.1f} GB): try --layers {max(1, fit)}"
        )
    capacity = int(free // per_token)

    def prefill(batch: Sequence[tuple[int, int]], group: str, level: int) -> Composition:
        comp = Composition(
            "prefill", group, level, batch=tuple(batch), kv_tokens=sum(u + c for u, c in batch)
        )
        return _finish(comp, len(batch))

    def decode(contexts: tuple[int, ...], level: int) -> Composition:
        layout = decode_groups(contexts, options.decode_groups)
        kv = layout[-1].offset + layout[-1].count * layout[-1].length
        comp = Composition("decode", "decode", level, contexts=contexts, kv_tokens=kv)
        return _finish(comp, len(layout))

    def _finish(comp: Composition, attention_calls: int) -> Composition:
        graph = comp.phase == "decode" and options.cuda_graph
        est = estimate_seconds(arch, layers, gpu, comp, attention_calls, graph)
        w, r = runs_for(est, options.warmups, options.runs, options.slow_s)
        return Composition(
            comp.phase,
            comp.group,
            comp.level,
            comp.batch,
            comp.contexts,
            comp.kv_tokens,
            est,
            w,
            r,
        )

    candidates: dict[str, list[Composition]] = {g: [] for g in PHASES}

    # Prefill, single requests: t_uc x t_c on log2 grids; the coarse grid steps by 4x.
    uncached, cached = _pow2(16, limits.max_uncached), _pow2(128, limits.max_cached)
    coarse = _coarse(uncached) | _coarse(cached) | {0}
    for u in uncached:
        for c in [0, *cached]:
            level = 0 if u in coarse and c in coarse else 1
            if options.quick and level:
                continue
            candidates["prefill-single"].append(prefill([(u, c)], "prefill-single", level))

    # Prefill, batches of 2..16 requests of mixed sizes (a third without a cached prefix).
    max_u = min(8192, limits.max_uncached)
    for _ in range(options.batch_count):
        n = rng.randint(2, max(2, min(limits.max_batch_requests, limits.max_uncached // 16)))
        us = _fit_total([_log_uniform(rng, 16, max_u) for _ in range(n)], limits.max_uncached)
        max_c = max(128, limits.max_cached // 2)
        cs = [0 if rng.random() < 0.3 else _log_uniform(rng, 128, max_c) for _ in range(n)]
        candidates["prefill-batch"].append(
            prefill(list(zip(us, cs, strict=True)), "prefill-batch", 2)
        )

    # Decode: B x context per request on log2 grids, then drawn off-grid points.
    sizes, contexts = _pow2(1, limits.max_batch), _pow2(256, limits.max_context)
    coarse_b, coarse_ctx = _coarse(sizes), _coarse(contexts)
    for b in sizes:
        for ctx in contexts:
            level = 0 if b in coarse_b and ctx in coarse_ctx else 1
            if options.quick and level:
                continue
            candidates["decode"].append(decode(split_contexts(b * ctx, b, rng), level))
    for _ in range(options.decode_random_count):
        b = _log_uniform(rng, 1, limits.max_batch)
        ctx = _log_uniform(rng, 256, limits.max_context)
        candidates["decode"].append(decode(split_contexts(b * ctx, b, rng), 2))

    # Memory, then the budget: each phase its share, coarse grid first, the rest shuffled
    # (seeded); what a phase leaves goes to the compositions the others could not fit.
    over_memory = {g: 0 for g in PHASES}
    fitting: dict[str, list[Composition]] = {}
    for g in PHASES:
        keep = [comp for comp in candidates[g] if comp.kv_tokens <= capacity]
        over_memory[g] = len(candidates[g]) - len(keep)
        by_level: list[Composition] = []
        for level in (0, 1, 2):
            tier = [comp for comp in keep if comp.level == level]
            rng.shuffle(tier)
            by_level.extend(tier)
        fitting[g] = by_level
    chosen: dict[str, list[Composition]] = {g: [] for g in PHASES}
    left: list[Composition] = []
    spent = 0.0
    for g in PHASES:
        share, used = options.budget * PHASE_SHARE[g], 0.0
        for comp in fitting[g]:
            cost = composition_cost(comp, options)
            if used + cost <= share:
                chosen[g].append(comp)
                used += cost
            else:
                left.append(comp)
        spent += used
    for comp in sorted(left, key=lambda comp: comp.level):
        cost = composition_cost(comp, options)
        if spent + cost <= options.budget:
            chosen[comp.group].append(comp)
            spent += cost
    over_budget = {g: len(fitting[g]) - len(chosen[g]) for g in PHASES}

    return Plan(
        options,
        arch,
        layers,
        gpu,
        memory,
        capacity,
        _interleave(chosen, options),
        candidates={g: len(candidates[g]) for g in PHASES},
        over_memory=over_memory,
        over_budget=over_budget,
    )


def _interleave(chosen: dict[str, list[Composition]], options: Options) -> list[Composition]:
    """Run order: the phases side by side, each advancing at the pace of its planned time, so a
    run cut short by the budget still has some of every phase."""
    totals = {g: sum(composition_cost(c, options) for c in cs) or 1.0 for g, cs in chosen.items()}
    done = dict.fromkeys(chosen, 0.0)
    index = dict.fromkeys(chosen, 0)
    out: list[Composition] = []
    while True:
        open_groups = [g for g in PHASES if index[g] < len(chosen[g])]
        if not open_groups:
            return out
        g = min(open_groups, key=lambda g: (done[g] / totals[g], PHASES.index(g)))
        c = chosen[g][index[g]]
        out.append(c)
        index[g] += 1
        done[g] += composition_cost(c, options)


def describe_plan(plan: Plan, first: int = 8) -> str:
    o, a = plan.options, plan.arch
    lines = [
        f"iteration_profile plan ({'quick' if o.quick else 'default'} run, seed {o.seed}): "
        f"{a.name}, {plan.layers} of {a.layers} layers, bf16",
        f"  planning GPU {plan.gpu.name}, {plan.memory_bytes / 1e9:.0f} GB: weights "
        f"{weight_bytes(a, plan.layers) / 1e9:.1f} GB, KV pool up to "
        f"{plan.kv_capacity_tokens:,} tokens ({kv_bytes_per_token(a, plan.layers) // 1024} KiB "
        "each)",
    ]
    for g in PHASES:
        est = sum(composition_cost(c, o) for c in plan.compositions if c.group == g)
        lines.append(
            f"  {g:<15} {plan.count(g):4d} of {plan.candidates[g]:4d} candidates "
            f"({plan.over_memory[g]} over memory, {plan.over_budget[g]} over budget), "
            f"est {est:6.1f} s"
        )
    lines.append(
        f"  total           {len(plan.compositions):4d} compositions, estimated "
        f"{plan.estimate_s:.0f} s of measurement (budget {o.budget:.0f} s; warm-up {o.warmups}, "
        f"median of {o.runs}) + start-up"
    )
    lines.append("  first compositions:")
    for c in plan.compositions[:first]:
        lines.append(f"    {c.label():<48} est {c.estimate_s * 1e3:9.2f} ms")
    counts = " ".join(f"{g}={plan.count(g)}" for g in PHASES)
    lines.append(
        f"plan: {counts} total={len(plan.compositions)} estimate_s={plan.estimate_s:.1f} "
        f"budget_s={o.budget:.1f}"
    )
    return "\n".join(lines)
