"""`benches/gpu/iteration_profile.py` and its package `benches/gpu/iteration_profiler`: the plan
(the dry run needs no torch), the CSV, and a CPU smoke run of the real code path (torch comes with
the `sglang` extra, which `make test` installs; without it the smoke run fails rather than skip)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import astuple
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from evolving_infra.timing import samples, specs

SCRIPT = Path(__file__).resolve().parents[1] / "benches" / "gpu" / "iteration_profile.py"


@pytest.fixture(scope="module")
def ip() -> Iterator[SimpleNamespace]:
    """The script's package, imported from beside it (importing it imports no torch): `ip.plan`
    and `ip.runner` are its modules."""
    folder = str(SCRIPT.parent)
    sys.path.insert(0, folder)
    try:
        yield SimpleNamespace(
            plan=importlib.import_module("iteration_profiler.plan"),
            runner=importlib.import_module("iteration_profiler.runner"),
        )
    finally:
        sys.path.remove(folder)
        for name in list(sys.modules):
            if name.partition(".")[0] == "iteration_profiler" or name.startswith(
                "_iteration_profile_"
            ):
                del sys.modules[name]


def run_script(
    *args: str, block: tuple[str, ...] = ("torch",), timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """The script in a fresh interpreter in which importing any of `block` fails."""
    code = (
        "import runpy, sys\n"
        f"for name in {block!r}:\n"
        "    sys.modules[name] = None\n"
        f"sys.argv = [{str(SCRIPT)!r}, *{list(args)!r}]\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
    )


def plan_line(stdout: str) -> dict[str, float]:
    """The dry run's last line: `plan: prefill-single=N ... estimate_s=X budget_s=Y`."""
    line = stdout.strip().splitlines()[-1]
    assert line.startswith("plan: "), stdout
    return {k: float(v) for k, v in (item.split("=") for item in line.split()[1:])}


def test_help_explains_the_options() -> None:
    r = run_script("--help")
    assert r.returncode == 0, r.stderr
    for option in ("--dry-run", "--quick", "--budget-s", "--out", "--layers", "--repeats"):
        assert option in r.stdout
    assert "benches/gpu/data/h200-llama3-8b.csv" in r.stdout


@pytest.mark.parametrize("quick", [False, True])
def test_dry_run_needs_no_torch(quick: bool) -> None:
    r = run_script("--dry-run", *(["--quick"] if quick else []))
    assert r.returncode == 0, r.stderr
    counts = plan_line(r.stdout)
    for group in ("prefill-single", "prefill-batch", "decode"):
        assert counts[group] > 0
    assert counts["total"] == sum(counts[g] for g in ("prefill-single", "prefill-batch", "decode"))
    assert counts["budget_s"] == (100.0 if quick else 480.0)
    assert 0 < counts["estimate_s"] <= counts["budget_s"]
    assert "first compositions:" in r.stdout


def test_quick_plans_less_than_default() -> None:
    default = plan_line(run_script("--dry-run").stdout)
    quick = plan_line(run_script("--dry-run", "--quick").stdout)
    assert quick["total"] < default["total"]
    assert quick["estimate_s"] < default["estimate_s"]


def test_dry_run_without_the_package() -> None:
    """The script loads specs.py and samples.py from the tree by path: it plans the same where
    the package does not import (on a GPU machine, without its built native module)."""
    plain = run_script("--dry-run", "--seed", "5")
    bare = run_script("--dry-run", "--seed", "5", block=("torch", "evolving_infra"))
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout == plain.stdout


def test_dry_run_reports_a_model_that_does_not_fit() -> None:
    r = run_script("--dry-run", "--model", "llama-3-70b")
    assert r.returncode == 2
    assert "--layers" in r.stderr
    fits = run_script("--dry-run", "--model", "llama-3-70b", "--layers", "20")
    assert fits.returncode == 0, fits.stderr
    assert "20 of 80 layers" in fits.stdout


