"""Argument types shared by the CLI's subcommands: each rejects bad values with a clear message.

Each raises `argparse.ArgumentTypeError` (argparse prints `argument --flag: MESSAGE`; a --config
file's value gets `FILE: key: MESSAGE`), for a value that is not a number too.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

from evolving_infra.errors import CommandError


def _int(text: str, expected: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def _float(text: str, expected: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An int >= `minimum`."""

    def convert(text: str) -> int:
        expected = f"an int >= {minimum}"
        value = _int(text, expected)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    convert.__name__ = f"int_at_least_{minimum}"
    return convert


positive_int = int_at_least(1)
natural_int = int_at_least(0)


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: any free port)."""
    value = _int(text, "a port in 0..65535")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {value}")
    return value


def positive_seconds(text: str) -> float:
    expected = "a number of seconds > 0"
    value = _float(text, expected)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def natural_seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    expected = "a number of seconds >= 0"
    value = _float(text, expected)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (a rate, a scale factor)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def check_output_file(path: Path, flag: str) -> None:
    """Raises `CommandError` unless `path` can be a file written later: its folder exists and it
    is not a folder itself. For a command to check before it computes what it writes (not an
    argparse type: a --config file's relative paths are rebased after conversion)."""
    folder = path.parent
    if path.is_dir():
        raise CommandError(f"{flag} {path}: is a folder", "name a file")
    if not folder.is_dir():
        raise CommandError(f"{flag} {path}: no folder {folder}", "create it, or name another")


def check_output_folder(path: Path, flag: str) -> None:
    """Raises `CommandError` unless `path` is a folder or can be made one (nothing on the way
    is a file), checked before a command computes what it writes there."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "" if existing == path else f" ({existing} is a file)"
        raise CommandError(f"{flag} {path}: not a folder{where}", "name a folder")


def secret(flag: str | None, env: str) -> str | None:
    """An API key: the flag's value, else the environment variable's (which, unlike a flag, `ps`
    does not show); empty means no key."""
    value = flag if flag is not None else os.environ.get(env)
    return value or None
