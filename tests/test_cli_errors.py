"""The CLI's errors (issue 23): what a user can get wrong is ONE line on stderr, `evolving-infra
CMD: error: WHAT: FIX`, with exit status 2 and no traceback; argparse's own errors are its usage
and one error line; a child process that fails in `cluster up` is status 1 with a first line that
names it and its log; a bug is one `internal error` line, status 1.

Each test runs the real command, in this process (`cli.main`) or, where the process as a whole
matters, in a child (`sys.executable -c ...`, with dependencies hidden from `find_spec`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import io
import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from rich.console import Console

from evolving_infra import cli, demo
from evolving_infra.cluster import command as cluster_command
from evolving_infra.cluster import procs
from evolving_infra.engines.pool import master as master_mod
from evolving_infra.engines.pool.errors import MooncakeMissingError
from evolving_infra.engines.sglang import command as sglang_command
from evolving_infra.engines.sglang import launcher
from evolving_infra.errors import CommandError, one_line, os_error_line
from evolving_infra.ports import free_ports
from evolving_infra.replay import command as replay_command

BUNDLED = Path(__file__).parents[1] / "data" / "traces" / "claude-code"
TRACE = sorted(p for p in BUNDLED.iterdir() if ".json" in p.name)[0]  # one small bundled trace

# A child that runs the CLI with some top-level packages hidden from `importlib.util.find_spec`
# (how the CLI looks for optional dependencies), as if they were not installed.
HIDING_CLI = """\
import importlib.util, sys
hidden = set(sys.argv[1].split(",")) - {""}
real = importlib.util.find_spec
def find_spec(name, package=None):
    return None if name.partition(".")[0] in hidden else real(name, package)
