"""The wheel as a user gets it: built from this checkout, installed into a fresh virtual
environment outside the checkout, and run there.

Without the `pool` extra, `cluster up` (which starts the shared L2 pool by default) must say in
one line how to get Mooncake or do without it; with `pip install 'evolving-infra[pool]'` it
starts a Mooncake master, two simulated engines and the router, serves one chat completion and
stops cleanly on Ctrl-C. Nothing of the checkout is importable there: the test checks that the
package it runs is the installed one.

Needs PyPI (the fresh environment installs the wheel's requirements; pip's cache makes that
quick after the project's own install) and maturin (the `dev` extra).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from evolving_infra.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]
PIP_TIMEOUT_S = 600
START_TIMEOUT_S = 90


def _run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _ok(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode == 0, f"{p.args}: status {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `maturin build --release` makes of this checkout (the release build the
    project's own install already compiled, so cargo only packages it)."""
    maturin = Path(sys.executable).with_name("maturin")
    assert maturin.exists(), f"{maturin}: maturin not installed (the `dev` extra)"
    out = tmp_path_factory.mktemp("dist")
    _ok(_run([str(maturin), "build", "--release", "--quiet", "--out", str(out)], ROOT, 900))
    (found,) = out.glob("evolving_infra-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A fresh virtual environment, outside the checkout, with the wheel and no extra."""
    home = tmp_path_factory.mktemp("user")
    env = home / "venv"
    # `venv` makes it from the interpreter the project's venv was made from: it inherits nothing.
    _ok(_run([sys.executable, "-m", "venv", str(env)], home))
    _ok(_run([str(env / "bin" / "pip"), "install", "--quiet", str(wheel)], home, PIP_TIMEOUT_S))
    return env


def test_the_installed_package_is_the_wheel(venv: Path) -> None:
    code = "import evolving_infra as e; print(e.__file__)"
    where = Path(_ok(_run([str(venv / "bin" / "python"), "-c", code], venv.parent)).strip())
    assert where.is_relative_to(venv)
    assert not where.is_relative_to(ROOT)


def test_cluster_up_without_mooncake_says_how_in_one_line(venv: Path) -> None:
    p = _run(
        [str(venv / "bin" / "evolving-infra"), "cluster", "up", "--engines", "2",
         "--router-port", str(free_ports(1)[0]), "--log-dir", str(venv.parent / "logs-nopool")],
        venv.parent, START_TIMEOUT_S,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "pip install 'evolving-infra[pool]'" in lines[0]
    assert "--no-pool" in lines[0]


def _chat(url: str) -> dict[str, object]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "X-Agent-Branch": "wheel-1"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        reply = json.loads(r.read())
    assert isinstance(reply, dict)
    return reply


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
            return bool(json.loads(r.read()).get("status") == "ok")
    except (OSError, urllib.error.URLError, ValueError):
        return False


def test_cluster_up_with_the_pool_extra_serves_a_chat_completion(venv: Path, wheel: Path) -> None:
    home = venv.parent
    _ok(_run([str(venv / "bin" / "pip"), "install", "--quiet", f"{wheel}[pool]"], home,
             PIP_TIMEOUT_S))  # fmt: skip
    port = free_ports(1)[0]
    logs = home / "logs"
    cluster = subprocess.Popen(
        [str(venv / "bin" / "evolving-infra"), "cluster", "up", "--engines", "2",
         "--router-port", str(port), "--log-dir", str(logs)],
        cwd=home, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):
            assert cluster.poll() is None, cluster.communicate()[0]
            assert time.monotonic() < deadline, "the cluster did not start"
            time.sleep(0.5)
        reply = _chat(url)
        choices = reply["choices"]
        assert isinstance(choices, list)
        assert choices[0]["finish_reason"] in ("length", "stop")
        usage = reply["usage"]
        assert isinstance(usage, dict)
        assert usage["completion_tokens"] >= 1
        cluster.send_signal(signal.SIGINT)
        out, _ = cluster.communicate(timeout=60)
    finally:
        if cluster.poll() is None:
            cluster.kill()
            cluster.wait()
    assert cluster.returncode == 0, out
    assert "Traceback" not in out
    # Every process of the cluster logged into the user's folder, the pool's master among them.
    names = {p.name for p in logs.iterdir()}
    assert {"router.log", "engine-0.log", "engine-1.log"} <= names, names
    assert any(n.startswith("master-") for n in names), names
