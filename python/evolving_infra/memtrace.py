"""Opt-in memory traces of the soak's processes, to find what grows.

`EVOLVING_INFRA_MEMTRACE=DIR[:SECONDS[:snapshots]]` in the environment of `evolving-infra engine`
or `evolving-infra router` (a soak's processes inherit the soak's) appends, every SECONDS
(default 30), one JSON line to `DIR/NAME-PID.jsonl`: seconds since start, resident memory,
glibc's `mallinfo2` (bytes in use and free in the allocator's arenas: free bytes are held, not
returned, so they count as resident), and the sizes of the process's own structures (what
`watch` registered: the engine's replay ring and maps, the router's directory). With
`snapshots` it also starts `tracemalloc` and dumps a snapshot each time to
`DIR/NAME-PID-SSSSS.snap`; tracing slows a process down (about twice the CPU) and only sees
Python's allocations (not the Rust directory's, nor ZMQ's).

`python -m evolving_infra.memtrace OLD.snap NEW.snap [--top N]` prints the source lines
whose traced allocations grew most from OLD to NEW.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import os
import threading
import time
import tracemalloc
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ENV = "EVOLVING_INFRA_MEMTRACE"
DEFAULT_EVERY_S = 30.0

_watched: list[Callable[[], Mapping[str, Any]]] = []
_installed = False


def watch(stats: Callable[[], Mapping[str, Any]]) -> None:
    """Adds `stats()` (called on the trace thread: reads only) to every line written, when
    tracing is on (nothing otherwise)."""
    if _installed:
        _watched.append(stats)


_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS.split()]


def malloc_info() -> dict[str, int]:
    """glibc's view of the heap: `in_use` and `free` bytes in its arenas, `mmapped` (large
    blocks); empty where there is no `mallinfo2` (not glibc, or glibc < 2.33)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        fn = libc.mallinfo2
    except (OSError, AttributeError, TypeError):
        return {}
    fn.restype = _MallInfo2
    m = fn()
    return {"in_use": m.uordblks, "free": m.fordblks, "mmapped": m.hblkhd}


def rss_bytes() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 0


def install(name: str, environ: Mapping[str, str] | None = None) -> threading.Event | None:
    """Starts the trace thread when `ENV` is set, and returns the event that stops it; None
    (nothing done) if `ENV` is not set."""
    global _installed
    spec = (os.environ if environ is None else environ).get(ENV, "")
    if not spec:
        return None
    _installed = True
    folder, _, rest = spec.partition(":")
    every, _, mode = rest.partition(":")
    period = float(every) if every else DEFAULT_EVERY_S
    snapshots = mode == "snapshots"
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if snapshots:
        tracemalloc.start(1)
    t0, pid = time.monotonic(), os.getpid()
    stop = threading.Event()

    def trace() -> None:
        while not stop.wait(period):
            t = int(time.monotonic() - t0)
            line: dict[str, Any] = {"t": t, "rss": rss_bytes(), **malloc_info()}
            for stats in _watched:
                try:
                    line.update(stats())
                except Exception as e:  # a structure changed size while read: next time
                    line["stats_error"] = repr(e)
            if snapshots:
                line["traced"] = tracemalloc.get_traced_memory()[0]
                tracemalloc.take_snapshot().dump(str(out / f"{name}-{pid}-{t:05d}.snap"))
            with (out / f"{name}-{pid}.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")

    threading.Thread(target=trace, name="memtrace", daemon=True).start()
    return stop


def compare(old: Path, new: Path, top: int = 25) -> list[str]:
    """The `top` source lines whose traced memory grew most from `old` to `new`, as text."""
    a = tracemalloc.Snapshot.load(str(old))
    b = tracemalloc.Snapshot.load(str(new))
    total_a = sum(s.size for s in a.statistics("filename"))
    total_b = sum(s.size for s in b.statistics("filename"))
    lines = [f"traced: {total_a / 2**20:.1f} -> {total_b / 2**20:.1f} MiB"]
    for d in b.compare_to(a, "lineno")[:top]:
        frame = d.traceback[0]
        lines.append(
            f"{d.size_diff / 2**20:+8.1f} MiB {d.size / 2**20:8.1f} MiB {d.count_diff:+9d}"
            f"  {frame.filename}:{frame.lineno}"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description="what grew between two tracemalloc snapshots")
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    print("\n".join(compare(args.old, args.new, args.top)))


if __name__ == "__main__":
    main()
