"""`model eval`: the comparison protocol, the baseline forms and the command."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from evolving_infra.cli import main
from evolving_infra.timing import PrefillBatch, Sample, baselines, evaluation, write_csv
from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.truth import RooflineTruth


@pytest.fixture(scope="module")
def reports() -> dict[str, evaluation.ModelReport]:
    fit, test = evaluation.truth_samples(
        RooflineTruth(noise=0.02, seed=3), seed=3, fit=500, test=200
    )
    out = evaluation.compare({"evolving": IterationModel, **baselines.BASELINES}, fit, test)
    return {r.name: r for r in out}


def test_held_out_samples_are_larger_than_anything_fitted() -> None:
    fit, test = evaluation.truth_samples(RooflineTruth(noise=0.0), seed=0, fit=200, test=100)
    assert all(evaluation.is_fit_sized(s) for s in fit)
    assert not any(evaluation.is_fit_sized(s) for s in test)
    assert {s.phase for s in test} == {"prefill", "decode"}
    assert any(s.requests == 1 for s in test)
    assert any(s.requests > 1 for s in test)


def test_ours_meets_the_goals_and_beats_every_other_form(
    reports: dict[str, evaluation.ModelReport],
) -> None:
    ours = reports["evolving"]
    assert ours.single.mean_ape is not None
    assert ours.batch.mean_ape is not None
    assert ours.single.mean_ape < 0.03
    assert ours.batch.mean_ape < 0.05
    for name in baselines.BASELINES:
        other = reports[name]
        assert other.single.mean_ape is not None
        assert other.batch.mean_ape is not None
        assert ours.single.mean_ape < other.single.mean_ape, name
        assert ours.batch.mean_ape < other.batch.mean_ape, name
    assert ours.converged_s is not None
    assert 0 < ours.converged_s <= ours.curve[-1][0]


def test_each_baseline_recovers_a_truth_of_its_own_form() -> None:
    rng = random.Random(0)
    forms: dict[str, Callable[[PrefillBatch], float]] = {
        "distserve": lambda b: 1e-3 + 2e-5 * sum(u for u, _ in b) + 3e-9 * sum(u * u for u, _ in b),
        "vidur": lambda b: (
            1e-3
            + 2e-5 * sum(u for u, _ in b)
            + 3e-9 * sum(u * u for u, _ in b)
            + 4e-7 * sum(c for _, c in b)
        ),
        "dynamo": lambda b: 2e-3 + 5e-5 * sum(u for u, _ in b),
    }
    for name, truth in forms.items():
        model = baselines.BASELINES[name]()
        for _ in range(60):
            batch = tuple(
                (rng.randint(1, 3000), rng.randint(0, 9000)) for _ in range(rng.randint(1, 3))
            )
            model.observe(Sample("prefill", truth(batch), batch=batch))
        probe = ((5000, 20000), (7, 0))
        assert model.predict_prefill(probe) == pytest.approx(truth(probe), rel=1e-6), name


def test_command_prints_one_json_object_and_draws_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "eval.png"
    args = ["model", "eval", "--json", "--fit-samples", "300", "--plot", str(png)]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["models"]) == {"evolving", "distserve", "vidur", "dynamo"}
    for m in result["models"].values():
        assert {"single", "batch", "prefill", "decode", "converged_s", "curve"} <= set(m)
        assert set(m["single"]) == {"n", "mean_ape", "p95_ape"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_reads_measured_samples_from_csv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fit, test = evaluation.truth_samples(RooflineTruth(seed=1), seed=1, fit=200, test=80)
    data = tmp_path / "gpu.csv"
    write_csv(fit + test, data)
    assert main(["model", "eval", "--json", "--data", str(data)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fit_samples"] == 200
    assert result["test_samples"] == 80
    # Only small samples: nothing to hold out, a one-line error.
    small = tmp_path / "small.csv"
    write_csv(fit, small)
    assert main(["model", "eval", "--data", str(small)]) == 2
    assert "needs both small and large samples" in capsys.readouterr().err
    # A broken file: one line naming the file and the line, no traceback.
    bad = tmp_path / "bad.csv"
    bad.write_text("phase,seconds,batch,batch_size,context_tokens\nprefill,-1,[[1,0]],0,0\n")
    assert main(["model", "eval", "--data", str(bad)]) == 2
    assert f"{bad}:2: seconds" in capsys.readouterr().err
