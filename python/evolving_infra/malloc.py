"""Allocator settings for the long-running processes (router, simulated engines).

The router and the engines handle request bodies of megabytes (a 100k-token prompt's ids as
JSON, its pages' KV events) that live for one request. glibc serves allocations above its mmap
threshold (128 KiB) with `mmap` and returns them on free, but its *dynamic* threshold rises to
the size of every mmapped chunk freed (up to 32 MiB), after which such buffers come from the heap
and, freed, stay there as fragments the process keeps: under `make soak` the engines' free heap
bytes grew from ~35 to ~100 MiB in five minutes while what they used did not (`memtrace.py`
figures in docs/reliability.md). Fixing the threshold keeps large transient buffers out of the
heap. `EVOLVING_INFRA_MALLOC=default` leaves glibc's behaviour alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os

ENV = "EVOLVING_INFRA_MALLOC"
M_MMAP_THRESHOLD = -3  # glibc's `mallopt` parameter numbers (malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's default, fixed: setting it turns the dynamic rise off


def tune() -> bool:
    """Fixes glibc's mmap threshold (see the module docstring); False where there is nothing to
    tune (not glibc, or turned off by `EVOLVING_INFRA_MALLOC=default`)."""
    if os.environ.get(ENV, "") == "default":
        return False
    with contextlib.suppress(OSError, AttributeError, TypeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return False
