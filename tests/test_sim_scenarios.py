"""`evolving-infra scenario`: every scenario builds, a tiny run writes its files, and each claim
check can say yes and no on hand-made results."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from evolving_infra.sim import claims, heldout, scenario_command
from evolving_infra.sim.claims import holds_on_held_out
from evolving_infra.sim.policies import ABLATIONS, PolicySpec
from evolving_infra.sim.scenarios import LEVELS_BY_DEPLOYMENT, SCENARIOS, Size, Workload
from evolving_infra.timing.specs import PAPER_DEPLOYMENT
from evolving_infra.workloads.errors import WorkloadError


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_builds(name: str, quick: bool) -> None:
    runs = SCENARIOS[name].runs(Size(quick=quick, seed=3))
    assert runs
    assert len({r.label for r in runs}) == len(runs)
    for r in runs:
        if name == "heldout":  # its own seeds, offset by --seed
            assert r.config.seed - 3 in heldout.HELD_OUT_SEEDS
        elif name == "tuning":
            assert r.config.seed - 3 in heldout.TUNE_SEEDS
        else:
            assert r.config.seed == 3
        assert r.config.duration == r.workload.duration
        assert r.workload.agents >= 1
        assert r.policies
        for p in r.policies:  # strings are policy names; specs start on a split of the cluster
            if isinstance(p, PolicySpec) and p.split is not None:
                assert p.split.prefill + p.split.decode == r.config.nodes
    if quick and not name.startswith("scale-"):
        assert all(r.config.duration is not None and r.config.duration <= 900 for r in runs)


LEVELS = ("low", "mid", "high")


def test_levels_order_the_load() -> None:
    for kind in ("cc", "putnam", "osworld"):
        agents = [SCENARIOS[f"{kind}-{lv}"].runs(Size())[0].workload.agents for lv in LEVELS]
        assert agents == sorted(agents)
        assert len(set(agents)) == 3


def test_the_shift_on_the_papers_deployment_is_a_step_in_served_time() -> None:
    """The linear 60-agent shift loads the paper's deployment lightly at both ends; there the
    scenario (and the ablations' shift) runs `shift-step` at Putnam's high level."""
    paper = Size(deployment=PAPER_DEPLOYMENT)
    for name in ("shift", "ablations"):
        (w,) = {r.workload for r in SCENARIOS[name].runs(paper) if r.label.startswith("shift")}
        assert (w.kind, w.agents) == ("shift-step", 200)
        (h100,) = {r.workload for r in SCENARIOS[name].runs(Size()) if r.label.startswith("shift")}
        assert (h100.kind, h100.agents) == ("shift", 60)


def test_initial_splits_start_where_named() -> None:
    runs = SCENARIOS["initial-splits"].runs(Size(quick=True))
    assert [r.label for r in runs] == ["3P6D", "4P5D", "5P4D", "6P3D"]
    for r in runs:
        (spec,) = r.policies
        assert isinstance(spec, PolicySpec)
        assert spec.name == "evolving"
        assert str(spec.split) == r.label
        assert r.config.nodes == 9


def test_size_overrides() -> None:
    s = Size(quick=True, duration=60.0, max_agents=2)
    assert s.seconds(3600, 600) == 60.0
    assert s.agents(100) == 2
    assert Size().agents(0.2) == 1


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    scenario_command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_list_names_every_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert scenario_command.run(parse("list")) == 0
    out = capsys.readouterr().out
    for name in SCENARIOS:
        assert name in out


def test_tiny_run_writes_results_and_report(tmp_path: Path) -> None:
    # Smaller than --quick: 2 agents for 90 simulated seconds, on the quick 16-GPU cluster.
    size = Size(
        quick=True, seed=1, duration=90.0, max_agents=2, planner_options=(("min_gain", 0.05),)
    )
    path = scenario_command.run_to("ablations", size, tmp_path)
    assert path == tmp_path / "ablations" / "report.md"
    results = json.loads((tmp_path / "ablations" / "results.json").read_text())
    assert set(results["runs"]) == {"cc-mid", "osworld-mid", "shift"}
    ablations = {a.name for a in ABLATIONS}
    for r in results["runs"].values():
        assert set(r["policies"]) == {
            "evolving",
            *ablations,
            "dynamo",
            "best-static",
            "best-dynamo-hicache-static",
        }
        assert r["config"]["nodes"] == 4
        assert r["workload"]["agents"] == 2
        assert r["policies"]["evolving-fixed"]["switches"] == 0
        assert r["config"]["planner_options"] == {"min_gain": 0.05}
    assert results["planner_options"] == {"min_gain": 0.05}
    verdicts = {v["claim"]: v["outcome"] for v in results["claims"]}
    assert len(verdicts) == 5
    assert set(verdicts.values()) <= {"yes", "partly", "no", "n/a"}
    report = path.read_text()
    assert "## Paper claims" in report
    assert "| reproduced? |" in report
    assert "| evolving-fixed |" in report
    assert "Split over time" in report
    assert "Planner options (evolving): min_gain=0.05." in report


def test_check_recomputes_the_claims_of_results_on_disk(tmp_path: Path) -> None:
    size = Size(quick=True, seed=1, duration=60.0, max_agents=2)
    path = scenario_command.run_to("putnam-low", size, tmp_path)
    source = path.parent / "results.json"
    results = json.loads(source.read_text())
    want = results["claims"]
    results["claims"] = [{"claim": "stale", "measured": "-", "outcome": "no", "why": "-"}]
    source.write_text(json.dumps(results))
    path.write_text("stale")
    assert scenario_command.run(parse("check", str(path.parent))) == 0
    assert json.loads(source.read_text())["claims"] == want
    assert "## Paper claims" in path.read_text()
    with pytest.raises(WorkloadError, match="does not exist"):
        scenario_command.recheck(tmp_path / "nope")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.json").write_text("{")
    with pytest.raises(WorkloadError, match="is not a scenario's results"):
        scenario_command.recheck(tmp_path / "bad")


def test_statics_from_an_earlier_run_are_taken_and_the_rest_is_run(tmp_path: Path) -> None:
    """`scenario run tuning --statics-from DIR/tuning`: each cell's best static split is the
    earlier run's, evolving is run again (the same figures: the same inputs), the report names
    the folder; results of another configuration are refused."""
    size = Size(quick=True, duration=60.0, max_agents=2)
    first = scenario_command.run_to("tuning", size, tmp_path / "a")
    earlier = json.loads((first.parent / "results.json").read_text())
    again = scenario_command.run_to(
        "tuning", size, tmp_path / "b", statics=(first.parent, earlier["runs"])
    )
    reused = json.loads((again.parent / "results.json").read_text())
    assert reused["statics_from"] == str(first.parent)
    assert f"taken from {first.parent}" in again.read_text()
    assert reused["runs"].keys() == earlier["runs"].keys()
    for label, run in reused["runs"].items():
        before = earlier["runs"][label]["policies"]
        assert run["policies"]["best-static"] == before["best-static"]
        evolving = ("throughput_tokens_per_s", "switches", "completed")
        assert all(run["policies"]["evolving"][k] == before["evolving"][k] for k in evolving)
        assert set(run["runtime"]) == {"evolving"}  # the static splits were not run
    other = dataclasses.replace(size, duration=90.0)
    with pytest.raises(WorkloadError, match="another trace or configuration"):
        scenario_command.run_to(
            "tuning", other, tmp_path / "c", statics=(first.parent, earlier["runs"])
        )


def test_a_grid_runs_the_cells_and_policies_asked_for(tmp_path: Path) -> None:
    """`scenario run heldout --cells A,B --policies ...`: those cells alone, in the grid's
    order, each with those policies (a fair baseline beside evolving), and the results say so;
    a label the grid does not have is refused, naming the grid's cells."""
    every = [r.label for r in SCENARIOS["heldout"].runs(Size(quick=True))]
    asked = (every[3], every[0])
    size = Size(
        quick=True, duration=60.0, max_agents=2, cells=asked, policies=("evolving", "dynamo")
    )
    runs = SCENARIOS["heldout"].runs(size)
    assert [r.label for r in runs] == [every[0], every[3]]
    assert {r.policies for r in runs} == {("evolving", "dynamo")}
    path = scenario_command.run_to("heldout", size, tmp_path)
    results = json.loads((path.parent / "results.json").read_text())
    assert list(results["runs"]) == [every[0], every[3]]
    assert all(set(r["policies"]) == {"evolving", "dynamo"} for r in results["runs"].values())
    assert results["cells"] == list(asked)
    assert results["policies"] == ["evolving", "dynamo"]
    assert results["start_ramp_s"] == 15.0  # a quarter of the 60 s run: how its agents entered
    (plain, *_) = SCENARIOS["heldout"].runs(Size(quick=True))
    assert plain.policies == ("evolving", "best-static")  # without them: the grid's own
    with pytest.raises(ValueError, match=f"no cell 'nope' in this grid .*{every[0]}"):
        SCENARIOS["heldout"].runs(dataclasses.replace(size, cells=("nope",)))


def test_unknown_scenario_is_a_workload_error(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="unknown scenario"):
        scenario_command.run_to("nope", Size(), tmp_path)


# Hand-made results: only the fields the checks read.


def fig(tps: float = 100.0, lost: float = 0.0, p95: float = 1.0, **extra: Any) -> dict[str, Any]:
    return {
        "throughput_tokens_per_s": tps,
        "lost_kv_reuse": lost,
        "p95_ttft_s": p95,
        "switch_log": [],
        **extra,
    }


def runs(**policies: dict[str, Any]) -> dict[str, Any]:
    return {"r": {"policies": policies}}


def test_best_static_check() -> None:
    best = fig(100.0, split="4P5D")
    ok = claims.evolving_vs_best_static(runs(evolving=fig(98.0), **{"best-static": best}))
    assert ok.outcome == "yes"
    assert "4P5D" in ok.measured
    mid = claims.evolving_vs_best_static(runs(evolving=fig(93.0), **{"best-static": best}))
    assert mid.outcome == "partly"
    bad = claims.evolving_vs_best_static(runs(evolving=fig(80.0), **{"best-static": best}))
    assert bad.outcome == "no"
    assert claims.evolving_vs_best_static(runs(evolving=fig())).outcome == "n/a"


def test_lost_reuse_check() -> None:
    assert claims.lost_reuse(runs(evolving=fig(lost=0.01), dynamo=fig(lost=0.2))).outcome == "yes"
    small_gap = claims.lost_reuse(runs(evolving=fig(lost=0.01), dynamo=fig(lost=0.015)))
    assert small_gap.outcome == "partly"
    assert claims.lost_reuse(runs(evolving=fig(lost=0.1), dynamo=fig(lost=0.3))).outcome == "no"
    assert claims.lost_reuse(runs(dynamo=fig())).outcome == "n/a"


def test_ttft_check() -> None:
    assert claims.ttft_balancing(runs(evolving=fig(p95=3), dynamo=fig(p95=30))).outcome == "yes"
    assert claims.ttft_balancing(runs(evolving=fig(p95=3), dynamo=fig(p95=4))).outcome == "partly"
    assert claims.ttft_balancing(runs(evolving=fig(p95=5), dynamo=fig(p95=4))).outcome == "no"


def log(down: float, n: int = 1) -> list[dict[str, float]]:
    return [{"requested": 0.0, "drained": 10.0, "up": 10.0 + down}] * n


def test_switch_cost_check() -> None:
    good = runs(evolving=fig(switch_log=log(6.2)), dynamo=fig(switch_log=log(700.0)))
    assert claims.switch_cost(good).outcome == "yes"
    one = claims.switch_cost(runs(evolving=fig(switch_log=log(6.2)), dynamo=fig()))
    assert one.outcome == "partly"
    bad = runs(evolving=fig(switch_log=log(60.0)), dynamo=fig(switch_log=log(700.0)))
    assert claims.switch_cost(bad).outcome == "no"
    assert claims.switch_cost(runs(evolving=fig(), dynamo=fig())).outcome == "n/a"


def test_beats_baselines_check() -> None:
    win = runs(evolving=fig(110), dynamo=fig(100), arrow=fig(90))
    assert claims.beats_baselines(win).outcome == "yes"
    half = runs(evolving=fig(95), dynamo=fig(100), arrow=fig(90))
    assert claims.beats_baselines(half).outcome == "partly"
    lose = runs(evolving=fig(80), dynamo=fig(100), arrow=fig(90))
    assert claims.beats_baselines(lose).outcome == "no"


def starts(*ends: str) -> dict[str, Any]:
    labels = ("3P6D", "4P5D", "5P4D", "6P3D")
    return {
        a: {"policies": {"evolving": fig(final_split=b)}} for a, b in zip(labels, ends, strict=True)
    }


def test_initial_splits_check() -> None:
    assert claims.initial_splits_converge(starts("5P4D", "5P4D", "4P5D", "5P4D")).outcome == "yes"
    v = claims.initial_splits_converge(starts("4P5D", "4P5D", "5P4D", "6P3D"))
    assert v.outcome == "partly"
    assert "spread 3 -> 2" in v.measured
    assert claims.initial_splits_converge(starts("3P6D", "4P5D", "5P4D", "6P3D")).outcome == "no"


def test_planner_ablation_check() -> None:
    kw = {"evolving-fixed": fig(100, lost=0.01)}
    assert claims.planner_ablation(runs(evolving=fig(110), **kw)).outcome == "yes"
    assert claims.planner_ablation(runs(evolving=fig(100), **kw)).outcome == "partly"
    lossy = {"evolving-fixed": fig(100, lost=0.2)}
    assert claims.planner_ablation(runs(evolving=fig(80), **lossy)).outcome == "no"


def test_beats_every_fair_baseline() -> None:
    sweeps = {"best-dynamo-static": fig(104, split="3P6D"), "best-arrow-static": fig(90)}
    win = claims.beats_baselines(runs(evolving=fig(105), dynamo=fig(100), **sweeps))
    assert win.outcome == "yes"
    assert "vs best-dynamo-static 3P6D 1.01x" in win.measured
    lose = claims.beats_baselines(runs(evolving=fig(103), dynamo=fig(100), **sweeps))
    assert lose.outcome == "partly"
    assert "not above: r best-dynamo-static" in lose.why


def test_baselines_below_their_own_best_static_check() -> None:
    own = {"best-dynamo-static": fig(100, split="4P5D"), "best-arrow-static": fig(100)}
    far = runs(dynamo=fig(60), arrow=fig(40), **own)
    assert claims.baselines_below_best_static(far).outcome == "yes"
    mixed = runs(dynamo=fig(99), arrow=fig(40), **own)
    assert claims.baselines_below_best_static(mixed).outcome == "partly"
    close = runs(dynamo=fig(99), arrow=fig(100), **own)
    assert claims.baselines_below_best_static(close).outcome == "no"
    assert claims.baselines_below_best_static(runs(dynamo=fig())).outcome == "n/a"


def test_infrastructure_alone_check() -> None:
    dyn = {"best-dynamo-hicache-static": fig(100, split="2P7D")}

    def verdict(ours: float) -> claims.Verdict:
        return claims.infrastructure_alone(runs(**{"best-static": fig(ours, split="3P6D")}, **dyn))

    assert verdict(130).outcome == "yes"
    assert verdict(110).outcome == "partly"
    assert verdict(90).outcome == "no"
    with_fixed = runs(**{"best-static": fig(130), "evolving-fixed": fig(80)}, **dyn)
    v = claims.infrastructure_alone(with_fixed)
    assert v.outcome == "yes"  # the start split is shown, not judged
    assert "evolving-fixed 0.80x" in v.measured
    assert claims.infrastructure_alone(runs(**dyn)).outcome == "n/a"


def test_mechanism_worth_check() -> None:
    every = {a.name: fig(95, lost=0.0) for a in ABLATIONS}
    assert claims.mechanism_worth(runs(evolving=fig(100), **every)).outcome == "yes"
    idle = {**every, "evolving-drop": fig(100)}
    v = claims.mechanism_worth(runs(evolving=fig(100), **idle))
    assert v.outcome == "partly"
    assert "evolving-drop" in v.why
    # Worth nothing in throughput, but reuse: still worth something.
    reuse = {**every, "evolving-lru": fig(100, lost=0.1)}
    assert claims.mechanism_worth(runs(evolving=fig(100), **reuse)).outcome == "yes"
    harmful = {**every, "evolving-no-pool": fig(110)}
    assert claims.mechanism_worth(runs(evolving=fig(100), **harmful)).outcome == "no"
    assert claims.mechanism_worth(runs(evolving=fig())).outcome == "n/a"


def test_ttft_prefers_the_routing_ablation() -> None:
    r = runs(evolving=fig(p95=3), dynamo=fig(p95=30), **{"evolving-dynamo-cost": fig(p95=4)})
    v = claims.ttft_balancing(r)
    assert v.outcome == "partly"
    assert "evolving-dynamo-cost" in v.measured


def test_switch_cost_reads_the_run_config() -> None:
    r = runs(evolving=fig(switch_log=log(6.2)), dynamo=fig(switch_log=log(180.0)))
    assert claims.switch_cost(r).outcome == "no"  # 180 s is not the default 700 s
    r["r"]["config"] = {"switch_restart_s": 180.0, "switch_in_place_s": 6.2}
    assert claims.switch_cost(r).outcome == "yes"


def test_the_held_out_protocol_keeps_its_halves_apart() -> None:
    tune, held = heldout.tune_files(), heldout.held_out_files()
    assert len(tune) == len(held) == 12
    assert not set(tune) & set(held)
    assert sorted(tune + held) == heldout.bundled_files()
    assert not set(heldout.TUNE_SEEDS) & set(heldout.HELD_OUT_SEEDS)
    assert not set(heldout.CONSUMED_SEEDS) & set(heldout.HELD_OUT_SEEDS)
    for name, levels in LEVELS_BY_DEPLOYMENT.items():
        for c in heldout.cells(name):  # agent counts between the levels, not at them
            assert c.seed in heldout.HELD_OUT_SEEDS
            kind = {"claude-code-held": "cc", "osworld": "osworld", "putnam": "putnam"}
            if c.kind in kind:
                counts = sorted(levels[kind[c.kind]].values())
                assert c.agents not in counts
                assert counts[0] < c.agents < counts[-1]
    pool = heldout.held_out_pool()
    names = {a.namespace.split("@")[0] for a in pool.agents}
    assert len(names) >= 12
    # The Mooncake cells draw from the two traces named, each request one agent (their
    # READMEs: 3,993 and 12,031 requests), whatever else the folder comes to hold.
    assert len(heldout.mooncake_pool().agents) == 3_993 + 12_031


def test_the_tuning_grid_draws_on_the_tuning_half_only() -> None:
    for name in LEVELS_BY_DEPLOYMENT:
        cells = heldout.tuning_cells(name)
        assert cells
        assert {c.seed for c in cells} == set(heldout.TUNE_SEEDS)
        assert "claude-code-held" not in {c.kind for c in cells}
        assert "mooncake" not in {c.kind for c in cells}  # the Mooncake trace is held out
        assert not {c.label for c in cells} & {c.label for c in heldout.cells(name)}
    tune = {a.namespace.split("@")[0] for a in heldout.tune_pool().agents}
    held = {a.namespace.split("@")[0] for a in heldout.held_out_pool().agents}
    assert len(tune) >= 12
    assert not tune & held
    tried = Size(planner_options=(("min_gain", 0.04),))  # a change tried on the grid
    assert all(
        r.config.planner_options == tried.planner_options for r in SCENARIOS["tuning"].runs(tried)
    )
    paper = SCENARIOS["tuning"].runs(Size(deployment=PAPER_DEPLOYMENT))
    assert [r.label for r in paper] == [c.label for c in heldout.tuning_cells("paper")]
    assert {r.workload.kind for r in paper} == {"claude-code-tune", "osworld", "putnam"}


def test_the_grids_agents_enter_over_a_quarter_of_the_run() -> None:
    """A grid cell is a stationary workload: its slots enter over the first quarter of the run
    (`heldout.STEADY_RAMP`), not all within the first minute as the other scenarios' do;
    `--start-ramp` sets it (60: a batch launched at once)."""
    assert {r.workload.ramp for r in SCENARIOS["heldout"].runs(Size())} == {900.0}
    assert {r.workload.ramp for r in SCENARIOS["tuning"].runs(Size(quick=True))} == {150.0}
    batch = SCENARIOS["tuning"].runs(Size(start_ramp_s=60.0))
    assert {r.workload.ramp for r in batch} == {60.0}
    assert {r.workload.ramp for r in SCENARIOS["shift"].runs(Size())} == {None}
    assert "entering over 900 s" in SCENARIOS["heldout"].runs(Size())[0].workload.describe()
    with pytest.raises(ValueError, match="must enter within the run"):
        SCENARIOS["tuning"].runs(Size(start_ramp_s=3600.0))

    def first_starts(ramp: float | None) -> list[float]:
        trace = Workload("osworld", 40, 3600.0, ramp).trace(4)
        return sorted(a.start for a in trace.agents if a.id.endswith(".0"))

    steady, together = first_starts(900.0), first_starts(None)
    assert len(steady) == len(together) == 40
    assert steady[0] >= 0.0
    assert steady[-1] < 900.0
    assert steady[-1] - steady[0] > 600.0
    assert together[-1] < 60.0  # the plan's default: every slot within the first minute


def test_a_fresh_held_out_draw_runs_the_same_cells_on_other_seeds() -> None:
    """`scenario run heldout --held-out-seeds 12,13`: every held-out cell on the seeds given,
    the seeds in the results; tuning data is refused as a draw."""
    fresh = SCENARIOS["heldout"].runs(Size(held_out_seeds=(12, 13)))
    protocol = SCENARIOS["heldout"].runs(Size())
    assert [r.label for r in fresh] == [c.label for c in heldout.cells("h100-llama", (12, 13))]
    assert {c.seed for c in heldout.cells("h100-llama", (12, 13))} == {12, 13}
    assert [r.label.rsplit("-s", 1)[0] for r in fresh] == [
        r.label.rsplit("-s", 1)[0] for r in protocol
    ]
    assert {r.config.seed for r in fresh}.isdisjoint({r.config.seed for r in protocol})
    heldout.check_fresh((12, 13))
    for bad, why in (
        ((0,), "tuning data"),
        ((3, 6), "tuning data"),
        ((6, 8), "tuning data"),  # a draw a change was judged on (2026-12-07)
        ((9, 12), "tuning data"),  # rule 2's tie was judged on 8-9 (2026-12-07)
        ((11, 12), "tuning data"),  # the pooled prefill queue on 10-11 (2026-12-08)
        ((12, 12), "twice"),
        ((), "one"),
    ):
        with pytest.raises(ValueError, match=why):
            heldout.check_fresh(bad)


def test_a_screen_may_run_a_consumed_draw_and_says_it_is_no_held_out_result() -> None:
    """`scenario run heldout --held-out-seeds 10,11 --screen`: a consumed draw is run (a planner
    change screened on the draw that led to it), and its results and report say it is tuning
    data; a fresh draw's say fresh."""
    from evolving_infra.sim.scenario_command import report

    heldout.check_screen((10, 11))
    with pytest.raises(ValueError, match="twice"):
        heldout.check_screen((10, 10))
    assert heldout.draw_of((10, 11)) == "consumed"
    assert heldout.draw_of((0, 12)) == "consumed"
    assert heldout.draw_of((12, 13)) == "fresh"
    base = {
        "scenario": "heldout",
        "shows": "-",
        "claim": "-",
        "quick": False,
        "seed": 0,
        "claims": [],
    }
    screened = report({**base, "held_out_seeds": [10, 11], "draw": "consumed", "runs": {}})
    assert "a consumed draw (tuning data), a screen, no held-out result" in screened
    fresh = report({**base, "held_out_seeds": [12, 13], "draw": "fresh", "runs": {}})
    assert "Held-out seeds: 12, 13 (a fresh draw" in fresh


def verdict_of(cells: dict[str, tuple[float, float, int]]) -> str:
    runs = {
        label: {
            "policies": {
                "evolving": {
                    "throughput_tokens_per_s": evo,
                    "switches": switches,
                    "duration_s": 3600.0,
                },
                "best-static": {"throughput_tokens_per_s": best},
            }
        }
        for label, (evo, best, switches) in cells.items()
    }
    return holds_on_held_out(runs).outcome


def test_the_tuning_grid_holds_to_the_same_bar() -> None:
    runs = {
        label: {
            "policies": {
                "evolving": {"throughput_tokens_per_s": evo, "switches": 2, "duration_s": 3600.0},
                "best-static": {"throughput_tokens_per_s": 100.0},
            }
        }
        for label, evo in (("a", 99.0), ("b", 97.0))
    }
    verdict = claims.holds_on_grid(runs)
    assert verdict.outcome == "partly"
    assert "tuning grid" in verdict.claim
    assert "not in b" in verdict.why


def test_holds_on_held_out_needs_every_cell() -> None:
    assert verdict_of({"a": (99.0, 100.0, 2), "b": (101.0, 100.0, 4)}) == "yes"
    assert verdict_of({"a": (97.0, 100.0, 2), "b": (101.0, 100.0, 4)}) == "partly"
    assert verdict_of({"a": (99.0, 100.0, 5), "b": (101.0, 100.0, 4)}) == "partly"
    assert verdict_of({"a": (90.0, 100.0, 1)}) == "no"
