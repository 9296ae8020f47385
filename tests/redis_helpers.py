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

import redis

from evolving_infra.ports import free_ports


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
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(port, process)
    try:
        deadline = time.monotonic() + 10
        client = redis.Redis(port=port)
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert process.poll() is None, f"redis-server exited with {process.returncode}"
                assert time.monotonic() < deadline, "redis-server did not answer in 10 s"
                time.sleep(0.05)
        client.close()
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(10)
