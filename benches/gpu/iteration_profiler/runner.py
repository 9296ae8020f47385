"""A real profile run: the timer, the profiler that sets up the model and times a plan's
compositions one by one, and what it writes (the samples CSV and its JSON sidecar, rewritten
after every composition so that a run that is killed keeps what it measured).

Torch is imported only when a `Profiler` is made; importing this module needs none.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from iteration_profiler.plan import (
    Composition,
    GiB,
    Plan,
    activation_bytes_per_token,
    composition_cost,
    describe_plan,
    kv_bytes_per_token,
    make_plan,
)
from iteration_profiler.torch_model import Model, build_step, choose_attention
from iteration_profiler.tree import timing_module

if TYPE_CHECKING:
    from evolving_infra.timing import samples
else:
    samples = timing_module("samples")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
    """The samples CSV, in `samples.write_csv`'s format (written beside, then moved in place)."""
    tmp = path.with_name(path.name + ".tmp")
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
    os.replace(tmp, path)


def sidecar_path(out: Path) -> Path:
    return out.with_suffix(".json")


# ---------------------------------------------------------------------------------------------
# Timing


def is_oom(torch: Any, error: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(error, oom):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error)


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
                log(f"the GPU has {total / 1e9:.0f} GB, less than planned: replanning for it")
                self.plan = plan = make_plan(dataclasses.replace(o, memory_gb=total / 1e9))
            torch.cuda.set_device(self.device)
        torch.manual_seed(o.seed)
        log(describe_plan(plan, first=0))
        log(f"building {arch.name} ({plan.layers} layers, {self.dtype_name}) on {self.device}")
        self.model = Model(torch, arch, plan.layers, self.device, self.dtype, o.seed)
        self.backend, tried = choose_attention(
            torch, arch, self.device, self.dtype, attention, o.decode_groups
        )
        for line in tried:
            log(f"  attention probe: {line}")
        need = capacity = plan.max_kv_tokens
        per_token = kv_bytes_per_token(arch, plan.layers)
        if self.cuda:
            free = torch.cuda.mem_get_info(self.device)[0]
            act = o.limits().max_uncached * activation_bytes_per_token(arch)
            fit = int((free - act - 2 * GiB) // per_token)
            capacity = max(1, min(need, fit))
        self.model.allocate(capacity, plan.max_positions + 1)
        self.capacity = capacity
        log(
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
                if is_oom(self.torch, e) or self.decode_done:
                    raise
                # The first decode capture failed: every decode runs eagerly, for consistency.
                self.use_graph = False
                self.graph_state = f"off (capture failed: {type(e).__name__}: {e})"
                log(f"  CUDA graph capture failed, decode runs eagerly: {e}")
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
                log(f"budget of {o.budget:.0f} s spent: stopping after {i - 1} of {total}")
                complete = False
                break
            prefix = f"[{i:4d}/{total}] {comp.label():<48}"
            if comp.estimate_s > 0.05 and elapsed + composition_cost(comp, o) > 1.1 * o.budget:
                self.skipped.append({**comp.to_json(), "reason": "would overrun the budget"})
                log(f"{prefix} skipped: would overrun the budget")
                continue
            try:
                runs, graph, positions = self.measure(comp)
            except _SkipError as e:
                self.skipped.append({**comp.to_json(), "reason": str(e)})
                log(f"{prefix} skipped: {e}")
                continue
            except Exception as e:
                oom = is_oom(torch, e)
                reason = "out of memory" if oom else f"{type(e).__name__}: {e}"
                self.skipped.append({**comp.to_json(), "reason": reason})
                log(f"{prefix} skipped: {reason}")
                gc.collect()
                if self.cuda:
                    torch.cuda.empty_cache()
                failures += not oom
                if failures >= 3 and not self.measured:
                    log("three compositions failed before any succeeded: stopping")
                    self.save(False)
                    raise
                continue
            if comp.phase == "decode":
                self.decode_done += 1
            seconds = statistics.median(runs)
            measured = Measured(comp, seconds, tuple(runs), comp.warmup, graph, positions)
            self.measured.append(measured)
            log(
                f"{prefix} {seconds * 1e3:10.3f} ms (est {comp.estimate_s * 1e3:9.3f} ms, "
                f"{len(runs)} runs{', graph' if graph else ''}) {time.monotonic() - t0:5.0f} s"
            )
            self.save(False)
        self.save(complete)
        log(
            f"wrote {len(self.measured)} samples to {self.out} and {sidecar_path(self.out)} "
            f"({len(self.skipped)} skipped) in {time.monotonic() - self.started:.0f} s"
        )
        return 0 if self.measured else 1


def run_profile(plan: Plan, out: Path, device_name: str, dtype_name: str, attention: str) -> int:
    """A real run (imports torch): set up the model, the KV pool and the attention, then time."""
    profiler = Profiler(plan, out, device_name, dtype_name)
    if profiler.cuda and not profiler.torch.cuda.is_available():
        log("error: torch sees no CUDA device (--device cpu --model tiny runs a CPU smoke test)")
        return 2
    with profiler.torch.inference_mode():
        profiler.setup(attention)
        return profiler.run()


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
