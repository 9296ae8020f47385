#!/usr/bin/env python3
"""Measure real LLM iteration times on one GPU, as samples the iteration-time model learns from.

What it measures: the wall time of one engine iteration (a forward pass) of a Llama-architecture
model with RANDOM weights in bf16, built from plain torch ops (embedding, RMSNorm, fused QKV and
O linears, RoPE, GQA attention, SwiGLU MLP, LM head), on one GPU, no tensor parallelism:

- prefill: a batch of requests, each `(uncached, cached)` tokens: it computes the `uncached`
  tokens now and attends to a `cached` prefix already in a preallocated KV pool. Query positions
  t_c .. t_c+t_uc-1 attend to every cached key and causally to the new ones. The LM head runs on
  the last position of each request. Single requests on a log-spaced grid (t_uc 16..32k x t_c
  0..128k, within memory) and seeded batches of 2-16 requests of mixed sizes.
- decode: B requests, one new token each, over their contexts (per-request context lengths drawn
  so that they add up to C); the LM head runs on every token. B 1..256 x context per request
  256..32k (within memory), plus seeded off-grid points. Decode runs as a CUDA graph when it can
  be captured (as serving engines do), else eagerly; the JSON sidecar says which.

Batching: the linears run on the packed tokens of all requests (no padding). Attention uses
flash-attn's varlen kernel when `flash_attn` is importable (exact, one call a layer); otherwise
`torch.nn.functional.scaled_dot_product_attention`: prefill loops over the requests (one call per
request a layer, with a lower-right causal mask so the new tokens see the whole prefix), decode
pads requests of similar length into a few groups (`--decode-groups`) with a key-padding mask.
The backend is chosen by a correctness probe at start-up against a float32 reference.

Timing: CUDA events around each iteration, `torch.cuda.synchronize` between, warm-up iterations
first, the median of `--repeats` runs per composition. Compositions that run out of memory are
skipped and logged. The run is bounded by `--budget-s` (the plan is sized to it from a roofline
estimate, and the run stops when the budget is spent), so a default run fits a 10-minute slot.

Run it on a machine with an NVIDIA GPU and torch (flash-attn optional):

    python benches/gpu/iteration_profile.py --out benches/gpu/data/h200-llama3-8b.csv
    python benches/gpu/iteration_profile.py --quick --out /tmp/quick.csv          # ~2 minutes
    python benches/gpu/iteration_profile.py --model llama-3-70b --layers 20 --out ...
    python benches/gpu/iteration_profile.py --dry-run                    # the plan; no torch
    python benches/gpu/iteration_profile.py --device cpu --model tiny --quick --out /tmp/t.csv

The CSV is exactly `evolving_infra.timing.samples.write_csv`'s format (columns phase, seconds,
batch, batch_size, context_tokens); a sidecar FILE.json beside it holds the metadata (GPU, torch
and CUDA versions, model config and the layer count measured, dtype, date, repeats, attention
backend, per-sample runs, skipped compositions). With `--layers` the times are for that many
layers: consumers scale by `layers` / `full_layers` from the sidecar. Results are committed as
data under `benches/gpu/data/` and feed `evolving-infra model eval --data CSV`.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

# The repository's python/ folder, so that `evolving_infra.timing` imports without installing.
_REPO_PYTHON = Path(__file__).resolve().parents[2] / "python"
if _REPO_PYTHON.is_dir() and str(_REPO_PYTHON) not in sys.path:
    sys.path.insert(0, str(_REPO_PYTHON))

CSV_COLUMNS = ("phase", "seconds", "batch", "batch_size", "context_tokens")
PHASES = ("prefill-single", "prefill-batch", "decode")
# Share of the budget each phase is planned with; what one leaves unused goes to the others.
PHASE_SHARE = {"prefill-single": 0.5, "prefill-batch": 0.2, "decode": 0.3}
GiB = 1 << 30


def _timing_module(name: str) -> ModuleType | None:
    """`evolving_infra.timing.NAME`: the package if it imports (it needs its built native module),
    else the file loaded on its own (samples.py and specs.py need only the standard library)."""
    try:
        return importlib.import_module(f"evolving_infra.timing.{name}")
    except Exception:
        pass
    path = _REPO_PYTHON / "evolving_infra" / "timing" / f"{name}.py"
    module_name = f"_iteration_profile_{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if not path.is_file() or spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[module_name]
        return None
    return module


# ---------------------------------------------------------------------------------------------
# Model and GPU figures


@dataclass(frozen=True, slots=True)
class Arch:
    """A Llama-architecture decoder (GQA attention, SwiGLU MLP); `layers` is the full depth."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def linear_params_per_layer(self) -> int:
        qkvo = 2 * self.hidden * (self.heads + self.kv_heads) * self.head_dim
        return qkvo + 3 * self.hidden * self.intermediate

    def weight_bytes(self, layers: int, dtype_bytes: int = 2) -> int:
        """Every weight tensor the script allocates: layers, embedding, LM head and norms."""
        per_layer = self.linear_params_per_layer + 2 * self.hidden
        return (layers * per_layer + 2 * self.vocab * self.hidden + self.hidden) * dtype_bytes

    def kv_bytes_per_token(self, layers: int, dtype_bytes: int = 2) -> int:
        return 2 * layers * self.kv_heads * self.head_dim * dtype_bytes

    def activation_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Live activations of one token in one layer (the peak, roughly, with fp32 norms)."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        widths = 4 * self.hidden + 2 * qkv + 2 * self.heads * self.head_dim
        return widths * dtype_bytes + 2 * self.hidden * 4 + 4 * self.intermediate * dtype_bytes


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    flops: float  # dense BF16 peak, FLOP/s
    bandwidth: float  # HBM bytes/s
    memory: float  # bytes