def test_plan_out_writes_the_compositions(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = run_script("--dry-run", "--quick", "--plan-out", str(out))
    assert r.returncode == 0, r.stderr
    plan = json.loads(out.read_text())
    assert len(plan["compositions"]) == plan["total"] == plan_line(r.stdout)["total"]


def test_plan_is_seeded(ip: SimpleNamespace) -> None:
    a = ip.plan.make_plan(ip.plan.Options(seed=3))
    b = ip.plan.make_plan(ip.plan.Options(seed=3))
    c = ip.plan.make_plan(ip.plan.Options(seed=4))
    assert a.compositions == b.compositions
    assert a.compositions != c.compositions
    batches = [x.batch for x in a.compositions if x.group == "prefill-batch"]
    assert batches != [x.batch for x in c.compositions if x.group == "prefill-batch"]


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@pytest.mark.parametrize("quick", [False, True])
def test_plan_respects_the_grids(ip: SimpleNamespace, quick: bool) -> None:
    plan = ip.plan.make_plan(ip.plan.Options(quick=quick))
    comps: list[Any] = plan.compositions
    singles = [c for c in comps if c.group == "prefill-single"]
    batches = [c for c in comps if c.group == "prefill-batch"]
    decodes = [c for c in comps if c.group == "decode"]
    for c in singles:
        ((u, cached),) = c.batch
        assert is_pow2(u)
        assert 16 <= u <= 32768
        assert cached == 0 or (is_pow2(cached) and 128 <= cached <= 131072)
        if quick:  # the coarse grid: 4x steps from the top
            assert math.log2(u) % 2 == 1
            assert cached == 0 or math.log2(cached) % 2 == 1
    assert {c.batch[0] for c in singles} >= {(32768, 0), (32, 131072), (32768, 131072)}
    for c in batches:
        assert 2 <= len(c.batch) <= 16
        assert all(u >= 16 and cached >= 0 for u, cached in c.batch)
        assert sum(u for u, _ in c.batch) <= 32768
    for c in decodes:
        assert 1 <= c.batch_size <= 256
        assert all(x >= 1 for x in c.contexts)
        assert list(c.contexts) == sorted(c.contexts)
        if c.level < 2:  # grid points: B x context per request, both powers of two
            assert is_pow2(c.batch_size)
            per_request = c.context_tokens // c.batch_size
            assert c.context_tokens == per_request * c.batch_size
            assert is_pow2(per_request)
            assert 256 <= per_request <= 32768
    assert {c.batch_size for c in decodes} >= {1, 256}
    # Memory and budget.
    assert all(c.kv_tokens <= plan.kv_capacity_tokens for c in comps)
    assert sum(plan.over_memory.values()) > 0  # e.g. B=256 x 32k does not fit 141 GB
    assert plan.estimate_s <= plan.options.budget
    assert all(c.warmup >= 1 and c.repeats >= 1 for c in comps)


def test_the_budget_bounds_the_plan(ip: SimpleNamespace) -> None:
    full = ip.plan.make_plan(ip.plan.Options())
    small = ip.plan.make_plan(ip.plan.Options(budget_s=60))
    assert small.estimate_s <= 60 < full.estimate_s
    assert len(small.compositions) < len(full.compositions)
    assert all(small.count(g) > 0 for g in ip.plan.PHASES)
    assert sum(small.over_budget.values()) > 0
    # The run order mixes the groups from the start.
    assert {c.group for c in small.compositions[:6]} == set(ip.plan.PHASES)


def test_memory_bounds_the_plan(ip: SimpleNamespace) -> None:
    big = ip.plan.make_plan(ip.plan.Options())
    small = ip.plan.make_plan(ip.plan.Options(memory_gb=40))
    assert small.kv_capacity_tokens < big.kv_capacity_tokens
    assert all(c.kv_tokens <= small.kv_capacity_tokens for c in small.compositions)
    assert small.over_memory["decode"] > big.over_memory["decode"]
    with pytest.raises(ip.plan.PlanError, match="--layers"):
        ip.plan.make_plan(ip.plan.Options(model="llama-3-70b"))
    with pytest.raises(ip.plan.PlanError, match="--layers must be"):
        ip.plan.make_plan(ip.plan.Options(layers=0))


def test_split_contexts_adds_up(ip: SimpleNamespace) -> None:
    import random

    rng = random.Random(1)
    for n, total in [(1, 256), (2, 512), (7, 7), (256, 256 * 2048), (13, 100_003)]:
        parts = ip.plan.split_contexts(total, n, rng)
        assert len(parts) == n
        assert sum(parts) == total
        assert min(parts) >= 1
        assert list(parts) == sorted(parts)


def test_decode_groups_cover_every_request(ip: SimpleNamespace) -> None:
    contexts = (3, 4, 30, 31, 77, 77, 200)
    for groups in (1, 2, 4, 10):
        layout = ip.plan.decode_groups(contexts, groups)
        assert len(layout) == min(groups, len(contexts))
        at = first = 0
        for g in layout:
            assert (g.first, g.offset) == (first, at)
            lens = [c + 1 for c in contexts[g.first : g.first + g.count]]
            assert g.length >= max(lens)
            assert g.masked == (min(lens) != max(lens))
            if not g.masked:
                assert g.length == lens[0]
            first += g.count
            at += g.count * g.length
        assert first == len(contexts)


def test_figures_are_those_of_specs(ip: SimpleNamespace) -> None:
    models, gpus = ip.plan.models(), ip.plan.gpus()
    dense = [k for k, m in specs.MODELS.items() if not m.experts and not m.kv_lora_rank]
    assert list(models) == [*dense, "tiny"]  # its torch layers build dense GQA models only
    assert "llama-3-70b" in dense
    assert "kimi-k2" not in models
    assert "glm-4.5" not in models
    for name in dense:
        assert astuple(models[name]) == astuple(specs.MODELS[name])
    assert {name: astuple(g) for name, g in gpus.items()} == {
        name: astuple(g) for name, g in specs.GPUS.items()
    }


def test_csv_is_the_samples_format(ip: SimpleNamespace, tmp_path: Path) -> None:
    plan, runner = ip.plan, ip.runner
    prefill = plan.Composition("prefill", "prefill-batch", 2, batch=((100, 0), (16, 4096)))
    decode = plan.Composition("decode", "decode", 0, contexts=(255, 257, 300))
    rows = [
        runner.Measured(prefill, 0.0123, (0.0123,), 1, False, 4212),
        runner.Measured(decode, 0.0045, (0.0044, 0.0045, 0.0046), 1, True, 815),
    ]
    out = tmp_path / "a.csv"
    runner.write_samples(rows, out)
    assert out.read_text().splitlines()[0] == ",".join(samples.CSV_COLUMNS)
    assert samples.read_csv(out) == [
        samples.Sample("prefill", 0.0123, batch=((100, 0), (16, 4096))),
        samples.Sample("decode", 0.0045, batch_size=3, context_tokens=812),
    ]
    assert runner.sidecar_path(out) == tmp_path / "a.json"
    assert not (tmp_path / "a.csv.tmp").exists()


def test_a_run_needs_an_out_file() -> None:
    r = run_script("--quick")
    assert r.returncode == 2
    assert "--out" in r.stderr


def test_cpu_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "tiny.csv"
    r = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--model",
            "tiny",
            "--quick",
            "--budget-s",
            "60",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    got = samples.read_csv(out)
    assert got
    assert {s.phase for s in got} == {"prefill", "decode"}
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["layers"] == meta["full_layers"] == 2
    assert meta["measured"] == len(got)
    assert meta["model"]["hidden"] == 256
