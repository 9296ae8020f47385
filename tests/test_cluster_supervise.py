"""`cluster up` supervision (issue 27): a process that dies is restarted with back-off while the
rest keeps serving; one that keeps dying is given up; a killed engine under `cluster up` comes
back, rejoins the router, and serves again.

The back-off runs on a fake clock over real short-lived processes; the cluster test kills a
real simulated engine with SIGKILL.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console

from cluster_helpers import start_cluster
from evolving_infra.cluster import supervise
from evolving_infra.cluster.procs import Proc
from evolving_infra.cluster.supervise import Supervisor


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _exits(tmp_path: Path, code: int = 3) -> Proc:
    args = [sys.executable, "-c", f"import sys; sys.exit({code})"]
    p = Proc("engine-1", args, tmp_path / "e.log")
    p.start()
    assert p.popen is not None
    p.popen.wait()
    return p


def _wait_exit(p: Proc) -> None:
    assert p.popen is not None
    p.popen.wait()


def test_an_exited_process_is_restarted_with_back_off_then_given_up(tmp_path: Path) -> None:
    p = _exits(tmp_path)
    out = io.StringIO()
    clock = Clock()
    s = Supervisor([p], Console(file=out, width=300), clock=clock)
    delays = []
    for _ in range(supervise.MAX_RESTARTS_IN_ROW):
        s.poll()  # sees the exit: a restart is due after the back-off
        first_pid = p.pid
        due = s._state["engine-1"].due
        assert due is not None
        delays.append(due - clock.now)
        clock.now = due - 0.01
        s.poll()
        assert p.pid == first_pid  # not before its time
        clock.now = due
        s.poll()
        assert p.pid != first_pid
        _wait_exit(p)  # it exits again at once: the restart did not hold
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert s.restarts == {"engine-1": supervise.MAX_RESTARTS_IN_ROW}
    s.poll()
    assert s._state["engine-1"].given_up
    text = out.getvalue()
    assert "engine-1 exited with status 3" in text
    assert "restarting it in 1 s" in text
    assert "given up, the rest keeps serving" in text
    clock.now += 1000
    s.poll()  # given up: never started again
    assert s.restarts == {"engine-1": supervise.MAX_RESTARTS_IN_ROW}


def test_a_process_that_stays_up_starts_its_back_off_over(tmp_path: Path) -> None:
    p = _exits(tmp_path)
    clock = Clock()
    s = Supervisor([p], Console(file=io.StringIO()), clock=clock)
    s.poll()
    clock.now = 1.0
    # Restarted as a process that stays up (a sleep) for STABLE_AFTER_S.
    p.args = [sys.executable, "-c", "import time; time.sleep(60)"]
    s.poll()
    assert s._state["engine-1"].in_row == 1
    clock.now += supervise.STABLE_AFTER_S
    s.poll()
    assert s._state["engine-1"].in_row == 0
    p.interrupt()
    p.wait()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _chat(router: str, text: str) -> int:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    req = urllib.request.Request(
        f"{router}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        with e:
            return int(e.code)


def test_a_killed_engine_comes_back_and_the_cluster_keeps_serving(tmp_path: Path) -> None:
    c = start_cluster(tmp_path, engines=4, prefill=2)
    out = io.StringIO()
    s = Supervisor(c.procs, Console(file=out, width=300))
    stop = threading.Event()
    statuses: list[int] = []

    def load() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            statuses.append(_chat(c.router_url, f"request {i} " + "lorem ipsum " * 30))

    try:
        assert _chat(c.router_url, "warm up") == 200
        worker = threading.Thread(target=load)
        worker.start()
        victim = next(p for p in c.procs if p.name == "engine-3")
        old = victim.pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 60
        health: dict[str, Any] = {}
        while time.monotonic() < deadline:
            s.poll()
            health = _get(f"{c.router_url}/health")
            back = health["dispatcher"]["3"]["state"] == "up" and health["status"] == "ok"
            if victim.pid != old and back:
                break
            time.sleep(0.3)
        stop.set()
        worker.join()
        assert victim.pid != old, out.getvalue()
        assert health["status"] == "ok", health
        assert s.restarts == {"engine-3": 1}
        assert "engine-3 exited" in out.getvalue()
        # The others served throughout: at most the requests in flight on the killed engine
        # failed (the router retries those that had sent nothing on other engines).
        assert statuses.count(200) >= len(statuses) - 1, statuses
        assert len(statuses) >= 3
        assert _chat(c.router_url, "after the restart") == 200
    finally:
        stop.set()
        c.stop()
