"""pytest configuration for the benchmarks (`pytest benches -m bench --benchmark-only`).

`pytest tests` never reaches this folder (and `testpaths = ["tests"]` keeps a bare `pytest` out of
it). The benchmarks import the shared workload generator as the top-level module `workload`, so
this folder is put on `sys.path` whatever pytest's import mode.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
