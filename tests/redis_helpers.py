"""A real Redis server for tests (Debian's `redis-server`, which `make test` installs): started on a
free loopback port with no persistence, stopped (or killed, to test a lost coordination service)
by the test."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from evolving_infra.ports import free_ports
from evolving_infra.router.replicas import redis_answers, redis_server_command


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server not found: make test installs it (apt-get)"
    [port] = free_ports(1)
    process = subprocess.Popen(
        redis_server_command(binary, port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    server = RedisServer(port, process)
    try:
        deadline = time.monotonic() + 10
        while not redis_answers(port):
            assert process.poll() is None, f"redis-server exited with {process.returncode}"
            assert time.monotonic() < deadline, "redis-server did not answer in 10 s"
            time.sleep(0.05)
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(10)
