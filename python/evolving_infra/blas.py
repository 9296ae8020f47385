"""OpenBLAS's kernels pinned to one family, so that a simulation gives the same figures on
every x86-64 CPU with AVX2.

numpy's wheels carry OpenBLAS built for every x86 family, which picks its kernels for the CPU
at load time. The kernels sum in different orders, so a matrix product (the iteration model's
fit, `timing/model.py`) can differ in its last bits from one CPU to another. The simulator
then routes one request of thousands elsewhere on a near tie, and from there the run goes its
own way: Claude Code at 150 held-out agents on the H100s (seed 9) at a static 4P5D served
837.4 tok/s with the Haswell kernels and 840.3 with the SkylakeX ones (this VM's AVX-512
Xeon), and evolving's hour there went from 0.970x the best static split to 0.894x
(docs/scenarios.md, issue 25, 2026-12-07, sixth session). The model's matrices are a few
thousand rows by five columns: the kernel family costs nothing measurable.

`pin` sets `OPENBLAS_CORETYPE` to Haswell (AVX2 and FMA: what every x86-64 server CPU of the
last decade runs) before numpy loads OpenBLAS: `evolving_infra` imports this module
first. It leaves alone a value the user set, a CPU without AVX2 or FMA (the kernels would
fault), another architecture, a process that loaded numpy before `evolving_infra`, and
`EVOLVING_INFRA_BLAS=native` (OpenBLAS's own choice).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

ENV = "EVOLVING_INFRA_BLAS"
CORETYPE = "OPENBLAS_CORETYPE"
KERNELS = "Haswell"
_NEEDS = frozenset({"avx2", "fma"})  # the CPU flags the Haswell kernels execute


def pin() -> bool:
    """Sets `OPENBLAS_CORETYPE` to `KERNELS` where that is safe and not yet decided (module
    docstring); whether it did."""
    if os.environ.get(ENV, "") == "native" or CORETYPE in os.environ:
        return False
    if "numpy" in sys.modules or not runs_kernels():
        return False
    os.environ[CORETYPE] = KERNELS
    return True


def runs_kernels() -> bool:
    """Whether this CPU runs the `KERNELS` family: x86-64 with AVX2 and FMA."""
    return platform.machine() in ("x86_64", "AMD64") and _cpu_flags() >= _NEEDS


def kernels() -> str | None:
    """The kernel family numpy's OpenBLAS runs (e.g. "Haswell"); None where numpy does not
    use a bundled OpenBLAS that says."""
    import numpy as np

    libs = Path(np.__file__).parent.parent / "numpy.libs"
    for lib in sorted(libs.glob("*openblas*")):
        try:
            dll = ctypes.CDLL(str(lib))
        except OSError:
            continue
        for name in ("scipy_openblas_get_corename64_", "openblas_get_corename64_"):
            corename = getattr(dll, name, None)
            if corename is not None:
                corename.restype = ctypes.c_char_p
                value = corename()
                return value.decode() if isinstance(value, bytes) else None
    return None


def _cpu_flags() -> frozenset[str]:
    """The CPU's flags as Linux lists them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


pin()
