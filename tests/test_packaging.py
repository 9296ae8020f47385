"""pyproject.toml is the one source of the project's dependencies (issue 23): the Makefile and
the scripts install its extras and name no package of their own, and the versions the code
checks at run time are the ones the extras pin."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from evolving_infra.engines.sglang import patch, server_info

ROOT = Path(__file__).resolve().parents[1]
EXTRAS: dict[str, list[str]] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
    "optional-dependencies"
]


def test_the_extras_users_are_told_about_exist() -> None:
    assert {"pool", "sglang", "sglang-gpu", "test", "bench", "dev"} <= set(EXTRAS)
    assert EXTRAS["pool"] == ["mooncake-transfer-engine-non-cuda==0.3.13.post1"]
    # A working copy gets everything but SGLang's 3 GB: `make sglang` adds that.
    assert "evolving-infra[test,bench,pool]" in EXTRAS["dev"]


def test_the_sglang_pin_is_the_version_the_backend_is_written_for() -> None:
    assert EXTRAS["sglang-gpu"] == [f"sglang=={patch.SGLANG_VERSION}"]
    assert server_info.SGLANG_VERSION == patch.SGLANG_VERSION
    # The CPU extra pins what SGLang's own wheel pins, torch first of all.
    assert "torch==2.14.1" in EXTRAS["sglang"]
    assert not any(r.startswith("sglang") for r in EXTRAS["sglang"])


def test_the_makefile_installs_only_the_projects_extras() -> None:
    makefile = (ROOT / "Makefile").read_text()
    installs = re.findall(r"\$\(PIP\) install([^\n]*)", makefile)
    assert installs, "the Makefile installs the venv with pip"
    for line in installs:
        packages = [w for w in line.split() if not w.startswith("-")]
        assert packages in (["pip"], ["'.[dev]'"]), line


def test_the_sglang_script_installs_the_extras_and_sglang_from_pyproject() -> None:
    script = (ROOT / "scripts" / "install-sglang-cpu.sh").read_text()
    assert '-e "$root[dev,sglang]"' in script
    assert 'extras["sglang-gpu"]' in script
    assert not re.search(r"\bpip\"? install[^\n]*==", script)  # no version of its own
    constraints = (ROOT / "scripts" / "sglang-cpu-constraints.txt").read_text().splitlines()
    # Only prohibitions: a constraint that pinned a version would be a second source.
    assert all(
        line.endswith("<0") for line in constraints if line.strip() and not line.startswith("#")
    )
