"""The profile's command line: the options, then the dry run (the plan, no torch) or a run."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from iteration_profiler.plan import Options, PlanError, describe_plan, make_plan
from iteration_profiler.runner import log, run_profile


def parse_args(
    argv: Sequence[str] | None = None, description: str | None = None
) -> argparse.Namespace:
    """The options; `description` heads the help (the entry script's docstring)."""
    p = argparse.ArgumentParser(
        prog="iteration_profile.py",
        description=description,
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


def main(argv: Sequence[str] | None = None, description: str | None = None) -> int:
    args = parse_args(argv, description)
    try:
        plan = make_plan(options_from(args))
    except PlanError as e:
        log(f"error: {e}")
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
        log("error: --out FILE.csv is needed (or --dry-run)")
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    return run_profile(plan, args.out, args.device, args.dtype, args.attention)
