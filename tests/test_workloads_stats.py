"""Trace statistics: h* checked against independent computations on raw files, exact figures on
hand-made files, and `evolving-infra trace stats --json`."""

from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import Any

import pytest

from evolving_infra import cli
from evolving_infra.workloads import generators, jsonl, stats
from evolving_infra.workloads.errors import TraceFormatError
from evolving_infra.workloads.model import (
    Agent,
    AgentId,
    BlockId,
    Branch,
    BranchId,
    BranchKind,
    Request,
    Trace,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "traces"
CC = DATA / "claude-code"
MOONCAKE = DATA / "mooncake" / "synthetic_trace.jsonl.xz"


# ---- independent computations, straight from the raw files ---------------------------------


def raw_cc_requests(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A conversation's requests in file order (sub-agents in place), `t` made absolute."""
    out: list[dict[str, Any]] = []

    def walk(items: list[dict[str, Any]], t0: float) -> None:
        for item in items:
            if item["type"] == "subagent":
                walk(item["requests"], t0 + item["t"])
            else:
                out.append(item | {"t": t0 + item["t"]})

    walk(doc["requests"], 0.0)
    return out


def seen_set_hits(prompts: list[list[int]]) -> list[int]:
    seen: set[int] = set()
    hits = []
    for ids in prompts:
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        hits.append(k)
        seen.update(ids)
    return hits


def raw_cc_hits(path: Path) -> tuple[int, int]:
    """(hits, prompt blocks) of one raw Claude Code file."""
    doc = json.loads(lzma.decompress(path.read_bytes()))
    ordered = sorted(raw_cc_requests(doc), key=lambda r: r["t"])  # stable: file order on ties
    prompts = [r["hash_ids"] for r in ordered]
    return sum(seen_set_hits(prompts)), sum(map(len, prompts))


@pytest.fixture(scope="module")
def cc_result() -> dict[str, Any]:
    files = stats.find_files([CC])
    per_file = [stats.file_stats(p) for p in files]
    return {
        "files": [{"path": str(p)} | s.to_dict() for p, s in zip(files, per_file, strict=True)],
        "total": stats.total(per_file).to_dict(),
    }


def test_cc_ideal_hit_rate_matches_raw_computation(cc_result: dict[str, Any]) -> None:
    rows = cc_result["files"]
    assert len(rows) == 24
    hits = blocks = 0
    for row in rows:
        h, n = raw_cc_hits(Path(row["path"]))
        assert (row["ideal_hit_blocks"], row["prompt_blocks"]) == (h, n), row["path"]
        assert row["ideal_hit_rate"] == pytest.approx(h / n)
        hits, blocks = hits + h, blocks + n
    total = cc_result["total"]
    assert (total["ideal_hit_blocks"], total["prompt_blocks"]) == (hits, blocks)
    assert total["ideal_hit_rate"] == pytest.approx(hits / blocks)
    # A ratio of sums, not a mean of the per-file ratios.
    assert total["ideal_hit_rate"] != pytest.approx(
        sum(r["ideal_hit_rate"] for r in rows) / len(rows), abs=1e-4
    )


def test_cc_totals_are_sums(cc_result: dict[str, Any]) -> None:
    rows, total = cc_result["files"], cc_result["total"]
    for key in ("requests", "prompt_tokens", "output_tokens", "uncached_prompt_tokens"):
        assert total[key] == sum(r[key] for r in rows)
    assert total["kind"] == "claude-code"
    assert total["block_size"] == 64
    assert total["agents"] == 24
    assert total["requests"] == 3204
    assert total["prefill_decode_ratio"] == total["prompt_tokens"] / total["output_tokens"]
    assert 0 < total["uncached_prefill_decode_ratio"] < total["prefill_decode_ratio"]
    assert 0 <= total["wait_p50"] <= total["wait_p90"] <= total["wait_p99"]


# ---- hand-made Claude Code files ------------------------------------------------------------


def cc_request(t: float, ids: list[int], extra: int = 0, **kw: Any) -> dict[str, Any]:
    return {"t": t, "type": "n", "in": 64 * len(ids) + extra, "out": 10, "hash_ids": ids} | kw


def write_cc(path: Path, conversation: str, requests: list[dict[str, Any]]) -> Path:
    doc = {"id": conversation, "block_size": 64, "requests": requests}
    path.write_text(json.dumps(doc))
    return path


def small_cc(tmp_path: Path) -> Path:
    sub = {
        "t": 5.0,
        "type": "subagent",
        "agent_id": "a1",
        "duration_ms": 2000,
        "status": "completed",
        # Its first request ties with the parent's next one at t = 5; it is first in the file.
        "requests": [cc_request(0.0, [1, 9]), cc_request(2.0, [1, 9, 10])],
    }
    return write_cc(
        tmp_path / "conv.json",
        "conv",
        [
            cc_request(0.0, [1, 2, 3], extra=10, think_time=0.0),
            sub,
            cc_request(5.0, [1, 2, 3, 9, 4], think_time=2.0),
            cc_request(6.0, [7, 1, 2], think_time=1.0),  # a compaction: 1 and 2 are not hits
            cc_request(10.0, [7, 1, 2, 5], think_time=4.0),
        ],
    )


def test_cc_exact_hits_with_ties_subagents_and_a_compaction(tmp_path: Path) -> None:
    s = stats.file_stats(small_cc(tmp_path))
    # Order: [1,2,3] 0 hits; sub [1,9] 1; parent [1,2,3,9,4] 4 (9 came from the sub-agent);
    # [7,1,2] 0 (stops at 7); sub [1,9,10] at t = 7: 2; [7,1,2,5] 3.
    assert (s.ideal_hit_blocks, s.prompt_blocks) == (10, 20)
    d = s.to_dict()
    assert d["ideal_hit_rate"] == 0.5
    assert d["requests"] == 6
    assert d["prompt_tokens"] == 20 * 64 + 10
    assert d["output_tokens"] == 60
    assert d["uncached_prompt_tokens"] == (3 * 64 + 10) + 64 + 64 + 3 * 64 + 64 + 64
    assert d["prefill_decode_ratio"] == (20 * 64 + 10) / 60
    assert d["uncached_prefill_decode_ratio"] == d["uncached_prompt_tokens"] / 60
    assert (d["agents"], d["branches"], d["subagents"], d["forks"]) == (1, 2, 1, 0)
    assert d["compactions"] == 1
    # think_time 0, 2, 1, 4 (sub-agent requests have none).
    assert d["wait_p50"] == 1.5
    assert d["wait_p90"] == pytest.approx(3.4)
    assert d["wait_p99"] == pytest.approx(3.94)


def test_cc_files_do_not_share_a_cache(tmp_path: Path) -> None:
    a = write_cc(tmp_path / "a.json", "a", [cc_request(0, [1, 2]), cc_request(1, [1, 2, 3])])
    b = write_cc(tmp_path / "b.json", "b", [cc_request(0, [1, 2, 3, 4])])
    sa, sb = stats.file_stats(a), stats.file_stats(b)
    assert (sa.ideal_hit_blocks, sa.prompt_blocks) == (2, 5)
    assert (sb.ideal_hit_blocks, sb.prompt_blocks) == (0, 4)
    t = stats.total([sa, sb])
    assert t.to_dict()["ideal_hit_rate"] == 2 / 9
    assert t.to_dict()["wait_p50"] is None  # no think_time anywhere


# ---- Mooncake -------------------------------------------------------------------------------


def test_mooncake_ideal_hit_rate_matches_raw_computation() -> None:
    lines = lzma.decompress(MOONCAKE.read_bytes()).decode().splitlines()
    recs = [json.loads(line) for line in lines]
    ordered = sorted(recs, key=lambda r: r["timestamp"])  # stable: file order on ties
    prompts = [r["hash_ids"] for r in ordered]
    hits, blocks = sum(seen_set_hits(prompts)), sum(map(len, prompts))
    s = stats.file_stats(MOONCAKE).to_dict()
    assert s["kind"] == "mooncake"
    assert (s["ideal_hit_blocks"], s["prompt_blocks"]) == (hits, blocks)
    assert round(s["ideal_hit_rate"], 4) == 0.6396
    assert s["requests"] == s["agents"] == len(recs) == 3993
    assert s["block_size"] == 512
    assert s["prompt_tokens"] == sum(r["input_length"] for r in recs)
    assert s["output_tokens"] == sum(r["output_length"] for r in recs)
    assert s["wait_p99"] == 0.0  # open-loop: every request is its agent's first, at its start


# ---- our format -----------------------------------------------------------------------------


def req(wait: float, tokens: int, out: int, blocks: tuple[int, ...], **kw: Any) -> Request:
    return Request(wait, tokens, out, tuple(BlockId(b) for b in blocks), **kw)


def small_trace() -> Trace:
    a1 = Agent(
        AgentId("a1"),
        "test",
        "a1",
        (
            Branch(
                BranchId("root"),
                BranchKind.ROOT,
                requests=(
                    req(0, 16, 4, (1, 2), shared=2),
                    req(1, 20, 2, (1, 2, 3), shared=2, compaction=True, end=True),
                ),
            ),
            Branch(
                BranchId("f"),
                BranchKind.FORK,
                parent=BranchId("root"),
                after=0,
                requests=(req(0, 20, 0, (1, 2, 7), shared=2, end=True),),
            ),
        ),
        prefix="sys",
    )
    a2 = Agent(
        AgentId("a2"),
        "test",
        "a2",
        (
            Branch(
                BranchId("root"),
                BranchKind.ROOT,
                requests=(req(0, 12, 4, (1,), shared=2, end=True),),
            ),
            Branch(
                BranchId("s"),
                BranchKind.SUBAGENT,
                parent=BranchId("root"),
                after=0,
                requests=(req(0, 4, 0, (5,), end=True),),
            ),
        ),
        start=0.5,
        prefix="sys",
    )
    return Trace("small", 4, (a1, a2), prefixes={"sys": 2})


def test_our_format_exact_figures(tmp_path: Path) -> None:
    path = tmp_path / "small.jsonl"
    jsonl.save(small_trace(), path)
    d = stats.file_stats(path).to_dict()
    # Nominal order: a1.root[0] at 0, a1.f[0] at 0.1016, a2.root[0] at 0.5, a2.s[0] at 0.6012,
    # a1.root[1] at 1.1016. Hits: 0; 2 prefix + 2 own of the fork's base; 2 prefix (a2's own
    # namespace); 0; 2 prefix + 2 own.
    assert (d["ideal_hit_blocks"], d["prompt_blocks"]) == (10, 18)
    assert d["ideal_hit_rate"] == 10 / 18
    assert (d["requests"], d["prompt_tokens"], d["output_tokens"]) == (5, 72, 10)
    assert d["uncached_prompt_tokens"] == 16 + 4 + 4 + 4 + 4
    assert d["prefill_decode_ratio"] == 7.2
    assert d["uncached_prefill_decode_ratio"] == 3.2
    assert (d["agents"], d["branches"], d["subagents"], d["forks"], d["compactions"]) == (
        2,
        4,
        1,
        1,
        1,
    )
    assert (d["kind"], d["block_size"]) == ("trace", 4)
    assert (d["wait_p50"], d["wait_p90"], d["wait_p99"]) == (0, pytest.approx(0.6), 0.96)


def test_percentile_interpolates() -> None:
    assert stats.percentile([], 50) is None
    assert stats.percentile([3.0], 99) == 3.0
    assert stats.percentile([0.0, 10.0], 50) == 5.0
    assert stats.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)


def test_detect_and_find_files(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    jsonl.save(small_trace(), tmp_path / "sub" / "t.jsonl.gz")
    (tmp_path / "m.jsonl").write_text('{"timestamp": 0, "input_length": 1, "hash_ids": [1]}\n')
    (tmp_path / "x.jsonl").write_text('{"something": "else"}\n')
    (tmp_path / "notes.txt").write_text("not a trace")
    assert stats.find_files([tmp_path]) == [
        tmp_path / "m.jsonl",
        tmp_path / "sub" / "t.jsonl.gz",
        tmp_path / "x.jsonl",
    ]
    assert stats.detect(tmp_path / "sub" / "t.jsonl.gz") == "trace"
    assert stats.detect(tmp_path / "m.jsonl") == "mooncake"
    assert stats.detect(CC / "trace_0095.json.xz") == "claude-code"
    # Not Mooncake's: ours, and our reader says what is wrong.
    assert stats.detect(tmp_path / "x.jsonl") == "trace"
    with pytest.raises(TraceFormatError) as e:
        stats.file_stats(tmp_path / "x.jsonl")
    assert (e.value.line, e.value.field) == (1, "format")
    with pytest.raises(TraceFormatError, match="not a trace file name"):
        stats.detect(tmp_path / "notes.txt")


# ---- the CLI --------------------------------------------------------------------------------

KEYS = {
    *("requests", "prompt_blocks", "ideal_hit_blocks", "ideal_hit_rate", "prompt_tokens"),
    *("output_tokens", "prefill_decode_ratio", "uncached_prefill_decode_ratio", "wait_p50"),
    *("wait_p90", "wait_p99", "agents", "branches", "subagents", "forks", "compactions"),
    *("block_size", "kind"),
}


def test_cli_stats_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ours = tmp_path / "small.jsonl.xz"
    jsonl.save(small_trace(), ours)
    files = [CC / "trace_0277.json.xz", CC / "trace_0095.json.xz", ours]
    rc = cli.main(["trace", "stats", "--json", *map(str, files)])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.endswith("\n")
    assert out.count("\n") == 1
    result = json.loads(out)
    assert set(result) == {"files", "total"}
    assert [f["path"] for f in result["files"]] == list(map(str, files))
    for row in [*result["files"], result["total"]]:
        assert set(row) >= KEYS
    assert result["total"]["kind"] == "mixed"
    assert result["total"]["block_size"] is None
    assert result["total"]["requests"] == 53 + 5 + 5


def test_cli_stats_table_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trace", "stats", str(CC / "trace_0095.json.xz")]) == 0
    assert "trace_0095.json.xz" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    assert cli.main(["trace", "stats", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:1:" in err
    assert "Traceback" not in err
    assert cli.main(["trace", "stats", str(tmp_path / "empty-folder")]) == 2


@pytest.mark.parametrize(
    "argv", [["trace", "--help"], ["trace", "stats", "--help"], ["trace", "import", "--help"]]
)
def test_cli_help(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    assert "usage: evolving-infra trace" in capsys.readouterr().out


@pytest.mark.parametrize("before", [True, False])
def test_cli_config_before_or_after_the_action(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], before: bool
) -> None:
    config = tmp_path / "c.toml"
    config.write_text("json = true\n")
    path = str(CC / "trace_0095.json.xz")
    where = ["--config", str(config)]
    argv = ["trace", *where, "stats", path] if before else ["trace", "stats", path, *where]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["total"]["requests"] == 5
    config.write_text("jsn = true\n")
    assert cli.main(argv) == 2
    assert "jsn: unknown option" in capsys.readouterr().err


def test_cli_gen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    plans: list[generators.SlotPlan] = []

    def generate(name: str, plan: generators.SlotPlan) -> Trace:
        assert name == "osworld"
        plans.append(plan)
        return small_trace()

    monkeypatch.setattr(generators, "generate", generate)
    config = tmp_path / "g.toml"
    config.write_text("agents = 3\nseed = 9\n")
    out = tmp_path / "g.jsonl.xz"
    argv = ["trace", "gen", "osworld", "--duration", "60", "-o", str(out), "--config", str(config)]
    assert cli.main(argv) == 0
    assert plans == [generators.SlotPlan(agents=3, duration=60.0, seed=9)]
    assert capsys.readouterr().out.startswith(f"wrote {out}: 'small', 2 agents, 4 branches")
    assert jsonl.load(out) == small_trace()
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--agents", "0"])
    assert e.value.code == 2
    assert "expected an int >= 1" in capsys.readouterr().err
