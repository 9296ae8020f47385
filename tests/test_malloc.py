"""`malloc.tune`: large transient buffers stay mmapped (returned to the OS when freed) after one
was freed, where glibc's dynamic threshold would move them to the heap."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# In a fresh process: free one 4 MiB buffer (glibc's dynamic threshold rises to its size), then
# count the mmapped chunks while a second one is alive.
PROBE = """
import ctypes, ctypes.util, json, sys
from evolving_infra import malloc
tuned = malloc.tune() if sys.argv[1] != "plain" else False
libc = ctypes.CDLL(ctypes.util.find_library("c"))
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
first = bytearray(4 << 20)
del first
before = libc.mallinfo2().hblks
second = bytearray(4 << 20)
print(json.dumps({"tuned": tuned, "mmapped": libc.mallinfo2().hblks - before}))
"""


def probe(mode: str) -> dict[str, object]:
    env = {**os.environ, "EVOLVING_INFRA_MALLOC": "default" if mode == "off" else ""}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True
    )
    return dict(json.loads(out.stdout))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux")
def test_tuned_processes_keep_large_buffers_out_of_the_heap() -> None:
    assert probe("plain") == {"tuned": False, "mmapped": 0}  # glibc moved it to the heap
    assert probe("tune") == {"tuned": True, "mmapped": 1}
    assert probe("off") == {"tuned": False, "mmapped": 0}  # EVOLVING_INFRA_MALLOC=default