importlib.util.find_spec = find_spec
from evolving_infra.cli import main
sys.exit(main(sys.argv[2:]))
"""


def run_cli(
    *argv: str, hide: tuple[str, ...] = (), cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", HIDING_CLI, ",".join(hide), *argv],
        capture_output=True, text=True, timeout=60, cwd=cwd, check=False,
    )  # fmt: skip


def error_line(err: str, command: str) -> str:
    """The one line of `err`, checked to be the CLI's error line of `command`."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"evolving-infra {command}: error: "), err
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another process (this test) listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def hide(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name.partition(".")[0] in names else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def fake_program(path: Path, script: str) -> Path:
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return path


# -- missing optional dependencies -------------------------------------------------------------


def test_cluster_up_without_mooncake_is_one_line(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    out = run_cli("cluster", "up", "--engines", "2", "--router-port", str(free_ports(1)[0]),
                  "--log-dir", str(logs), hide=("mooncake",), cwd=tmp_path)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert error_line(out.stderr, "cluster") == (
        "evolving-infra cluster: error: the shared L2 pool needs Mooncake:"
        " pip install 'evolving-infra[pool]', or run with --no-pool"
    )
    assert not list(logs.glob("engine-*.log"))  # nothing was started


def test_cluster_up_with_replicas_and_no_redis_server_is_one_line(tmp_path: Path) -> None:
    """Router replicas share a Redis server: without one installed, `cluster up --routers 2`
    says so before anything starts."""
    logs = tmp_path / "logs"
    out = subprocess.run(
        [sys.executable, "-m", "evolving_infra", "cluster", "up", "--routers", "2", "--no-pool",
         "--router-port", "0", "--log-dir", str(logs)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False,
        env={**os.environ, "PATH": str(tmp_path)},  # no redis-server on it
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    line = error_line(out.stderr, "cluster")
    assert "redis-server is not installed" in line
    assert "apt-get install redis-server" in line
    assert not list(logs.glob("*.log"))


def test_front_given_a_replica_twice_is_one_line() -> None:
    out = run_cli("front", "--routers", "http://127.0.0.1:1", "http://127.0.0.1:1")
    assert out.returncode == 2, out.stderr
    assert "each replica once" in error_line(out.stderr, "front")


def test_cluster_up_without_mooncakes_system_libraries_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The bundled master as the dynamic loader runs it when libibverbs1 is not installed.
    master = fake_program(
        tmp_path / "mooncake_master",
        'echo "$0: error while loading shared libraries: libibverbs.so.1: cannot open shared'
        ' object file: No such file or directory" >&2; exit 127',
    )
    monkeypatch.setattr(master_mod, "mooncake_binary", lambda name: master)
    argv = ["cluster", "up", "--engines", "2", "--router-port", str(free_ports(1)[0]),
            "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    assert cli.main(argv) == 2
    line = error_line(capsys.readouterr().err, "cluster")
    for words in (
        "libibverbs.so.1",
        "Debian packages libibverbs1 libnuma1 libcurl4",
        "apt-get install -y libibverbs1 libnuma1 libcurl4",
        "or run with --no-pool",
    ):
        assert words in line, line


def test_the_sglang_backend_without_sglang_is_one_line(tmp_path: Path) -> None:
    out = run_cli("engine", "--backend", "sglang", "--port", "0", hide=("sglang",), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    line = error_line(out.stderr, "engine")
    assert "--backend sglang needs SGLang 0.5.23" in line
    assert "pip install 'evolving-infra[sglang]'" in line
    assert "on a GPU node: pip install 'evolving-infra[sglang-gpu]'" in line


def test_the_sglang_backend_with_another_sglang_version_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    spec = real("json")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, p=None: spec if name == "sglang" else real(name)
    )
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.22")
    assert cli.main(["engine", "--backend", "sglang", "--port", "0"]) == 2
    line = error_line(capsys.readouterr().err, "engine")
    assert "needs SGLang 0.5.23, not the 0.5.22 installed: pip install sglang==0.5.23" in line


# -- ports taken -------------------------------------------------------------------------------


def test_cluster_up_on_a_taken_router_port_is_one_line(
    taken_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logs = tmp_path / "logs"
    argv = ["cluster", "up", "--no-pool", "--engines", "2", "--router-port", str(taken_port),
            "--log-dir", str(logs)]  # fmt: skip
    assert cli.main(argv) == 2
    line = error_line(capsys.readouterr().err, "cluster")
    assert f"port {taken_port} is taken" in line
    assert "choose another with --router-port" in line
    assert not logs.exists()  # found before anything started


def test_a_router_port_taken_while_the_engines_start_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
    taken_port: int,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The port is free at the check (here: the check is skipped) and taken when the router
    binds: the router's exit is read back as the port, not as a crash."""
    monkeypatch.setattr(cluster_command, "check_listen", lambda *a, **k: None)
    argv = ["cluster", "up", "--no-pool", "--engines", "2", "--router-port", str(taken_port),
            "--time-scale", "20", "--log-dir", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 2
    line = error_line(capsys.readouterr().err, "cluster")
    assert f"port {taken_port} is taken: choose another with --router-port" in line
    assert "is taken" in (tmp_path / "router.log").read_text()  # the router said so itself


def test_any_free_router_port_taken_before_the_router_binds_it_is_picked_again(
    monkeypatch: pytest.MonkeyPatch, taken_port: int, tmp_path: Path
) -> None:
    """`--router-port 0`: a port the kernel picked and another process took before the router
    bound it is not the user's mistake; the router starts again on another."""
    picks: list[list[int]] = []

    def pick(count: int) -> list[int]:
        ports = [taken_port] if count == 1 and not any(len(p) == 1 for p in picks) else None
        picks.append(ports or free_ports(count))
        return picks[-1]

    monkeypatch.setattr(cluster_command, "free_ports", pick)
    parser = argparse.ArgumentParser()
    cluster_command.add_arguments(parser)
    args = parser.parse_args(
        ["up", "--no-pool", "--no-planner", "--engines", "2", "--router-port", "0",
         "--time-scale", "20", "--log-dir", str(tmp_path)]
    )  # fmt: skip
    cluster = cluster_command.up(args, Console(file=io.StringIO()))
    try:
        routers = [p for p in picks if len(p) == 1]
        assert routers[0] == [taken_port]
        assert len(routers) == 2
        assert cluster.router_url == f"http://127.0.0.1:{routers[1][0]}"
        with urllib.request.urlopen(f"{cluster.router_url}/health", timeout=5) as r:
            assert r.status == 200
    finally:
        cluster.stop()


def test_router_on_a_taken_port_is_one_line(
    taken_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["router", "--engines", "127.0.0.1:1", "127.0.0.1:2", "--port", str(taken_port)]
    assert cli.main(argv) == 2
    line = error_line(capsys.readouterr().err, "router")
    assert f"port {taken_port} is taken: choose another with --port" in line


@pytest.mark.parametrize("flag", ["--port", "--grpc-port", "--kv-events-port"])
def test_engine_on_a_taken_port_is_one_line(
    flag: str, taken_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["engine", "--port", "0", flag, str(taken_port)]
    assert cli.main(argv) == 2
    line = error_line(capsys.readouterr().err, "engine")
    assert f"port {taken_port} is taken: choose another with {flag}" in line


def test_engine_process_on_a_taken_port_prints_nothing_else(
    taken_port: int, tmp_path: Path
) -> None:
    out = run_cli("engine", "--port", str(taken_port), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "choose another with --port" in error_line(out.stderr, "engine")


def test_sglang_backend_on_a_taken_port_is_one_line_before_sglang_starts(
    monkeypatch: pytest.MonkeyPatch, taken_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sglang_command, "require_sglang", lambda: None)  # as if installed

    def no_sglang(*args: object, **kwargs: object) -> None:
        raise AssertionError("SGLang was started")

    monkeypatch.setattr(launcher.SglangProcess, "start", no_sglang)
    assert cli.main(["engine", "--backend", "sglang", "--port", str(taken_port)]) == 2
    line = error_line(capsys.readouterr().err, "engine")
    assert f"port {taken_port} is taken: choose another with --port" in line


# -- bad values: argparse's errors, on one line too --------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["cluster", "up", "--engines", "abc"], "--engines: expected an int >= 2, got 'abc'"),
        (["cluster", "up", "--engines", "1"], "argument --engines: expected an int >= 2, got 1"),
        (["cluster", "up", "--router-port", "70000"],
         "argument --router-port: expected a port in 0..65535, got 70000"),
        (["sim", "--duration", "-1"], "argument --duration: expected a number of seconds > 0"),
        (["sim", "--gpus", "many"], "argument --gpus: expected an int >= 1, got 'many'"),
        (["demo", "--nodes", "0"], "argument --nodes: expected an int >= 1, got 0"),
        (["engine", "--port", "-5"], "argument --port: expected a port in 0..65535, got -5"),
        (["engine", "--switch-seconds", "-1"], "argument --switch-seconds: expected a number"),
        (["router", "--engines", "a:99999"], "argument --engines: bad port in engine 'a:99999'"),
        (["replay", str(TRACE), "--router", "localhost"],
         "argument --router: expected an http:// URL"),
        (["soak", "--duration", "abc"], "argument --duration: expected a number of seconds > 0"),
        (["cluster", "up", "--routers", "0"], "argument --routers: expected an int >= 1, got 0"),
        (["router", "--engines", "a:1", "b:2", "--coordination", "localhost:6379"],
         "argument --coordination: expected a Redis URL such as redis://127.0.0.1:6379/0"),
        (["router", "--engines", "a:1", "b:2", "--turn-cache-mib", "-1"],
         "argument --turn-cache-mib: expected an int >= 0, got -1"),
        (["front", "--routers", "127.0.0.1:8001"],
         "argument --routers: a router replica is http://host:port, got '127.0.0.1:8001'"),
        (["cluster", "up", "--planner-option", "interval=5"],
         "argument --planner-option: interval is not an option here: use --planner-interval"),
        (["sim", "--planner-option", "min_gain=x"],
         "argument --planner-option: planner option min_gain needs a number, got 'x'"),
    ],
)  # fmt: skip
def test_bad_flag_values_are_one_error_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "usage:" not in err
    (line,) = err.splitlines()
    assert line.startswith(f"evolving-infra {argv[0]}: error: argument --"), err
    assert message in line, err
    assert line.endswith(f"(see evolving-infra {argv[0]} --help)"), err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["sim", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["no-such-command"], "argument COMMAND: invalid choice: 'no-such-command'"),
        (["cluster"], "the following arguments are required: action"),
        (["trace", "stats"], "the following arguments are required"),
    ],
)
def test_unknown_flags_and_commands_are_one_error_line(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("evolving-infra"), line
    assert ": error: " in line
    assert words in line


# -- files and config files --------------------------------------------------------------------


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["demo", "--traces", "{tmp}/missing"], "{tmp}/missing: no such file or directory"),
        (["demo", "--traces", "{tmp}/empty"], "no trace files in {tmp}/empty"),
        (["trace", "stats", "{tmp}/missing.jsonl"], "{tmp}/missing.jsonl: no such file"),
        (["demo", "--config", "{tmp}/missing.toml"], "--config {tmp}/missing.toml: cannot read it"),
        (["demo", "--config", "{tmp}/empty"], "--config {tmp}/empty: cannot read it: is a dir"),
        (["demo", "--config", "{tmp}/bad.toml"], "{tmp}/bad.toml: not TOML"),
        (["sim", "--config", "{tmp}/choice.toml"], "model: 'nope' is not one of glm-4.5, kimi-k2"),
        (["model", "eval", "--plot", "{tmp}/no/x.png"], "--plot {tmp}/no/x.png: no folder"),
        (["sim", "--out", "{tmp}/bad.toml"], "--out {tmp}/bad.toml: not a folder"),
        (["trace", "gen", "cc", "-o", "{tmp}/missing/x.jsonl"], "--output {tmp}/missing/x.jsonl"),
        (["soak", "--traces", "{tmp}/missing.jsonl", "--log-dir", "{tmp}/soak"],
         "{tmp}/missing.jsonl: no such file"),
        (["cluster", "up", "--no-pool", "--router-port", "0", "--log-dir", "{tmp}/bad.toml"],
         "--log-dir {tmp}/bad.toml: not a folder"),
        (["router", "--engines", "127.0.0.1:1", "127.0.0.1:2", "--port", "0",
          "--tokenizer", "{tmp}/missing.json"], "{tmp}/missing.json: not a tokenizer.json"),
        (["router", "--engines", "127.0.0.1:1"], "needs at least two, a prefill and a decode"),
        (["cluster", "up", "--no-pool", "--planner-option", "min_slices=1", "--log-dir",
          "{tmp}/logs"], "--planner-option: need nodes_total >= 2, slices >= 2"),
        (["scenario", "check", "{tmp}/empty"], "{tmp}/empty/results.json does not exist"),
        (["scenario", "run", "heldout", "--held-out-seeds", "1,6", "--out", "{tmp}/out"],
         "seed 1 is tuning data (tuning seeds (0, 1), consumed draws (2, 3, 6, 7, 8, 9, 10,"),
        (["scenario", "run", "heldout", "--screen", "--out", "{tmp}/out"],
         "--screen names a consumed draw: it needs --held-out-seeds"),
        (["scenario", "run", "heldout", "--held-out-seeds", "10,10", "--screen", "--out",
          "{tmp}/out"], "--held-out-seeds names a seed twice: (10, 10)"),
        (["scenario", "run", "heldout", "--held-out-seeds", "8,x", "--out", "{tmp}/out"],
         "--held-out-seeds takes seeds separated by commas, got '8,x'"),
        (["scenario", "run", "heldout", "--held-out-seeds", "8,8", "--out", "{tmp}/out"],
         "--held-out-seeds names a seed twice: (8, 8)"),
        (["scenario", "run", "tuning", "--held-out-seeds", "6,7", "--out", "{tmp}/out"],
         "--held-out-seeds is for the heldout scenario, not tuning"),
        (["scenario", "run", "shift", "--statics-from", "{tmp}/empty", "--out", "{tmp}/out"],
         "--statics-from is for the heldout and tuning scenarios, not shift"),
        (["scenario", "run", "tuning", "--statics-from", "{tmp}/empty", "--out", "{tmp}/out"],
         "--statics-from: {tmp}/empty/results.json does not exist"),
        (["scenario", "run", "tuning", "--statics-from", "{tmp}/ran", "--out", "{tmp}/out"],
         "--statics-from: {tmp}/ran/results.json ran heldout (paper, quick False, seed 0,"),
        (["scenario", "run", "heldout", "--statics-from", "{tmp}/ran", "--out", "{tmp}/out"],
         "ran heldout (paper, quick False, seed 0, agents entering over 60 s); this run is"
         " heldout (paper, quick False, seed 0, agents entering over 900 s)"),
        (["scenario", "run", "shift", "--start-ramp", "30", "--out", "{tmp}/out"],
         "--start-ramp is for the heldout and tuning scenarios, not shift"),
        (["scenario", "run", "tuning", "--quick", "--start-ramp", "600", "--out", "{tmp}/out"],
         "the agents must enter within the run (600 s), got a ramp of 600 s"),
        (["scenario", "run", "heldout", "--cells", "nope", "--out", "{tmp}/out"],
         "no cell 'nope' in this grid (cells: claude-code-held-100-s4,"),
        (["scenario", "run", "tuning", "--cells", ",", "--out", "{tmp}/out"],
         "--cells names nothing"),
        (["scenario", "run", "shift", "--policies", "dynamo", "--out", "{tmp}/out"],
         "--policies is for the heldout and tuning scenarios, not shift"),
        (["scenario", "run", "tuning", "--policies", "dynamo,nope", "--out", "{tmp}/out"],
         "unknown policy 'nope'"),
        (["scenario", "run", "tuning", "--quick", "--policies", "static:2P7D", "--out",
          "{tmp}/out"], "static:2P7D is not a split of 4 nodes with both phases"),
        (["scenario", "run", "tuning", "--policies", "dynamo", "--statics-from", "{tmp}/ran",
          "--out", "{tmp}/out"], "--policies and --statics-from: --statics-from runs evolving"),
        (["scenario", "check", "{tmp}"], "{tmp}/results.json does not exist"),
        (["engine", "--model", "llama-3-70b", "--tp", "1", "--port", "0"],
         "weights leave no GPU memory for KV (llama-3-70b on 1 x h100-sxm): give more GPUs"),
    ],
)  # fmt: skip
def test_what_a_user_can_get_wrong_is_one_line(
    argv: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "bad.toml", "nodes = [\n")
    _write(tmp_path / "choice.toml", 'model = "nope"\n')
    ran = {"scenario": "heldout", "deployment": "paper", "quick": False, "seed": 0, "runs": {}}
    (tmp_path / "ran").mkdir()
    _write(tmp_path / "ran" / "results.json", json.dumps(ran))
    assert cli.main([a.format(tmp=tmp_path) for a in argv]) == 2
    line = error_line(capsys.readouterr().err, argv[0])
    assert words.format(tmp=tmp_path) in line, line
    assert not (tmp_path / "soak").exists()  # soak: the traces are read before a cluster starts
    assert not list((tmp_path / "logs").glob("*.log"))  # cluster up: nothing was started


def test_replay_to_no_router_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    router = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    argv = ["replay", str(TRACE), "--router", router, "--duration", "5"]
    assert cli.main(argv) == 2
    line = error_line(capsys.readouterr().err, "replay")
    assert f"{router}: cannot connect" in line
    assert "start it (evolving-infra cluster up) or give its address with --router" in line


def test_replay_to_a_router_that_never_answers_is_one_line(
    monkeypatch: pytest.MonkeyPatch, taken_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(replay_command, "PROBE_TIMEOUT_S", 0.5)
    argv = ["replay", str(TRACE), "--router", f"http://127.0.0.1:{taken_port}"]
    assert cli.main(argv) == 2
    assert "no answer from the router within 0.5 s" in error_line(capsys.readouterr().err, "replay")


# -- child processes that fail, bugs, Ctrl-C ---------------------------------------------------


def _proc(tmp_path: Path, log: str) -> procs.Proc:
    p = procs.Proc("engine-1", [], tmp_path / "engine-1.log")
    p.log.write_text(log)
    return p


def test_a_child_that_crashed_names_itself_and_its_log_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    crash = "".join(f"line {i}\n" for i in range(30)) + "Traceback (most recent call last):\nBoom\n"
    error = _proc(tmp_path, crash).failure(1)
    assert cli.report("cluster", error) == 1  # not the user's doing
    first, *rest = capsys.readouterr().err.splitlines()
    assert first == (
        f"evolving-infra cluster: error: engine-1 exited with status 1; its log:"
        f" {tmp_path / 'engine-1.log'}; its last lines:"
    )
    assert rest[-1] == "  Boom"
    assert len(rest) == procs.TAIL_LINES


def test_a_child_that_said_why_is_one_line_with_its_reason(tmp_path: Path) -> None:
    said = '{"event": "starting"}\nevolving-infra engine: error: cannot join the pool: X: fix\n'
    error = _proc(tmp_path, said).failure(2)
    assert str(error) == (
        f"engine-1 exited with status 2: cannot join the pool: X: fix"
        f" (log: {tmp_path / 'engine-1.log'})"
    )
    assert error.details == ""


def _raising(monkeypatch: pytest.MonkeyPatch, module: ModuleType, error: BaseException) -> None:
    def run(args: object) -> int:
        raise error

    monkeypatch.setattr(module, "run", run)


def test_a_bug_is_one_internal_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("EVOLVING_INFRA_DEBUG", raising=False)
    _raising(monkeypatch, demo, KeyError("oops\nsecond line"))
    assert cli.main(["demo"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "evolving-infra demo: internal error: KeyError: 'oops\\nsecond line'"
        " (set EVOLVING_INFRA_DEBUG=1 for the traceback)"
    ]
    monkeypatch.setenv("EVOLVING_INFRA_DEBUG", "1")
    with pytest.raises(KeyError, match="oops"):
        cli.main(["demo"])


def test_ctrl_c_exits_130_quietly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _raising(monkeypatch, demo, KeyboardInterrupt())
    assert cli.main(["demo"]) == 130
    assert capsys.readouterr().err == ""


def test_a_multi_line_message_is_cut_to_its_first_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _raising(monkeypatch, demo, cli.ConfigError("first line\n--- log tail ---\nmore"))
    assert cli.main(["demo"]) == 2
    assert error_line(capsys.readouterr().err, "demo") == "evolving-infra demo: error: first line"


# -- the error types ---------------------------------------------------------------------------


def test_command_errors_carry_what_and_fix_on_one_line() -> None:
    e = CommandError("it broke\nbadly", "do this")
    assert str(e) == "it broke: do this"
    assert str(e.otherwise("run with --that")) == "it broke: do this, or run with --that"
    assert e.args == ("it broke: do this, or run with --that",)
    assert one_line("\n  \nfirst\nsecond") == "first"
    missing = FileNotFoundError(2, "No such file or directory", "/x/y")
    assert os_error_line(missing) == "/x/y: no such file or directory"


@pytest.mark.parametrize(
    ("detail", "library"),
    [
        ("Python package `mooncake` not found", None),
        ("No module named 'mooncake'", None),
        ("libnuma.so.1: cannot open shared object file: No such file or directory", "libnuma.so.1"),
        ("/v/mooncake/mooncake_master: error while loading shared libraries: libcurl.so.4:"
         " cannot open shared object file: No such file or directory", "libcurl.so.4"),
    ],
)  # fmt: skip
def test_missing_mooncake_says_which_part_is_missing(detail: str, library: str | None) -> None:
    e = MooncakeMissingError(detail)
    assert e.library == library
    assert isinstance(e, CommandError)
    fix = "apt-get install -y libibverbs1 libnuma1 libcurl4" if library else "evolving-infra[pool]"
    assert fix in str(e)
    assert "\n" not in str(e)


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and every sub-command's parser under it, at any depth."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases share one parser
                yield from _parsers(sub)


def test_every_help_formats() -> None:
    """Every command's --help prints: argparse %-formats each option's help, so a bare "25%" in
    one (the scenario's --start-ramp had one) made `--help` an internal error."""
    root, _ = cli.build_parser()
    progs = []
    for parser in _parsers(root):
        assert parser.format_help().startswith("usage: ")
        progs.append(parser.prog)
    assert "evolving-infra scenario run" in progs
    assert len(progs) > 20