# Mirrors of `evolving_infra.timing.specs` (tests check they agree), used only when that module
# cannot be loaded: the script may be copied to a GPU machine on its own.
_FALLBACK_MODELS = {
    "llama-3-70b": Arch("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    "llama-3-8b": Arch("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
}
_FALLBACK_GPUS = {
    "h100-sxm": Gpu("h100-sxm", 989.4e12, 3.35e12, 80e9),
    "h200-sxm": Gpu("h200-sxm", 989.4e12, 4.8e12, 141e9),
    "a100-sxm-80gb": Gpu("a100-sxm-80gb", 312e12, 2.039e12, 80e9),
}
TINY = Arch("tiny", 2, 256, 4, 2, 64, 512, 1024)


def models() -> dict[str, Arch]:
    specs = _timing_module("specs")
    found: dict[str, Arch] = {}
    if specs is not None:
        for name, m in specs.MODELS.items():
            found[name] = Arch(
                name,
                m.layers,
                m.hidden,
                m.heads,
                m.kv_heads,
                m.head_dim,
                m.intermediate,
                m.vocab,
            )
    return {**_FALLBACK_MODELS, **found, "tiny": TINY}


def gpus() -> dict[str, Gpu]:
    specs = _timing_module("specs")
    found: dict[str, Gpu] = {}
    if specs is not None:
        for name, g in specs.GPUS.items():
            found[name] = Gpu(name, g.flops, g.hbm_bandwidth, g.memory)
    return {**_FALLBACK_GPUS, **found}


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
# Compositions and the plan (pure Python: the dry run imports no torch)


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
    arch: Arch
    layers: int
    gpu: Gpu
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
    arch: Arch,
    layers: int,
    gpu: Gpu,
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
    weights = arch.weight_bytes(layers) - arch.vocab * arch.hidden * 2  # the embedding: lookups
    traffic = weights + kv_read * arch.kv_bytes_per_token(layers)
    traffic += t * layers * arch.activation_bytes_per_token()
    compute = flops / (gpu.flops * ESTIMATE_FLOPS_EFFICIENCY)
    memory = traffic / (gpu.bandwidth * ESTIMATE_BANDWIDTH_EFFICIENCY)
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
    act = limits.max_uncached * arch.activation_bytes_per_token() + 64 * arch.vocab * 4
    free = _usable_memory(memory) - arch.weight_bytes(layers) - act
    per_token = arch.kv_bytes_per_token(layers)
    if free < 4096 * per_token:
        # The most layers that leave a KV pool of 256k tokens.
        per_layer = arch.weight_bytes(1) - arch.weight_bytes(0) + 262144 * (per_token // layers)
        fit = int((_usable_memory(memory) - arch.weight_bytes(0) - act) // per_layer)
        raise PlanError(
            f"{arch.name} with {layers} layers does not fit {memory / 1e9:.0f} GB "
            f"(weights {arch.weight_bytes(layers) / 1e9:.1f} GB): try --layers {max(1, fit)}"
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
        f"{a.weight_bytes(plan.layers) / 1e9:.1f} GB, KV pool up to "
        f"{plan.kv_capacity_tokens:,} tokens ({a.kv_bytes_per_token(plan.layers) // 1024} KiB "
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


# ---------------------------------------------------------------------------------------------
# Output


@dataclass(frozen=True, slots=True)
class Measured:
    comp: Composition
    seconds: float
    runs: tuple[float, ...]
    warmup: int
    cuda_graph: bool
    kv_positions: int  # pool positions the layout spans (the padding of decode groups included)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.comp.to_json(),
            "seconds": self.seconds,
            "runs": list(self.runs),
            "warmup": self.warmup,
            "cuda_graph": self.cuda_graph,
            "kv_positions": self.kv_positions,
        }


def write_samples(rows: Sequence[Measured], path: Path) -> None:
    """`samples.write_csv` when the module loads, else the same columns written here."""
    tmp = path.with_name(path.name + ".tmp")
    samples = _timing_module("samples")
    if samples is not None:
        records = [
            samples.Sample("prefill", m.seconds, batch=m.comp.batch)
            if m.comp.phase == "prefill"
            else samples.Sample(
                "decode",
                m.seconds,
                batch_size=m.comp.batch_size,
                context_tokens=m.comp.context_tokens,
            )
            for m in rows
        ]
        samples.write_csv(records, tmp)
    else:
        write_csv_fallback(rows, tmp)
    os.replace(tmp, path)


def write_csv_fallback(rows: Sequence[Measured], path: Path) -> None:
    import csv

    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for m in rows:
            c = m.comp
            batch = json.dumps([list(p) for p in c.batch], separators=(",", ":"))
            size, context = (0, 0) if c.phase == "prefill" else (c.batch_size, c.context_tokens)
            w.writerow([c.phase, repr(m.seconds), batch, size, context])


def sidecar_path(out: Path) -> Path:
    return out.with_suffix(".json")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The torch side: imported only for a real run. Torch objects are typed `Any` so that the script
# type-checks where torch is absent.


def _is_oom(torch: Any, error: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(error, oom):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error)


class Model:
    """Random-weight Llama layers in plain torch ops over a preallocated, token-major KV pool:
    per layer a [2, capacity, kv_heads, head_dim] tensor (K then V)."""

    def __init__(
        self, torch: Any, arch: Arch, layers: int, device: Any, dtype: Any, seed: int
    ) -> None:
        self.torch, self.arch, self.device, self.dtype = torch, arch, device, dtype
        self.nnf = torch.nn.functional
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self.gen = gen

        def weight(*shape: int, std: float) -> Any:
            return torch.empty(*shape, device=device, dtype=dtype).normal_(0.0, std, generator=gen)

        h, d = arch.hidden, arch.head_dim
        q_width, kv_width = arch.heads * d, arch.kv_heads * d
        std = 1.0 / math.sqrt(h)
        self.embed = weight(arch.vocab, h, std=1.0)
        self.layers: list[dict[str, Any]] = []
        for _ in range(layers):
            self.layers.append(
                {
                    "ln1": torch.ones(h, device=device, dtype=dtype),
                    "qkv": weight(q_width + 2 * kv_width, h, std=std),
                    "o": weight(h, q_width, std=1.0 / math.sqrt(q_width)),
                    "ln2": torch.ones(h, device=device, dtype=dtype),
                    "gate_up": weight(2 * arch.intermediate, h, std=std),
                    "down": weight(h, arch.intermediate, std=1.0 / math.sqrt(arch.intermediate)),
                }
            )
        self.ln_f = torch.ones(h, device=device, dtype=dtype)
        self.lm_head = weight(arch.vocab, h, std=std)
        self.splits = [q_width, kv_width, kv_width]
        self.kv: list[Any] = []
        self.capacity = 0
        self.cos: Any = None
        self.sin: Any = None

    def allocate(self, capacity: int, max_positions: int) -> None:
        """The KV pool (random contents) and the RoPE tables (Llama 3's theta)."""
        torch, a = self.torch, self.arch
        self.kv = []
        for _ in self.layers:
            pool = torch.empty(
                2, capacity, a.kv_heads, a.head_dim, device=self.device, dtype=self.dtype
            )
            self.kv.append(pool.normal_(0.0, 1.0, generator=self.gen))
        self.capacity = capacity
        half = a.head_dim // 2
        inv = 1.0 / (500000.0 ** (torch.arange(0, half, device=self.device).float() / half))
        freqs = torch.outer(torch.arange(max_positions, device=self.device).float(), inv)
        self.cos, self.sin = freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)

    def _rms(self, x: Any, w: Any) -> Any:
        xf = x.float()
        xf = xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
        return xf.to(self.dtype) * w

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        x1, x2 = x.chunk(2, dim=-1)
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, step: Step) -> Any:
        """One iteration over the packed new tokens; logits of `step.last` (all when None)."""
        nnf, a = self.nnf, self.arch
        t = step.ids.shape[0]
        cos = self.cos.index_select(0, step.pos).unsqueeze(1)
        sin = self.sin.index_select(0, step.pos).unsqueeze(1)
        h = nnf.embedding(step.ids, self.embed)
        for w, pool in zip(self.layers, self.kv, strict=True):
            x = self._rms(h, w["ln1"])
            q, k, v = nnf.linear(x, w["qkv"]).split(self.splits, dim=-1)
            q = self._rope(q.view(t, a.heads, a.head_dim), cos, sin)
            k = self._rope(k.view(t, a.kv_heads, a.head_dim), cos, sin)
            pool[0].index_copy_(0, step.dst, k)
            pool[1].index_copy_(0, step.dst, v.view(t, a.kv_heads, a.head_dim))
            o = step.attend(q, pool[0], pool[1])
            h = h + nnf.linear(o, w["o"])
            x = self._rms(h, w["ln2"])
            gate, up = nnf.linear(x, w["gate_up"]).chunk(2, dim=-1)
            h = h + nnf.linear(nnf.silu(gate) * up, w["down"])
        if step.last is not None:
            h = h.index_select(0, step.last)
        return nnf.linear(self._rms(h, self.ln_f), self.lm_head)


@dataclass(slots=True)
class Step:
    """One composition's inputs: token ids, positions, pool slots of the new tokens' KV, the
    attention over the pool, the rows that get logits."""

    ids: Any
    pos: Any
    dst: Any
    attend: Callable[[Any, Any, Any], Any]
    last: Any
    kv_positions: int


@dataclass(frozen=True, slots=True)
class Layout:
    """A composition laid out in the KV pool: the attention over it (q, k pool, v pool -> the
    output [tokens, heads * head_dim]), each request's first pool position, the positions the
    layout spans (padding included)."""

    attend: Callable[[Any, Any, Any], Any]
    starts: list[int]
    positions: int


class Attention:
    """An attention backend: lays a composition out in the KV pool and attends over it."""

    name = "?"

    def __init__(self, torch: Any, arch: Arch, device: Any) -> None:
        self.torch, self.arch, self.device = torch, arch, device
        self.group = arch.heads // arch.kv_heads

    def _tensor(self, values: Sequence[int], dtype: Any = None) -> Any:
        t = self.torch
        return t.tensor(list(values), dtype=dtype or t.long, device=self.device)

    def prefill(self, batch: Sequence[tuple[int, int]]) -> Layout:
        """Requests contiguous in the pool: request i holds its cached prefix, then its new
        tokens."""
        raise NotImplementedError

    def decode(self, contexts: Sequence[int]) -> Layout:
        """Request j's new token goes at its start + `contexts[j]`."""
        raise NotImplementedError

    @staticmethod
    def contiguous_starts(lengths: Sequence[int]) -> list[int]:
        starts, at = [], 0
        for n in lengths:
            starts.append(at)
            at += n
        return starts


class FlashAttention(Attention):
    """flash-attn's varlen kernel: every request in one call, causal aligned bottom-right."""

    name = "flash-attn varlen"

    def __init__(self, torch: Any, arch: Arch, device: Any, flash: ModuleType) -> None:
        super().__init__(torch, arch, device)
        self.fn = flash.flash_attn_varlen_func

    def _varlen(self, q_lens: Sequence[int], k_lens: Sequence[int]) -> Callable[..., Any]:
        t, a = self.torch, self.arch
        cu_q = self._tensor([0, *self.cumsum(q_lens)], t.int32)
        cu_k = self._tensor([0, *self.cumsum(k_lens)], t.int32)
        max_q, max_k, total_k, total_q = max(q_lens), max(k_lens), sum(k_lens), sum(q_lens)
        fn = self.fn

        def attend(q: Any, k: Any, v: Any) -> Any:
            out = fn(q, k[:total_k], v[:total_k], cu_q, cu_k, max_q, max_k, causal=True)
            return out.reshape(total_q, a.heads * a.head_dim)

        return attend

    @staticmethod
    def cumsum(values: Sequence[int]) -> list[int]:
        out, at = [], 0
        for v in values:
            at += v
            out.append(at)
        return out

    def prefill(self, batch: Sequence[tuple[int, int]]) -> Layout:
        k_lens = [u + c for u, c in batch]
        attend = self._varlen([u for u, _ in batch], k_lens)
        return Layout(attend, self.contiguous_starts(k_lens), sum(k_lens))

    def decode(self, contexts: Sequence[int]) -> Layout:
        k_lens = [c + 1 for c in contexts]
        attend = self._varlen([1] * len(contexts), k_lens)
        return Layout(attend, self.contiguous_starts(k_lens), sum(k_lens))


class SdpaAttention(Attention):
    """`scaled_dot_product_attention`. Prefill: one call per request a layer, lower-right causal
    (a `causal_lower_right` bias, or a materialized mask with `mask=True`); GQA natively
    (`enable_gqa`) or by repeating K/V heads (`expand=True`). Decode: requests sorted and padded
    into groups (`decode_groups`), each query's heads folded onto its KV head as `group` query
    rows (no GQA support needed), a key-padding mask where lengths differ."""

    def __init__(
        self,
        torch: Any,
        arch: Arch,
        device: Any,
        dtype: Any,
        *,
        expand: bool,
        mask: bool,
        groups: int,
    ) -> None:
        super().__init__(torch, arch, device)
        self.dtype, self.expand, self.mask, self.groups = dtype, expand, mask, groups
        self.sdpa = torch.nn.functional.scaled_dot_product_attention
        self.bias: Any = None
        if not mask:
            self.bias = importlib.import_module("torch.nn.attention.bias").causal_lower_right
        self.name = (
            f"sdpa {'materialized mask' if mask else 'causal_lower_right'}, "
            f"{'repeated K/V heads' if expand else 'enable_gqa'}; decode padded groups"
        )

    def prefill(self, batch: Sequence[tuple[int, int]]) -> Layout:
        t, a = self.torch, self.arch
        starts = self.contiguous_starts([u + c for u, c in batch])
        parts: list[tuple[int, int, int, int, Any]] = []
        q_at = 0
        for (u, c), start in zip(batch, starts, strict=True):
            if self.mask:
                bias = t.ones(u, u + c, dtype=t.bool, device=self.device).tril(diagonal=c)
            else:
                bias = self.bias(u, u + c)
            parts.append((q_at, q_at + u, start, start + u + c, bias))
            q_at += u
        total, sdpa, expand, group = q_at, self.sdpa, self.expand, self.group
        kwargs = {} if expand else {"enable_gqa": True}

        def attend(q: Any, k: Any, v: Any) -> Any:
            out = q.new_empty(total, a.heads, a.head_dim)
            for qs, qe, ks, ke, bias in parts:
                qi = q[qs:qe].transpose(0, 1).unsqueeze(0)
                ki = k[ks:ke].transpose(0, 1).unsqueeze(0)
                vi = v[ks:ke].transpose(0, 1).unsqueeze(0)
                if expand:
                    ki = ki.repeat_interleave(group, dim=1)
                    vi = vi.repeat_interleave(group, dim=1)
                oi = sdpa(qi, ki, vi, attn_mask=bias, **kwargs)
                out[qs:qe] = oi[0].transpose(0, 1)
            return out.view(total, a.heads * a.head_dim)

        return Layout(attend, starts, sum(u + c for u, c in batch))

    def decode(self, contexts: Sequence[int]) -> Layout:
        t, a = self.torch, self.arch
        layout = decode_groups(contexts, self.groups)
        starts: list[int] = []
        parts: list[tuple[int, int, int, int, Any]] = []
        for g in layout:
            lens = [c + 1 for c in contexts[g.first : g.first + g.count]]
            starts.extend(g.offset + i * g.length for i in range(g.count))
            bias = None
            if g.masked:
                keep = t.arange(g.length, device=self.device) < self._tensor(lens).unsqueeze(1)
                bias = t.zeros(g.count, 1, 1, g.length, dtype=self.dtype, device=self.device)
                bias.masked_fill_(~keep.view(g.count, 1, 1, g.length), float("-inf"))
            parts.append((g.first, g.count, g.offset, g.length, bias))
        b, sdpa, kvh, group, d = len(contexts), self.sdpa, a.kv_heads, self.group, a.head_dim

        def attend(q: Any, k: Any, v: Any) -> Any:
            out = q.new_empty(b, a.heads, d)
            for first, count, offset, length, bias in parts:
                qg = q[first : first + count].view(count, kvh, group, d)
                region = slice(offset, offset + count * length)
                kg = k[region].view(count, length, kvh, d).transpose(1, 2)
                vg = v[region].view(count, length, kvh, d).transpose(1, 2)
                og = sdpa(qg, kg, vg, attn_mask=bias)
                out[first : first + count] = og.reshape(count, a.heads, d)
            return out.view(b, a.heads * d)

        end = layout[-1].offset + layout[-1].count * layout[-1].length
        return Layout(attend, starts, end)


def build_step(torch: Any, model: Model, backend: Attention, comp: Composition, gen: Any) -> Step:
    """A composition's inputs on the device (outside the timed region)."""
    device = model.device
    if comp.phase == "prefill":
        layout = backend.prefill(comp.batch)
        pairs = zip(comp.batch, layout.starts, strict=True)
        pos = torch.cat([torch.arange(c, c + u) for u, c in comp.batch])
        dst = torch.cat([torch.arange(s + c, s + c + u) for (u, c), s in pairs])
        ends, at = [], 0
        for u, _ in comp.batch:
            at += u
            ends.append(at - 1)
        last = torch.tensor(ends, dtype=torch.long, device=device)
    else:
        layout = backend.decode(comp.contexts)
        pos = torch.tensor(list(comp.contexts), dtype=torch.long)
        news = [s + c for s, c in zip(layout.starts, comp.contexts, strict=True)]
        dst = torch.tensor(news, dtype=torch.long)
        last = None
    ids = torch.randint(0, model.arch.vocab, (comp.new_tokens,), device=device, generator=gen)
    return Step(ids, pos.to(device), dst.to(device), layout.attend, last, layout.positions)


def reference_attention(torch: Any, q: Any, k: Any, v: Any, n_past: int) -> Any:
    """float32 attention of q [L, H, d] over k, v [S, Hkv, d]; row i sees keys <= n_past + i."""
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = qf @ kf.transpose(1, 2) / math.sqrt(q.shape[-1])
    rows, cols = q.shape[0], k.shape[0]
    allowed = torch.ones(rows, cols, dtype=torch.bool, device=q.device).tril(diagonal=n_past)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1)


