"""Shared pytest configuration: hypothesis profiles.

`HYPOTHESIS_PROFILE=ci` makes every property test deterministic (derandomized) for CI runs;
the default profile explores new examples on each run and prints a reproduction blob on failure.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("default", deadline=None, print_blob=True)
settings.register_profile("ci", deadline=None, print_blob=True, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
