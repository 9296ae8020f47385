"""`evolving-infra demo`: replays of small bundled traces, in-process and through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from evolving_infra import cli
from evolving_infra.workloads import load_conversations, merge_by_time

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces" / "claude-code"
# Small files; trace_0277 has four sub-agents.
SMALL = [TRACES / f"{name}.json.xz" for name in ("trace_0277", "trace_0485", "trace_0630")]


def run_demo(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    rc = cli.main(["demo", "--json", "--traces", *map(str, SMALL), *args])
    out = capsys.readouterr().out
    assert rc == 0
    result: dict[str, Any] = json.loads(out)
    return result


def ideal_hit_rate(paths: list[Path]) -> float:
    """One infinite cache shared by all nodes: a block hits if its hash was seen before."""
    seen: set[int] = set()
    hits = total = 0
    for r in merge_by_time(load_conversations(paths)):
        hits += sum(b in seen for b in r.blocks)
        total += len(r.blocks)
        seen.update(r.blocks)
    return hits / total


def test_small_cluster_with_eviction(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_demo(capsys, "--nodes", "3", "--l1-blocks", "300", "--l2-blocks", "600")
    nodes, total = result["nodes"], result["total"]
    assert [n["node"] for n in nodes] == [0, 1, 2]
    assert result["conversations"] == 3
    assert total["requests"] == sum(n["requests"] for n in nodes) == 53 + 12 + 17
    assert total["prompt_blocks"] == 40230 + 10840 + 14292
    for row in [*nodes, total]:
        assert 0.0 <= row["hit_rate"] <= 1.0
        assert row["l1_hits"] + row["l2_hits"] <= row["prompt_blocks"]
        hits = row["l1_hits"] + row["l2_hits"]
        assert row["hit_rate"] == pytest.approx(hits / row["prompt_blocks"])
    assert total["l1_hits"] > 0
    assert total["l2_hits"] > 0
    assert result["evicted_blocks"]["L1"] > 0
    assert result["ideal_hit_rate"] == pytest.approx(ideal_hit_rate(SMALL))
    assert total["hit_rate"] <= result["ideal_hit_rate"]
    assert result["lost_kv_reuse"] == pytest.approx(
        1 - total["hit_rate"] / result["ideal_hit_rate"]
    )
    assert 0.0 < result["lost_kv_reuse"] < 1.0
    stats = result["directory"]
    assert stats["blocks"] > 0
    assert stats["memory_bytes"] > 0
    assert stats["bytes_per_block"] == stats["memory_bytes"] // stats["blocks"]
    # Capacities hold after every request, so also at the end.
    assert stats["locations_l1"] <= 3 * 300
    assert stats["locations_l2"] <= 3 * 600
    assert stats["branches"] == 0  # every branch ended after its last request


def test_one_node_without_eviction_loses_no_reuse(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_demo(capsys, "--nodes", "1", "--l1-blocks", "1000000", "--l2-blocks", "0")
    assert result["evicted_blocks"] == {"L1": 0, "L2": 0}
    assert result["total"]["l2_hits"] == 0
    assert result["total"]["hit_rate"] == pytest.approx(result["ideal_hit_rate"])
    assert result["lost_kv_reuse"] == pytest.approx(0.0)


def test_same_seed_same_result(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--nodes", "4", "--l1-blocks", "200", "--l2-blocks", "200", "--seed", "7")
    a, b = run_demo(capsys, *args), run_demo(capsys, *args)
    for r in (a, b):
        del r["replay_seconds"]
    assert a == b


def test_config_file_is_honoured_and_flags_override_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "demo.toml"
    # Relative paths in the file are relative to the file.
    (tmp_path / "traces").mkdir()
    for p in SMALL[1:]:
        (tmp_path / "traces" / p.name).write_bytes(p.read_bytes())
    traces = ", ".join(f'"traces/{p.name}"' for p in SMALL[1:])
    config.write_text(
        f"nodes = 3\nl1-blocks = 123\nl2_blocks = 0\njson = true\ntraces = [{traces}]\n"
    )
    assert cli.main(["demo", "--config", str(config)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["nodes"] == 3
    assert len(result["nodes"]) == 3
    assert result["config"]["l1_blocks"] == 123
    assert result["config"]["l2_blocks"] == 0
    assert result["conversations"] == 2
    assert result["total"]["l2_hits"] == 0

    assert cli.main(["demo", "--config", str(config), "--nodes", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["nodes"] == 2
    assert result["config"]["l1_blocks"] == 123


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("colour = 3\n", "colour: unknown option"),
        ('nodes = "many"\n', "nodes: expected an int >= 1, got 'many'"),
        ("nodes = 0\n", "nodes: expected an int >= 1"),
        ("json = 1\n", "json: expected true or false"),
        ("nodes = [\n", "not TOML"),
    ],
)
def test_bad_config_file_is_reported(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, toml: str, message: str
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(toml)
    assert cli.main(["demo", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert str(config) in err
    assert message in err


def test_malformed_trace_is_reported(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"id": "x", "block_size": 64, "requests": [{"type": "n"}]}))
    assert cli.main(["demo", "--traces", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: requests[0].t: missing" in err


def test_same_conversation_twice_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--traces", str(SMALL[1]), str(SMALL[1])]) == 2
    assert "is also in" in capsys.readouterr().err


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--traces", str(SMALL[1]), "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "L1 hits" in out
    assert "lost KV reuse" in out
    assert "B/block" in out


def test_help_via_subprocess() -> None:
    demo_help = subprocess.run(
        [sys.executable, "-m", "evolving_infra.cli", "demo", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    for flag in ("--nodes", "--l1-blocks", "--l2-blocks", "--traces", "--limit-files", "--seed"):
        assert flag in demo_help
    assert "--json" in demo_help
    assert "--config" in demo_help
    assert "lost KV reuse" in demo_help
    top = subprocess.run(
        [sys.executable, "-m", "evolving_infra", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "demo" in top