def probe(torch: Any, backend: Attention, arch: Arch, device: Any, dtype: Any) -> float:
    """The largest error of `backend` against `reference_attention` on a small prefill batch
    (with and without cached prefixes) and a small decode batch with uneven contexts."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    a = arch
    worst = 0.0

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    batch = [(5, 0), (3, 9), (16, 40), (1, 7)]
    layout = backend.prefill(batch)
    k = rand(layout.positions, a.kv_heads, a.head_dim)
    v = rand(layout.positions, a.kv_heads, a.head_dim)
    q = rand(sum(u for u, _ in batch), a.heads, a.head_dim)
    out = layout.attend(q, k, v).view(-1, a.heads, a.head_dim)
    at = 0
    for (u, c), s in zip(batch, layout.starts, strict=True):
        ref = reference_attention(torch, q[at : at + u], k[s : s + u + c], v[s : s + u + c], c)
        worst = max(worst, float((out[at : at + u].float() - ref).abs().max()))
        at += u
    contexts = [3, 4, 30, 31, 77]
    layout = backend.decode(contexts)
    k = rand(layout.positions, a.kv_heads, a.head_dim)
    v = rand(layout.positions, a.kv_heads, a.head_dim)
    q = rand(len(contexts), a.heads, a.head_dim)
    out = layout.attend(q, k, v).view(-1, a.heads, a.head_dim)
    for j, (s, c) in enumerate(zip(layout.starts, contexts, strict=True)):
        ref = reference_attention(torch, q[j : j + 1], k[s : s + c + 1], v[s : s + c + 1], c)
        worst = max(worst, float((out[j : j + 1].float() - ref).abs().max()))
    return worst


PROBE_TOLERANCE = 0.05


def _sdpa_maker(
    torch: Any, arch: Arch, device: Any, dtype: Any, expand: bool, mask: bool, groups: int
) -> Callable[[], Attention]:
    def make() -> Attention:
        return SdpaAttention(torch, arch, device, dtype, expand=expand, mask=mask, groups=groups)

    return make


def choose_attention(
    torch: Any, arch: Arch, device: Any, dtype: Any, want: str, groups: int
) -> tuple[Attention, list[str]]:
    """The first backend that is importable and agrees with the reference on this machine."""
    tried: list[str] = []
    makers: list[tuple[str, Callable[[], Attention]]] = []
    if want in ("auto", "flash-attn") and device.type == "cuda":
        try:
            flash = importlib.import_module("flash_attn")
            makers.append(("flash-attn", lambda: FlashAttention(torch, arch, device, flash)))
        except Exception as e:
            tried.append(f"flash-attn: not importable ({type(e).__name__}: {e})")
    if want in ("auto", "sdpa"):
        for expand, mask in ((False, False), (True, False), (False, True), (True, True)):
            label = f"sdpa ({'mask' if mask else 'causal_lower_right'}, expand={expand})"
            makers.append((label, _sdpa_maker(torch, arch, device, dtype, expand, mask, groups)))
    for label, make in makers:
        try:
            backend = make()
            error = probe(torch, backend, arch, device, dtype)
        except Exception as e:
            tried.append(f"{label}: {type(e).__name__}: {e}")
            continue
        if error <= PROBE_TOLERANCE:
            tried.append(f"{backend.name}: max error {error:.4f} (chosen)")
            return backend, tried
        tried.append(f"{backend.name}: max error {error:.4f} > {PROBE_TOLERANCE}")
    raise RuntimeError("no attention backend passed the probe:\n  " + "\n  ".join(tried))


class Timer:
    """CUDA events around each run (time.perf_counter on a CPU), warm-up first; decode as a
    CUDA graph when asked and the capture works."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch, self.cuda = torch, device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def capture(self, fn: Callable[[], Any], warmup: int) -> tuple[Callable[[], Any], Any]:
        torch = self.torch
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(max(1, warmup)):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay, graph

    def time(self, run: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
        torch = self.torch
        for _ in range(warmup):
            run()
        self.sync()
        out: list[float] = []
        for _ in range(repeats):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                run()
                out.append(time.perf_counter() - t0)
        return out


def _versions(torch: Any, device: Any, backend_name: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": getattr(torch.version, "cuda", None),
        "python": platform.python_version(),
    }
    try:
        info["flash_attn"] = importlib.import_module("flash_attn").__version__
    except Exception:
        info["flash_attn"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_bytes"] = int(props.total_memory)
        info["gpu_capability"] = f"{props.major}.{props.minor}"
        info["cudnn"] = torch.backends.cudnn.version()
        info["driver_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    else:
        info["gpu"] = None
        info["cpu"] = platform.processor() or platform.machine()
    info["attention"] = backend_name
    return info


class _SkipError(Exception):
    """A composition that cannot run here (its layout does not fit the KV pool)."""


class Profiler:
    """Runs a plan: one composition at a time, the CSV and the sidecar rewritten after each."""

    def __init__(self, plan: Plan, out: Path, device_name: str, dtype_name: str) -> None:
        self.torch: Any = importlib.import_module("torch")
        self.plan, self.out, self.dtype_name = plan, out, dtype_name
        self.device = self.torch.device(device_name)
        self.cuda = self.device.type == "cuda"
        self.dtype = getattr(self.torch, dtype_name)
        self.started = time.monotonic()
        self.measure_started = self.started
        self.measured: list[Measured] = []
        self.skipped: list[dict[str, Any]] = []
        self.use_graph = self.cuda and plan.options.cuda_graph
        self.graph_state = "on" if self.use_graph else "off"
        self.decode_done = 0
        self.info: dict[str, Any] = {}

    def setup(self, attention: str) -> None:
        torch, plan = self.torch, self.plan
        o, arch = plan.options, plan.arch
        if self.cuda:
            if self.device.index is None:  # some torch.cuda calls want an explicit index
                self.device = torch.device("cuda", torch.cuda.current_device())
            total = torch.cuda.get_device_properties(self.device).total_memory
            if o.memory_gb is None and total < plan.memory_bytes:
                _log(f"the GPU has {total / 1e9:.0f} GB, less than planned: replanning for it")
                self.plan = plan = make_plan(_replace(o, memory_gb=total / 1e9))
            torch.cuda.set_device(self.device)
        torch.manual_seed(o.seed)
        _log(describe_plan(plan, first=0))
        _log(f"building {arch.name} ({plan.layers} layers, {self.dtype_name}) on {self.device}")
        self.model = Model(torch, arch, plan.layers, self.device, self.dtype, o.seed)
        self.backend, tried = choose_attention(
            torch, arch, self.device, self.dtype, attention, o.decode_groups
        )
        for line in tried:
            _log(f"  attention probe: {line}")
        need = capacity = plan.max_kv_tokens
        per_token = arch.kv_bytes_per_token(plan.layers)
        if self.cuda:
            free = torch.cuda.mem_get_info(self.device)[0]
            act = o.limits().max_uncached * arch.activation_bytes_per_token()
            fit = int((free - act - 2 * GiB) // per_token)
            capacity = max(1, min(need, fit))
        self.model.allocate(capacity, plan.max_positions + 1)
        self.capacity = capacity
        _log(
            f"KV pool: {capacity:,} tokens ({capacity * per_token / 1e9:.1f} GB; the plan needs "
            f"up to {need:,}); set-up took {time.monotonic() - self.started:.0f} s"
        )
        self.timer = Timer(torch, self.device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(o.seed + 1)
        self.info = _versions(torch, self.device, self.backend.name)

    def measure(self, comp: Composition) -> tuple[list[float], bool, int]:
        """The timed runs of one composition, whether they replayed a CUDA graph, and the KV
        positions its layout spans."""
        step = build_step(self.torch, self.model, self.backend, comp, self.gen)
        if step.kv_positions > self.capacity:
            raise _SkipError(f"needs {step.kv_positions:,} KV positions > pool {self.capacity:,}")
        model = self.model

        def forward() -> Any:
            return model.forward(step)

        if self.use_graph and comp.phase == "decode":
            try:
                replay, graph = self.timer.capture(forward, comp.warmup)
            except Exception as e:
                if _is_oom(self.torch, e) or self.decode_done:
                    raise
                # The first decode capture failed: every decode runs eagerly, for consistency.
                self.use_graph = False
                self.graph_state = f"off (capture failed: {type(e).__name__}: {e})"
                _log(f"  CUDA graph capture failed, decode runs eagerly: {e}")
                self.timer.sync()
            else:
                runs = self.timer.time(replay, 1, comp.repeats)
                del replay, graph
                return runs, True, step.kv_positions
        return self.timer.time(forward, comp.warmup, comp.repeats), False, step.kv_positions

    def save(self, complete: bool) -> None:
        write_samples(self.measured, self.out)
        meta = _metadata(
            self.plan,
            self.info,
            self.dtype_name,
            self.measured,
            self.skipped,
            self.graph_state,
            complete,
        )
        meta["elapsed_s"] = round(time.monotonic() - self.started, 1)
        meta["measure_s"] = round(time.monotonic() - self.measure_started, 1)
        side = sidecar_path(self.out)
        tmp = side.with_name(side.name + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, side)

    def run(self) -> int:
        torch, plan, o = self.torch, self.plan, self.plan.options
        self.measure_started = t0 = time.monotonic()
        total, failures, complete = len(plan.compositions), 0, True
        for i, comp in enumerate(plan.compositions, start=1):
            elapsed = time.monotonic() - t0
            if elapsed >= o.budget:
                _log(f"budget of {o.budget:.0f} s spent: stopping after {i - 1} of {total}")
                complete = False
                break
            prefix = f"[{i:4d}/{total}] {comp.label():<48}"
            if comp.estimate_s > 0.05 and elapsed + composition_cost(comp, o) > 1.1 * o.budget:
                self.skipped.append({**comp.to_json(), "reason": "would overrun the budget"})
                _log(f"{prefix} skipped: would overrun the budget")
                continue
            try:
                runs, graph, positions = self.measure(comp)
            except _SkipError as e:
                self.skipped.append({**comp.to_json(), "reason": str(e)})
                _log(f"{prefix} skipped: {e}")
                continue
            except Exception as e:
                oom = _is_oom(torch, e)
                reason = "out of memory" if oom else f"{type(e).__name__}: {e}"
                self.skipped.append({**comp.to_json(), "reason": reason})
                _log(f"{prefix} skipped: {reason}")
                gc.collect()
                if self.cuda:
                    torch.cuda.empty_cache()
                failures += not oom
                if failures >= 3 and not self.measured:
                    _log("three compositions failed before any succeeded: stopping")
                    self.save(False)
                    raise
                continue
            if comp.phase == "decode":
                self.decode_done += 1
            seconds = statistics.median(runs)
            measured = Measured(comp, seconds, tuple(runs), comp.warmup, graph, positions)
            self.measured.append(measured)
            _log(
                f"{prefix} {seconds * 1e3:10.3f} ms (est {comp.estimate_s * 1e3:9.3f} ms, "
                f"{len(runs)} runs{', graph' if graph else ''}) {time.monotonic() - t0:5.0f} s"
            )
            self.save(False)
        self.save(complete)
        _log(
            f"wrote {len(self.measured)} samples to {self.out} and {sidecar_path(self.out)} "
            f"({len(self.skipped)} skipped) in {time.monotonic() - self.started:.0f} s"
        )
        return 0 if self.measured else 1


def run_profile(plan: Plan, out: Path, device_name: str, dtype_name: str, attention: str) -> int:
    """A real run (imports torch): set up the model, the KV pool and the attention, then time."""
    profiler = Profiler(plan, out, device_name, dtype_name)
    if profiler.cuda and not profiler.torch.cuda.is_available():
        _log("error: torch sees no CUDA device (--device cpu --model tiny runs a CPU smoke test)")
        return 2
    with profiler.torch.inference_mode():
        profiler.setup(attention)
        return profiler.run()


def _replace(options: Options, **changes: Any) -> Options:
    return Options(**{**asdict(options), **changes})


def _metadata(
    plan: Plan,
    info: dict[str, Any],
    dtype_name: str,
    measured: Sequence[Measured],
    skipped: Sequence[dict[str, Any]],
    graph_state: str,
    complete: bool,
) -> dict[str, Any]:
    a = plan.arch
    return {
        "script": "benches/gpu/iteration_profile.py",
        "format": "evolving_infra.timing.samples CSV (phase, seconds, batch, batch_size, "
        "context_tokens); seconds = median of the timed runs",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": sys.argv,
        **info,
        "model": {
            "name": a.name,
            "full_layers": a.layers,
            "hidden": a.hidden,
            "heads": a.heads,
            "kv_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "intermediate": a.intermediate,
            "vocab": a.vocab,
        },
        "layers": plan.layers,
        "full_layers": a.layers,
        "dtype": dtype_name,
        "weights": "random (normal); timing does not depend on the values",
        "tensor_parallel": 1,
        "warmup": plan.options.warmups,
        "repeats": plan.options.runs,
        "slow_s": plan.options.slow_s,
        "decode_cuda_graph": graph_state,
        "decode_groups": plan.options.decode_groups,
        "seed": plan.options.seed,
        "budget_s": plan.options.budget,
        "plan": plan.summary(),
        "complete": complete,
        "measured": len(measured),
        "samples": [m.to_json() for m in measured],
        "skipped": list(skipped),
    }


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="iteration_profile.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, help="samples CSV to write (FILE.json beside it)")
    p.add_argument(
        "--model",
        default="llama-3-8b",
        help="llama-3-8b (default), llama-3-70b, or tiny (2 layers, hidden 256: a CPU smoke test)",
    )
    p.add_argument(
        "--layers", type=int, help="build only N layers (a big model on one GPU); default all"
    )
    p.add_argument("--device", default="cuda", help="torch device (default cuda; cpu with tiny)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0, help="seeds the plan and the weights")
    p.add_argument(
        "--quick", action="store_true", help="coarse grids, warm-up 1, median of 3, budget 100 s"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        help="seconds of measurement the plan is sized to and the run stops at "
        "(default 480, 100 with --quick; start-up adds ~1 minute)",
    )
    p.add_argument("--warmup", type=int, help="warm-up iterations (default 2, 1 with --quick)")
    p.add_argument("--repeats", type=int, help="timed runs per composition, median kept (5 / 3)")
    p.add_argument(
        "--slow-s",
        type=float,
        default=1.0,
        help="iterations estimated over this many seconds run at most 3 times (default 1.0)",
    )
    p.add_argument(
        "--gpu",
        default="h200-sxm",
        help="GPU the plan is estimated for (memory, roofline): h200-sxm, h100-sxm, a100-sxm-80gb",
    )
    p.add_argument(
        "--memory-gb",
        type=float,
        help="GPU memory to plan for (default the --gpu figure; a smaller real GPU replans)",
    )
    p.add_argument("--batches", type=int, help="prefill batch compositions (default 48 / 12)")
    p.add_argument("--decode-random", type=int, help="off-grid decode compositions (16 / 4)")
    p.add_argument(
        "--decode-groups",
        type=int,
        default=4,
        help="SDPA decode: pad requests into this many groups of similar length (default 4)",
    )
    p.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "flash-attn", "sdpa"],
        help="attention backend (auto: flash-attn if importable and correct, else SDPA)",
    )
    p.add_argument(
        "--no-cuda-graph",
        dest="cuda_graph",
        action="store_false",
        help="run decode eagerly instead of as a CUDA graph",
    )
    p.add_argument("--max-uncached", type=int, help="largest prefill t_uc (default 32768)")
    p.add_argument("--max-cached", type=int, help="largest prefill t_c (default 131072)")
    p.add_argument("--max-batch", type=int, help="largest decode batch (default 256)")
    p.add_argument("--max-context", type=int, help="largest decode context a request (32768)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (counts per phase, first compositions, estimate) and exit; "
        "imports no torch",
    )
    p.add_argument("--plan-out", type=Path, help="also write the whole plan as JSON")
    return p.parse_args(argv)


def options_from(args: argparse.Namespace) -> Options:
    return Options(
        model=args.model,
        layers=args.layers,
        quick=args.quick,
        seed=args.seed,
        budget_s=args.budget_s,
        warmup=args.warmup,
        repeats=args.repeats,
        slow_s=args.slow_s,
        gpu=args.gpu,
        memory_gb=args.memory_gb,
        batches=args.batches,
        decode_random=args.decode_random,
        decode_groups=args.decode_groups,
        cuda_graph=args.cuda_graph,
        max_uncached=args.max_uncached,
        max_cached=args.max_cached,
        max_batch=args.max_batch,
        max_context=args.max_context,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        plan = make_plan(options_from(args))
    except PlanError as e:
        _log(f"error: {e}")
        return 2
    if args.plan_out is not None:
        args.plan_out.write_text(
            json.dumps(
                {**plan.summary(), "compositions": [c.to_json() for c in plan.compositions]},
                indent=1,
            )
            + "\n"
        )
    if args.dry_run:
        print(describe_plan(plan))
        return 0
    if args.out is None:
        _log("error: --out FILE.csv is needed (or --dry-run)")
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    return run_profile(plan, args.out, args.device, args.dtype, args.attention)


if __name__ == "__main__":
    sys.exit(main())
