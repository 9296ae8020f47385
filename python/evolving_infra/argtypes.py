"""Argument types shared by the CLI's subcommands: each rejects bad values with a clear message."""

from __future__ import annotations

import argparse
import math
import os


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def natural_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
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


def secret(flag: str | None, env: str) -> str | None:
    """An API key: the flag's value, else the environment variable's (which, unlike a flag, `ps`
    does not show); empty means no key."""
    value = flag if flag is not None else os.environ.get(env)
    return value or None
