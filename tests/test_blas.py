"""OpenBLAS's kernels pinned for reproducible simulations (`evolving_infra/blas.py`): each case
runs a fresh interpreter, since the choice is made once, when numpy loads OpenBLAS."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from evolving_infra import blas

PROBE = (
    "import os, evolving_infra, numpy; from evolving_infra import blas; "
    "print(os.environ.get('OPENBLAS_CORETYPE'), blas.kernels())"
)


def run(env: dict[str, str]) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in (blas.CORETYPE, blas.ENV)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_importing_the_package_pins_the_kernels_where_the_cpu_runs_them() -> None:
    coretype, kernels = run({})
    if blas.runs_kernels():
        assert (coretype, kernels) == (blas.KERNELS, blas.KERNELS)
    else:
        assert coretype == "None"


def test_native_leaves_openblas_its_own_choice() -> None:
    coretype, _ = run({blas.ENV: "native"})
    assert coretype == "None"


def test_a_users_own_choice_is_kept() -> None:
    coretype, kernels = run({blas.CORETYPE: "Sandybridge"})
    assert coretype == "Sandybridge"
    if blas.runs_kernels():  # an x86 CPU with AVX runs the Sandybridge kernels
        assert kernels == "Sandybridge"


def test_too_late_once_numpy_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process numpy is loaded: OpenBLAS has chosen, and a pin would only mislead."""
    import numpy  # noqa: F401

    monkeypatch.delenv(blas.CORETYPE, raising=False)
    monkeypatch.delenv(blas.ENV, raising=False)
    assert blas.pin() is False
    assert blas.CORETYPE not in os.environ
