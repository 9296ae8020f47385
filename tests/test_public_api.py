"""Every name the README and docs/ show is importable from where they show it.

Three kinds of reference are checked, each collected from the Markdown text (never from a list
kept here, so that a new doc page or a renamed module is checked without editing this file):

- import statements in code blocks (`from evolving_infra.timing import IterationModel`), run as
  written;
- dotted names in backticks that start at the package or one of its modules
  (`timing.TTFTPredictor`, `evolving_infra.KvDirectory`, `sim.agents.AgentReplay`), resolved as
  a module followed by attributes;
- `python -m evolving_infra.…` commands, whose module must exist and be runnable.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
from pathlib import Path
from types import ModuleType

import pytest

import evolving_infra

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# `from evolving_infra.x import (a, b)` or `import evolving_infra.x`, possibly over several lines.
_IMPORT = re.compile(
    r"^[ \t]*(?:>>> )?(from[ \t]+evolving_infra[\w.]*[ \t]+import[ \t]+(?:\([^)]*\)|[^\n]+)"
    r"|import[ \t]+evolving_infra[\w.]*)",
    re.MULTILINE,
)
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_BACKTICKS = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"(?<![\w./-])((?:[a-z_][a-z0-9_]*)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?![\w/-])")
_RUN_MODULE = re.compile(r"python[\d.]* -m (evolving_infra[\w.]*)")
# Backticked file names (`cli.py`, `soak.json`) look like dotted names but are not references.
_FILE_SUFFIXES = {"py", "pyi", "json", "md", "toml", "csv", "log", "txt", "so", "rs", "proto"}

_MODULES = {m.name for m in pkgutil.iter_modules(evolving_infra.__path__)}


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _imports() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for block in _FENCE.findall(page.read_text()):
            found += [(_page_id(page), m.group(1).strip()) for m in _IMPORT.finditer(block)]
    return found


def _dotted_names() -> list[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for page in PAGES:
        for span in _BACKTICKS.findall(page.read_text()):
            for m in _DOTTED.finditer(span):
                name = m.group(1)
                parts = name.split(".")
                if parts[-1] in _FILE_SUFFIXES:
                    continue
                if parts[0] == "evolving_infra" or parts[0] in _MODULES:
                    found.add((_page_id(page), name))
    return sorted(found)


def _run_modules() -> list[tuple[str, str]]:
    return sorted({(_page_id(p), m) for p in PAGES for m in _RUN_MODULE.findall(p.read_text())})


def resolve(name: str) -> object:
    """The object a dotted name means: the longest importable module prefix, then attributes.
    A name that does not start with `evolving_infra` is taken as relative to it."""
    parts = name.split(".")
    if parts[0] != "evolving_infra":
        parts = ["evolving_infra", *parts]
    module: ModuleType | None = None
    for n in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:n]))
        except ModuleNotFoundError:
            continue
        break
    assert module is not None
    obj: object = module
    for attr in parts[n:]:
        obj = getattr(obj, attr)  # AttributeError names what is missing
    return obj


def test_the_pages_are_found_and_hold_references() -> None:
    # The scan is only worth something if it sees what is there.
    assert (ROOT / "README.md") in PAGES
    assert len(PAGES) > 5
    assert ("README.md", "from evolving_infra import KvDirectory, block_hashes") in _imports()
    assert ("docs/simulator.md", "timing.IterationModel") in _dotted_names()


@pytest.mark.parametrize(("page", "statement"), _imports())
def test_an_import_in_the_docs_runs(page: str, statement: str) -> None:
    exec(compile(statement, page, "exec"), {})


@pytest.mark.parametrize(("page", "name"), _dotted_names())
def test_a_dotted_name_in_the_docs_resolves(page: str, name: str) -> None:
    resolve(name)


@pytest.mark.parametrize(("page", "module"), _run_modules())
def test_a_python_dash_m_module_in_the_docs_runs(page: str, module: str) -> None:
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"{page}: no module {module}"
    if spec.submodule_search_locations:  # a package runs through its __main__
        assert importlib.util.find_spec(f"{module}.__main__") is not None, module


def test_resolve_fails_on_a_missing_name() -> None:
    with pytest.raises(AttributeError):
        resolve("timing.NoSuchModel")
    with pytest.raises(AttributeError):
        resolve("evolving_infra.no_such_module")


@pytest.mark.parametrize(
    "name", ["timing.IterationModel", "timing.TTFTPredictor", "KvDirectory", "block_hashes"]
)
def test_the_package_docstrings_names_are_exported(name: str) -> None:
    # The names the package docstrings introduce, at the package they introduce them from.
    package, _, attr = name.rpartition(".")
    module = importlib.import_module("evolving_infra" + (f".{package}" if package else ""))
    assert attr in module.__all__
    assert getattr(module, attr) is resolve(name)
