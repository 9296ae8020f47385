"""`evolving-infra model eval`: our iteration-time model against DistServe, Vidur and Dynamo."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from evolving_infra.argtypes import check_output_file, positive_int
from evolving_infra.timing import baselines, evaluation
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.samples import Sample, read_csv
from evolving_infra.timing.specs import DEFAULT_DEPLOYMENT
from evolving_infra.timing.truth import RooflineTruth

NAME = "model"
HELP = "evaluate the online iteration-time model against other forms"
DESCRIPTION = """\
  model eval [--data CSV] [--json] [--plot PNG]

Streams the same iteration samples into four online models (ours: prefill features 1, Σt_uc,
ΣA, Σt_c with a roofline knee, decode 1, B, C, non-negative, sliding window; DistServe's Σl, Σl²;
Vidur's t_c, t_uc²; Dynamo's 1-D regressions) and reports each one's absolute percentage error
on held-out compositions larger than anything fitted (longer prompts and cached contexts, bigger
batches), for single requests and for batches, and the seconds of samples each needed to
converge. Without --data the samples come from the hidden roofline ground truth of Llama-3-70B
at TP4 on H100s (2% noise); with --data, from a CSV of measured iterations
(benches/gpu/iteration_profile.py), split by size."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="model_action", metavar="ACTION", required=True)
    p = actions.add_parser(
        "eval",
        help="held-out error and convergence of each iteration-time form",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", type=Path, metavar="CSV", help="measured samples (default: truth)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--plot", type=Path, metavar="PNG", help="draw predicted vs measured per model into PNG"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the truth's plan (default 0)")
    p.add_argument(
        "--fit-samples", type=positive_int, default=1200, help="truth: fit samples (default 1200)"
    )


def models() -> dict[str, Callable[[], evaluation.Predictor]]:
    ours: dict[str, Callable[[], evaluation.Predictor]] = {"evolving": IterationModel}
    return ours | dict(baselines.BASELINES)


def run(args: argparse.Namespace) -> int:
    if args.plot is not None:
        check_output_file(args.plot, "--plot")  # before the evaluation, not after it
    if args.data is not None:
        fit, test = evaluation.split(read_csv(args.data))
        source = str(args.data)
    else:
        truth = RooflineTruth(DEFAULT_DEPLOYMENT, noise=0.02, seed=args.seed)
        fit, test = evaluation.truth_samples(truth, seed=args.seed, fit=args.fit_samples)
        d = DEFAULT_DEPLOYMENT
        source = f"roofline truth: {d.model.name} TP{d.tp} on {d.gpu.name}, 2% noise"
    if not fit or not test:
        print(
            f"evolving-infra model: error: {source}: needs both small and large samples",
            file=sys.stderr,
        )
        return 2
    reports = evaluation.compare(models(), fit, test)
    result = _result(source, fit, test, reports)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        # Piped output keeps the table whole rather than folding it at 80 columns.
        console = Console()
        _render(result, console if console.is_terminal else Console(width=130))
    if args.plot is not None:
        from evolving_infra.timing.plots import predicted_vs_measured

        predicted_vs_measured(reports, test, args.plot, title=source)
    return 0


def _result(
    source: str,
    fit: Sequence[Sample],
    test: Sequence[Sample],
    reports: Sequence[evaluation.ModelReport],
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "source": source,
        "fit_samples": len(fit),
        "test_samples": len(test),
        "fit_seconds": sum(s.seconds for s in fit),
        "models": {},
    }
    for r in reports:
        entry = asdict(r)
        del entry["predicted"]
        entry["curve"] = [list(p) for p in r.curve]
        out["models"][r.name] = entry
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _render(result: dict[str, Any], console: Console) -> None:
    t = Table(
        title=f"Held-out absolute percentage error ({result['source']}; "
        f"{result['fit_samples']} fit / {result['test_samples']} held-out samples)"
    )
    for col in (
        "model",
        "single mean",
        "single P95",
        "batch mean",
        "batch P95",
        "prefill mean",
        "decode mean",
        "settled after",
        "< 5% after",
    ):
        t.add_column(col, justify="left" if col == "model" else "right")
    for name, m in result["models"].items():
        conv = m["converged_s"]
        t.add_row(
            name,
            _pct(m["single"]["mean_ape"]),
            _pct(m["single"]["p95_ape"]),
            _pct(m["batch"]["mean_ape"]),
            _pct(m["batch"]["p95_ape"]),
            _pct(m["prefill"]["mean_ape"]),
            _pct(m["decode"]["mean_ape"]),
            "never" if conv is None else f"{conv:.1f} s",
            "never" if m["within_goal_s"] is None else f"{m['within_goal_s']:.1f} s",
        )
    console.print(t)
    console.print(
        "single: one-request prefills and batch-size-1 decodes; settled: seconds of engine "
        "iterations streamed before the held-out error stayed within 1.25x of its final value; "
        "< 5%: before it stayed under 5%."
    )
