"""`evolving-infra engine --backend sglang`: its options, and the handling of the SGLang process.

SGLang itself cannot run on this CPU-only machine (no GPU to load a model), so the child process
is a stand-in: `fake_sglang.py` run as a script, which serves SGLang 0.5.23's control endpoints
on the port it is given and, like the patched scheduler, binds the eviction-hint PULL named in
its environment. What is real: the process group, the signals, the health wait, the output
copy and tail, the sidecar and its gRPC service.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from evolving_infra import cli
from evolving_infra.control import EngineClient, EngineControlError, EngineInfo
from evolving_infra.engines.sglang import launcher
from evolving_infra.engines.sglang.launcher import SglangProcess, SglangStartError
from evolving_infra.engines.sim import command as engine_command
from evolving_infra.ports import free_ports

FAKE = str(Path(__file__).with_name("fake_sglang.py"))
STAND_IN = (sys.executable, FAKE)
ENV = dict(os.environ)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def fake_state(port: int) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/_fake/state", timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture(autouse=True)
def fast_health_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "HEALTH_POLL_S", 0.1)


# -- the options -------------------------------------------------------------------------------


def test_help_explains_the_sglang_backend_without_sglang_installed() -> None:
    """SGLang is not installed here: --help must not need it."""
    out = subprocess.run(
        [sys.executable, "-m", "evolving_infra", "engine", "--backend", "sglang", "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for text in ("--backend sglang", "--bootstrap-port", "--advertise-host", "-- SGLANG_ARG",
                 "--model-path", "--tp 4", "--backend sim only"):  # fmt: skip
        assert text in out.stdout


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--backend", "sglang", "--time-scale", "5", "--tp", "2", "--", "--model-path", "m"],
         "--tp, --time-scale: only --backend sim takes them"),
        (["--backend", "sglang", "--no-prefetch"], "--no-prefetch: only --backend sim takes it"),
        (["--bootstrap-port", "9000"], "--bootstrap-port: only --backend sglang takes it"),
        (["--backend", "sim", "--", "--model-path", "m"],
         "SGLang flags after --: only --backend sglang takes it"),
    ],
)  # fmt: skip
def test_options_of_the_other_backend_are_rejected(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["engine", *argv]) == 2
    assert named in capsys.readouterr().err


def test_sim_options_keep_their_defaults() -> None:
    parser = argparse.ArgumentParser()
    engine_command.add_arguments(parser)
    s = engine_command.settings_from(parser.parse_args([]))
    assert (s.deployment.model.name, s.deployment.tp, s.time_scale, s.prefetch) == (
        "llama-3-70b", 4, 1.0, True
    )  # fmt: skip


# -- the process -------------------------------------------------------------------------------


def test_process_healthy_then_stopped_with_its_whole_group(tmp_path: Path) -> None:
    port = free_port()
    grandchild = tmp_path / "grandchild.pid"
    # A shell that leaves a sleeping grandchild behind (as SGLang's scheduler processes), then
    # becomes the server.
    spawn = f'sleep 300 & echo $! > {grandchild}; exec "$0" "$@"'

    async def main() -> None:
        proc = SglangProcess(["--port", str(port)], env=ENV, command=["sh", "-c", spawn, *STAND_IN])
        await proc.start()
        await proc.wait_healthy(f"http://127.0.0.1:{port}", 30.0)
        sleeper = int(grandchild.read_text())
        assert alive(sleeper)
        assert await proc.stop(10.0) == 0  # SIGTERM: the stand-in shuts down cleanly
        assert not alive(proc.pid)
        deadline = time.monotonic() + 5
        while alive(sleeper) and time.monotonic() < deadline:  # the group got SIGTERM too
            await asyncio.sleep(0.02)
        assert not alive(sleeper)
        assert f"fake sglang: serving on http://127.0.0.1:{port}" in proc.tail()

    asyncio.run(main())


def test_process_ignoring_sigterm_is_killed_after_the_timeout() -> None:
    port = free_port()

    async def main() -> None:
        argv = ["--port", str(port), "--fake-ignore-sigterm"]
        proc = SglangProcess(argv, env=ENV, command=STAND_IN, echo=False)
        await proc.start()
        await proc.wait_healthy(f"http://127.0.0.1:{port}", 30.0)
        started = time.monotonic()
        assert await proc.stop(0.5) == -9
        assert time.monotonic() - started >= 0.5

    asyncio.run(main())


def test_process_exiting_at_start_is_reported_with_its_last_lines() -> None:
    async def main() -> None:
        argv = ["--port", str(free_port()), "--fake-exit-at-start", "3"]
        proc = SglangProcess(argv, env=ENV, command=STAND_IN, echo=False)
        await proc.start()
        with pytest.raises(SglangStartError, match="exited with code 3") as e:
            await proc.wait_healthy(f"http://127.0.0.1:{free_port()}", 30.0)
        assert "fake sglang: failing at start" in str(e.value)

    asyncio.run(main())


# -- the command (SGLang's flags come from part A's `flags.sglang_flags`) ---------------------


def engine_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    engine_command.add_arguments(parser)
    return parser.parse_args(["--backend", "sglang", *argv])


def test_command_serves_sglang_through_the_sidecar_and_stops_it() -> None:
    from evolving_infra.engines.sglang import command as sglang_command

    http, grpc_port = free_ports(2)
    args = engine_args("--node-id", "3", "--phase", "decode", "--port", str(http),
                       "--grpc-port", str(grpc_port), "--page-size", "4", "--stop-timeout", "5",
                       "--", "--model-path", "m")  # fmt: skip

    async def main() -> None:
        stop = asyncio.Event()
        serving = asyncio.create_task(
            sglang_command.serve(args, server_command=STAND_IN, stop=stop)
        )
        async with EngineClient(f"127.0.0.1:{grpc_port}", timeout=2.0) as client:
            info = await _first_info(client, serving)
            assert (info.backend, info.node_id, info.phase, info.page_size) == (
                "sglang", 3, "decode", 4
            )  # fmt: skip
            assert info.http_url == f"http://127.0.0.1:{http}"
            assert info.bootstrap_port == 8998
            # The child got EVOLVING_INFRA_HINTS_ENDPOINT: hints reach its PULL.
            for _ in range(100):
                try:
                    await client.set_eviction_hints({9: 2}, replace=True)
                    break
                except EngineControlError:
                    await asyncio.sleep(0.05)
            state = await asyncio.to_thread(fake_state, http)
            assert state["hints"] == [{"v": 1, "hashes": [9], "counts": [2], "replace": True}]
        stop.set()
        assert await serving == 0
        assert not alive(state["pid"])

    asyncio.run(main())


def test_command_exits_with_sglang_and_its_last_lines(capsys: pytest.CaptureFixture[str]) -> None:
    from evolving_infra.engines.sglang import command as sglang_command

    http, grpc_port = free_ports(2)
    args = engine_args("--port", str(http), "--grpc-port", str(grpc_port))

    async def main() -> int:
        serving = asyncio.create_task(sglang_command.serve(args, server_command=STAND_IN))
        async with EngineClient(f"127.0.0.1:{grpc_port}", timeout=2.0) as client:
            await _first_info(client, serving)
        request = urllib.request.Request(f"http://127.0.0.1:{http}/_fake/exit?code=5", b"")
        await asyncio.to_thread(urllib.request.urlopen, request, timeout=5)
        return await asyncio.wait_for(serving, 20)

    assert asyncio.run(main()) == 1
    err = capsys.readouterr().err
    assert "SGLang exited with code 5; its last lines:" in err
    assert "fake sglang: exiting with 5" in err


def test_ports_the_command_picks_leave_the_control_port_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel may hand out the `--grpc-port` a user picked (free when they picked it) as a
    free port again: the command's own picks (SGLang's KV-event ports) must skip it, or SGLang
    binds it first and the control then cannot listen (seen once in a full run)."""
    from evolving_infra.engines.sglang import command as sglang_command

    http, grpc_port = free_ports(2)
    monkeypatch.setattr(
        sglang_command, "free_ports", lambda count, host: [*free_ports(count - 1, host), grpc_port]
    )
    args = engine_args("--port", str(http), "--grpc-port", str(grpc_port))

    async def main() -> EngineInfo:
        stop = asyncio.Event()
        serving = asyncio.create_task(
            sglang_command.serve(args, server_command=STAND_IN, stop=stop)
        )
        try:
            async with EngineClient(f"127.0.0.1:{grpc_port}", timeout=2.0) as client:
                return await _first_info(client, serving)
        finally:
            stop.set()
            await asyncio.wait_for(serving, 20)

    info = asyncio.run(main())
    assert info.http_url.endswith(f":{http}")
    assert f":{grpc_port}" not in info.kv_events_endpoint + info.kv_replay_endpoint


def test_sglang_flags_set_by_evolving_infra_are_refused_after_the_dashes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from evolving_infra.engines.sglang import command as sglang_command

    args = engine_args("--", "--model-path", "m", "--port=31000", "--host", "0.0.0.0")
    assert asyncio.run(sglang_command.serve(args, server_command=STAND_IN)) == 2
    assert "--host, --port after --" in capsys.readouterr().err


async def _first_info(client: EngineClient, serving: asyncio.Task[int]) -> EngineInfo:
    """GetInfo once the command serves (SGLang's start included)."""
    deadline = time.monotonic() + 30
    while True:
        assert not serving.done(), f"the command ended early: {serving.result()}"
        try:
            return await client.get_info()
        except EngineControlError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
