"""The package layout's rules (DESIGN §1, README "What is here"), read from the imports.

A part that imports one it must not know is a tangle no test of behaviour sees: the simulated
engine once imported the simulator's modules (and through them the planner and routing types),
so a change to the discrete-event driver could break the live engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "evolving_infra"

# part -> the parts it must never import (module prefixes under evolving_infra)
FORBIDDEN = {
    "nodemodel": ("sim", "router", "engines", "planner"),
    "engines": ("sim", "router", "soak"),
    "sim": ("router", "engines"),
    "router": ("sim", "soak"),
    "planner": ("sim", "router", "engines"),
    "routing": ("sim", "router", "engines", "nodemodel"),
    "timing": ("planner", "routing", "sim", "router"),
    "workloads": ("sim", "router", "engines", "nodemodel"),
}


def imports(path: Path) -> set[str]:
    """Every evolving_infra module `path` imports, at any depth (lazy imports count)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m == "evolving_infra" or m.startswith("evolving_infra.")}


def violations(part: str) -> list[str]:
    banned = tuple(f"evolving_infra.{p}" for p in FORBIDDEN[part])
    found = []
    for path in sorted((PACKAGE / part).rglob("*.py")):
        for m in sorted(imports(path)):
            if any(m == b or m.startswith(b + ".") for b in banned):
                found.append(f"{path.relative_to(PACKAGE)} imports {m}")
    return found


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_a_part_imports_none_it_must_not_know(part: str) -> None:
    assert (PACKAGE / part).is_dir()
    assert violations(part) == []


def test_the_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The scan finds lazy imports inside functions too (the check can fail)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from evolving_infra.sim.cluster import Cluster\n")
    assert imports(module) == {"evolving_infra.sim.cluster"}
