"""`evolving_infra.timing`'s `specs.py` (model and GPU figures) and `samples.py` (the CSV format),
loaded by path from the repository this folder is part of.

The profile always runs from a checkout (on a GPU machine, a copy of the working tree), and both
files need only the standard library, whereas importing the `evolving_infra` package needs its
built native module.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TIMING = Path(__file__).resolve().parents[3] / "python" / "evolving_infra" / "timing"


def timing_module(name: str) -> ModuleType:
    """`TIMING/NAME.py` as the module `_iteration_profile_NAME` (loaded once)."""
    module_name = f"_iteration_profile_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = TIMING / f"{name}.py"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if not path.is_file() or spec is None or spec.loader is None:
        raise ImportError(f"{path} is missing: run the profile from a checkout of the repository")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while it executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
