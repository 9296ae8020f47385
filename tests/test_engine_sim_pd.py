"""Two simulated engines in SGLang's PD protocol, and the `engine` command as a real process.

Real parts only: two `SimEngine`s on 127.0.0.1 (the decode engine pulls the KV from the prefill
engine's HTTP bootstrap endpoint), and `evolving-infra engine`'s `run(args)` in a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from typing import Any

import aiohttp

from evolving_infra import block_hashes
from test_engine_sim_helpers import PAGE, parse_sse, prompt, running, settings

RUN_COMMAND = (
    "import argparse, sys\n"
    "from evolving_infra.engines.sim import command as c\n"
    "p = argparse.ArgumentParser(prog='evolving-infra engine', description=c.DESCRIPTION,\n"
    "    formatter_class=argparse.RawDescriptionHelpFormatter)\n"
    "c.add_arguments(p)\n"
    "sys.exit(c.run(p.parse_args(sys.argv[1:])))\n"
)


def pd_body(ids: list[int], n: int, port: int, room: int, stream: bool = False) -> dict[str, Any]:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n},
        "stream": stream,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": room,
    }


def test_pd_flow_prefill_then_decode_streams_and_prefill_unpins() -> None:
    async def main() -> None:
        async with (
            running(settings(node_id=0, phase="prefill")) as p,
            running(settings(node_id=1, phase="decode")) as d,
        ):
            ids = prompt(7, 42)
            body = pd_body(ids, 12, p.port, room=12345, stream=True)
            # The router sends the same body to both, concurrently (decode first, on purpose:
            # its pull must wait for a prefill that has not arrived yet).
            dec = asyncio.create_task(d.stream("/generate", body))
            await asyncio.sleep(0.01)
            status, pre = await p.post("/generate", {**body, "stream": False})
            events = await dec
            assert status == 200, pre
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert [len(c["output_ids"]) for c in chunks] == list(range(1, 13))
            assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
            assert pre["output_ids"] == chunks[-1]["output_ids"][:1]  # the prefill's token
            # The prefill released its pins and keeps the prompt cached; the decode engine
            # holds prompt + output pages.
            assert p.engine.kv.pinned == 0
            assert p.engine.kv.reserved == 0
            assert p.engine.active == 0
            assert not p.engine._rooms
            hp = block_hashes(ids, PAGE)
            assert set(hp) <= p.engine.holdings()["L1"]
            full = block_hashes(ids + chunks[-1]["output_ids"], PAGE)
            assert d.engine.directory.match(full).nodes[1] == (13, 13)
            assert d.engine.kv.pinned == 0
            assert d.engine.kv.reserved == 0
            # A second turn of the same prompt: the prefill engine's cache serves it.
            body2 = pd_body(ids, 3, p.port, room=777)
            (s1, _out_p), (s2, out_d) = await asyncio.gather(
                p.post("/generate", body2), d.post("/generate", body2)
            )
            assert s1 == s2 == 200
            assert out_d["meta_info"]["cached_tokens"] == 40
            assert len(out_d["output_ids"]) == 3

    asyncio.run(main())


def test_decode_without_a_prefill_fails_and_releases_its_kv() -> None:
    async def main() -> None:
        async with (
            running(settings(node_id=0, phase="prefill", kv_hold_real_s=0.3)) as p,
            running(settings(node_id=1, phase="decode", kv_hold_real_s=0.3)) as d,
        ):
            status, out = await d.post("/generate", pd_body(prompt(3, 20), 4, p.port, room=9))
            assert status == 502
            assert "504" in out["error"]["message"]
            kv = d.engine.kv
            assert (kv.pinned, kv.reserved, d.engine.node.inbound, d.engine.active) == (0, 0, 0, 0)
            assert not p.engine._rooms  # the poll's empty room is gone
            # A prefill whose decode engine never pulls gives its KV back after the hold.
            status, out = await p.post("/generate", pd_body(prompt(4, 20), 4, p.port, room=10))
            assert status == 504
            assert p.engine.kv.pinned == 0
            # Neither kept the token ids of pages it never held (under a soak, requests that
            # never ran left 900k pages an engine).
            assert not d.engine.events.tokens
            held = p.engine.holdings()
            assert set(p.engine.events.tokens) <= held["L1"] | held["L2"]

    asyncio.run(main())


def test_prefill_waits_for_its_decode_side_to_claim_the_room() -> None:
    """A PD prefill runs only once its decode engine has reserved room and polls for the KV
    (SGLang's bootstrap handshake). Prefilling first let prefill pins and decode reservations
    fill both engines while each waited on the other: 200 agents deadlocked a soak."""

    async def main() -> None:
        async with (
            running(settings(node_id=0, phase="prefill", kv_hold_real_s=5.0)) as p,
            running(settings(node_id=1, phase="decode", kv_hold_real_s=5.0)) as d,
        ):
            body = pd_body(prompt(5, 20), 4, p.port, room=31)
            pre = asyncio.create_task(p.post("/generate", body))
            await asyncio.sleep(0.3)
            # No decode side yet: nothing prefilled, nothing pinned, the request still waits.
            assert not pre.done()
            assert p.engine.kv.pinned == 0
            assert not p.engine.node.queue
            assert not p.engine.node.running
            status_d, out_d = await d.post("/generate", body)
            status_p, _ = await pre
            assert (status_p, status_d) == (200, 200), out_d
            assert len(out_d["output_ids"]) == 4
            assert p.engine.kv.pinned == 0

    asyncio.run(main())


def test_engine_command_help() -> None:
    out = subprocess.run(
        [sys.executable, "-c", RUN_COMMAND, "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--backend", "--node-id", "--phase", "--time-scale", "--kv-bandwidth"):
        assert flag in out.stdout


def test_engine_command_serves_and_stops_on_sigterm() -> None:
    args = ["--port", "0", "--model", "llama-3-8b", "--tp", "1", "--time-scale", "50",
            "--page-size", "4", "--l1-blocks", "512"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN_COMMAND, *args], stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stderr is not None
        port = 0
        for line in proc.stderr:  # JSON logs: the serving line names the port
            event = json.loads(line)
            if event["event"] == "engine_serving":
                port = event["port"]
                break
        assert port

        async def call() -> None:
            async with aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{port}/generate"
                body = {"text": "hello", "stream": True, "sampling_params": {"max_new_tokens": 3}}
                async with http.post(url, json=body) as r:
                    events = parse_sse(await r.text())
                assert events[-1] == "[DONE]"
                assert len(events[-2]["output_ids"]) == 3

        asyncio.run(call())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
