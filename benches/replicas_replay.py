"""One replay against 1, 2 and 3 router replicas, side by side (issue 29's figures).

For each replica count: `evolving-infra cluster up --engines E --routers R` (R > 1: redis-server,
R replicas and the front at the router port), then `evolving-infra replay TRACE --agents N
--duration D --speed X --json` against it, the same sessions each time (`--seed`). Reported per
count: completed / failed / lost, output tokens/s, lost KV reuse, TTFT P50, the router overhead
P50 (from each replica's `evolving_router_overhead_seconds`, merged), and the balance of the
engines' work: each engine's share of the prefills and of the decodes (from the replicas'
`request` log lines), as the busiest engine of a phase over that phase's mean. Every process runs
on this machine, the clients too: on 2 cores more replicas also means more processes per core.
With `--kill-after S`, replica 0 is SIGKILLed S seconds into the replay (R > 1): the failures
then count what that cost (its own requests in flight, whose clients get an error).

Run: `.venv/bin/python benches/replicas_replay.py` (about 3 minutes a count). Nothing is asserted:
it prints figures (and `--json FILE` writes them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "data" / "traces" / "claude-code"


def wait_up(url: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy in {timeout:.0f} s")


def overhead_p50(urls: list[str]) -> float | None:
    """The merged histogram's P50 bucket bound, seconds (None: no request)."""
    buckets: dict[float, float] = {}
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "evolving_router_overhead_seconds_bucket":
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
    if not buckets or buckets[float("inf")] == 0:
        return None
    total = buckets[float("inf")]
    return next(le for le in sorted(buckets) if buckets[le] >= total / 2)


def balance(log_dir: Path) -> dict[str, Any]:
    """Requests per engine and phase from the replicas' `request` lines; max / mean per phase."""
    per: dict[str, Counter[int]] = {"prefill": Counter(), "decode": Counter()}
    for log in log_dir.glob("router*.log"):
        for line in log.read_text().splitlines():
            if '"prefill"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "request" and "prefill" in rec:
                per["prefill"][rec["prefill"]] += 1
                per["decode"][rec["decode"]] += 1
    out: dict[str, Any] = {}
    for phase, counts in per.items():
        if counts:
            mean = sum(counts.values()) / len(counts)
            out[phase] = {"per_engine": dict(sorted(counts.items())),
                          "max_over_mean": max(counts.values()) / mean}  # fmt: skip
    return out


def one(routers: int, args: argparse.Namespace) -> dict[str, Any]:
    me = [sys.executable, "-m", "evolving_infra"]
    log_dir = Path(tempfile.mkdtemp(prefix=f"replicas-{routers}-"))
    port = 18000 + routers
    cluster = subprocess.Popen(
        [*me, "cluster", "up", "--engines", str(args.engines), "--routers", str(routers),
         "--router-port", str(port), "--log-dir", str(log_dir),
         # Killing a replica is the test: cluster up restarts it (with back-off) as it would.
         *([] if args.kill_after is not None else ["--stop-on-failure"])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url)
        replay = subprocess.Popen(
            [*me, "replay", str(args.trace), "--router", url, "--agents", str(args.agents),
             "--duration", str(args.duration), "--speed", str(args.speed),
             "--seed", str(args.seed), "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        killed = None
        if args.kill_after is not None and routers > 1:
            time.sleep(args.kill_after)
            killed = kill_replica(0)
        out, _ = replay.communicate()
        summary = json.loads(out)
        urls = replica_urls(log_dir, url, routers)
        return {
            "routers": routers,
            "summary": summary,
            "overhead_p50_s": overhead_p50(urls),
            "balance": balance(log_dir),
            "log_dir": str(log_dir),
            "killed_pid": killed,
        }
    finally:
        os.killpg(cluster.pid, signal.SIGINT)
        cluster.wait(120)


def kill_replica(i: int) -> int | None:
    """SIGKILL router replica `i` (found by its command line); its pid."""
    found = subprocess.run(["pgrep", "-f", "--", f"--replica router-{i}"], capture_output=True,
                           text=True, check=False)  # fmt: skip
    pids = [int(p) for p in found.stdout.split()]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return pids[0] if pids else None


def replica_urls(log_dir: Path, url: str, routers: int) -> list[str]:
    """The replicas' own addresses, from their `router_serving` log lines (one router: `url`)."""
    if routers == 1:
        return [url]
    out = []
    for log in sorted(log_dir.glob("router-*.log")):
        for line in log.read_text().splitlines():
            if '"router_serving"' in line:
                out.append(f"http://127.0.0.1:{json.loads(line)['port']}")
                break
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", default="1,2,3", help="replica counts (default: %(default)s)")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--speed", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--kill-after", type=float, help="SIGKILL replica 0 this many seconds in")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    rows = [one(int(r), args) for r in args.counts.split(",")]
    print("routers | completed/failed/lost | out tok/s | lost reuse | TTFT p50 s | overhead p50 "
          "| prefill max/mean | decode max/mean")  # fmt: skip
    for r in rows:
        s, b = r["summary"], r["balance"]
        ttft = s.get("p50_ttft_s")
        print(f"{r['routers']:7d} | {s['completed']}/{s['failed']}/{s['lost']} | "
              f"{s['output_tokens_per_s']:.0f} | {s['lost_kv_reuse']:.3f} | {ttft:.2f} | "
              f"<= {r['overhead_p50_s']} | {b.get('prefill', {}).get('max_over_mean', 0):.2f} | "
              f"{b.get('decode', {}).get('max_over_mean', 0):.2f}")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
