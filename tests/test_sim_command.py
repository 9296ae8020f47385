"""`evolving-infra sim`: arguments, the files it writes, errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from evolving_infra.sim import command
from evolving_infra.sim.deployments import deployment_from
from evolving_infra.workloads import jsonl
from evolving_infra.workloads.errors import WorkloadError
from evolving_infra.workloads.generators import SlotPlan, generate


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_writes_results_table_and_timelines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = parse(
        *("--workload", "osworld", "--gpus", "12", "--agents", "3", "--duration", "360"),
        *("--policies", "evolving,dynamo,arrow,best-static", "--out", str(out), "--no-progress"),
        *("--jobs", "2"),
    )
    assert command.run(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["policies"]) == {"evolving", "dynamo", "arrow", "best-static"}
    for figures in results["policies"].values():
        for key in (
            "throughput_tokens_per_s",
            "requests_per_s",
            "mean_e2e_s",
            "p95_ttft_s",
            "hit_rate",
            "ideal_hit_rate",
            "lost_kv_reuse",
            "switches",
        ):
            assert key in figures
        assert figures["timeline"]
    assert results["config"]["nodes"] == 3
    assert results["policies"]["best-static"]["split"] in ("1P2D", "2P1D")
    table = (out / "results.md").read_text()
    assert "| best-static (" in table
    assert "| evolving |" in capsys.readouterr().out
    for name in ("throughput", "hit_rate", "split"):
        assert (out / f"timeline_{name}.png").stat().st_size > 1000
    # Why the evolving planner kept or moved: a record per decision, Θ of every candidate.
    log = results["policies"]["evolving"]["decision_log"]
    assert log
    for d in log:
        assert set(d["theta"]) == {"1P2D", "2P1D"}
        assert d["split"] in d["theta"]
        assert d["best"] in d["theta"]
        assert d["asked"] is None or d["asked"] != d["split"]
    assert [d["t"] for d in log] == sorted(d["t"] for d in log)
    assert "decision_log" not in results["policies"]["dynamo"]
    assert (out / "decisions_evolving.png").stat().st_size > 1000
    assert not (out / "decisions_dynamo.png").exists()


def test_runs_on_trace_files(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    jsonl.save(generate("putnam", SlotPlan(agents=2, duration=120, seed=1)), path)
    args = parse(
        *("--trace", str(path), "--gpus", "8", "--agents", "2", "--duration", "120"),
        *("--policies", "static:1P1D", "--out", str(tmp_path / "o"), "--no-progress"),
    )
    assert command.run(args) == 0
    results = json.loads((tmp_path / "o" / "results.json").read_text())
    assert results["policies"]["static:1P1D"]["issued"] > 0


def test_jobs_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--jobs", "0")
    assert "--jobs" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--policies", "nope"), "unknown policy"),
        (("--policies", "static:2P2D"), "not a split"),
        (("--gpus", "6"), "multiple of tp"),
    ],
)
def test_bad_arguments_are_workload_errors(
    tmp_path: Path, argv: tuple[str, ...], message: str
) -> None:
    args = parse(*("--gpus", "8", "--agents", "1", "--duration", "60"), *argv)
    args.out = tmp_path
    with pytest.raises(WorkloadError, match=message):
        command.run(args)


@pytest.mark.parametrize("restart_s", [30.0, 180.0])
def test_restart_s_is_how_long_a_dynamo_switch_keeps_a_node_down(
    tmp_path: Path, restart_s: float
) -> None:
    out = tmp_path / "o"
    args = parse(
        *("--workload", "osworld", "--gpus", "12", "--agents", "3", "--duration", "600"),
        *("--policies", "dynamo-load", "--restart-s", str(restart_s), "--out", str(out)),
        "--no-progress",
    )
    assert command.run(args) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["switch_restart_s"] == restart_s
    dynamo = results["policies"]["dynamo-load"]  # its SLA loop switches on this light load
    assert dynamo["switches"] >= 1  # the run is sized so that it switches: the test needs one
    assert dynamo["switch_down_s"] == pytest.approx(restart_s * dynamo["switches"], rel=1e-6)


def test_restart_s_defaults_to_the_papers_figure() -> None:
    assert parse().restart_s == 700.0
    with pytest.raises(SystemExit):
        parse("--restart-s", "0")


def test_static_sweeps_run_on_each_infrastructure(tmp_path: Path) -> None:
    out = tmp_path / "o"
    args = parse(
        *("--workload", "putnam", "--gpus", "12", "--agents", "2", "--duration", "120"),
        *("--policies", "best-static,best-dynamo-static,best-arrow-static,dynamo-static:1P2D"),
        *("--out", str(out), "--no-progress", "--jobs", "2"),
    )
    assert command.run(args) == 0
    results = json.loads((out / "results.json").read_text())
    policies = results["policies"]
    assert set(policies) == {
        "best-static", "best-dynamo-static", "best-arrow-static", "dynamo-static:1P2D"
    }  # fmt: skip
    for sweep in ("best-static", "best-dynamo-static", "best-arrow-static"):
        assert set(policies[sweep]["splits"]) == {"1P2D", "2P1D"}, sweep
        best = max(policies[sweep]["splits"].items(), key=lambda kv: kv[1])
        assert policies[sweep]["split"] == best[0]
        assert policies[sweep]["throughput_tokens_per_s"] == best[1]
    # The named static split on Dynamo's infrastructure is the sweep's run of the same split.
    one = policies["dynamo-static:1P2D"]["throughput_tokens_per_s"]
    assert policies["best-dynamo-static"]["splits"]["1P2D"] == one
    # Nothing switched: no planner.
    assert all(policies[name]["switches"] == 0 for name in policies)
    assert set(results["runtime"]) >= {"dynamo-static:1P2D", "arrow-static:2P1D", "static:1P2D"}


def test_every_baseline_and_sweep_in_one_run(tmp_path: Path) -> None:
    # The comparison issue 24 asks for, in one command: every policy lands in results.json.
    names = [
        *("evolving", "dynamo", "dynamo-load", "dynamo-hicache", "arrow"),
        *("best-static", "best-dynamo-static", "best-dynamo-hicache-static", "best-arrow-static"),
        *("evolving-lru", "evolving-dynamo-cost", "evolving-no-pool"),
        *("evolving-drop", "evolving-fixed"),
    ]
    out = tmp_path / "o"
    args = parse(
        *("--workload", "cc", "--gpus", "12", "--agents", "3", "--duration", "120"),
        *("--policies", ",".join(names), "--out", str(out), "--no-progress", "--jobs", "2"),
    )
    assert command.run(args) == 0
    policies = json.loads((out / "results.json").read_text())["policies"]
    assert set(policies) == set(names)
    for name in names:
        assert policies[name]["completed"] > 0, name


def test_pool_one_copy_is_a_flag_for_the_policies_with_a_pool(tmp_path: Path) -> None:
    def run(*extra: str) -> dict[str, Any]:
        out = tmp_path / str(len(extra))
        args = parse(
            *("--workload", "cc", "--gpus", "8", "--agents", "6", "--duration", "300"),
            *("--policies", "evolving,dynamo", "--out", str(out), "--no-progress", *extra),
        )
        assert command.run(args) == 0
        return dict(json.loads((out / "results.json").read_text()))

    per_node, one = run(), run("--pool-one-copy")
    assert (per_node["config"]["pool_one_copy"], one["config"]["pool_one_copy"]) == (False, True)
    assert per_node["policies"]["evolving"]["deduped_blocks"] == 0
    assert one["policies"]["evolving"]["deduped_blocks"] > 0
    assert one["policies"]["dynamo"]["deduped_blocks"] == 0  # no pool: nothing to share


def test_the_paper_deployment_and_its_overrides(tmp_path: Path) -> None:
    """`--deployment paper` is Kimi K2 on 4 x GB300 with MTP; each part can be replaced."""
    out = tmp_path / "paper"
    args = parse(
        *("--deployment", "paper", "--gpus", "8", "--agents", "2", "--duration", "120"),
        *("--policies", "static:1P1D", "--out", str(out), "--no-progress"),
    )
    assert command.run(args) == 0
    d = json.loads((out / "results.json").read_text())["config"]["deployment"]
    assert (d["name"], d["model"], d["gpu"], d["tp"]) == ("paper", "kimi-k2", "gb300", 4)
    assert (d["mtp_draft_tokens"], d["mtp_accepted"]) == (3, 2.5)
    plain = deployment_from(parse("--deployment", "paper", "--mtp-draft-tokens", "0"))
    assert (plain.mtp_draft_tokens, plain.mtp_accepted, plain.model.name) == (0, 1.0, "kimi-k2")
    glm = deployment_from(parse("--deployment", "paper", "--model", "glm-4.5"))
    assert (glm.model.name, glm.gpu.name, glm.mtp_accepted) == ("glm-4.5", "gb300", 2.5)
    with pytest.raises(WorkloadError, match="mtp_accepted"):
        deployment_from(parse("--deployment", "paper", "--mtp-accepted", "5"))
    with pytest.raises(WorkloadError, match="tensor parallelism"):
        deployment_from(parse("--tp", "0"))


def test_planner_options_reach_the_evolving_planner(tmp_path: Path) -> None:
    """`--planner-option`: a run that switches once with the defaults does not when the planner
    needs more slices than its window holds; the options are in the results."""
    base = ("--workload", "osworld", "--gpus", "16", "--agents", "20", "--duration", "600")
    switches = []
    for extra in ((), ("--planner-option", "min_slices=11")):
        out = tmp_path / str(len(extra))
        args = parse(*base, "--policies", "evolving", "--out", str(out), "--no-progress", *extra)
        assert command.run(args) == 0
        results = json.loads((out / "results.json").read_text())
        switches.append(results["policies"]["evolving"]["switches"])
        assert results["config"]["planner_options"] == ({"min_slices": 11} if extra else {})
    assert switches == [1, 0]


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("nope=1", "unknown planner option 'nope'"),
        ("min_gain", "expected NAME=VALUE"),
        ("slices=2.5", "slices needs an integer"),
        ("alpha=nan", "alpha must be finite"),
    ],
)
def test_bad_planner_options_are_refused_by_argparse(
    capsys: pytest.CaptureFixture[str], option: str, message: str
) -> None:
    with pytest.raises(SystemExit):
        parse("--planner-option", option)
    assert message in capsys.readouterr().err


def test_planner_options_out_of_range_are_workload_errors(tmp_path: Path) -> None:
    args = parse("--gpus", "8", "--agents", "1", "--duration", "60", "--planner-option", "alpha=2")
    args.out = tmp_path
    with pytest.raises(WorkloadError, match=r"refuses its options.*alpha"):
        command.run(args)
