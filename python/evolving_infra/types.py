"""Names every part shares: a node's phase, an SGLang page hash, the pages some tokens take, and
what a token id may be.

One definition each, so that the router, the engines, the timing model and the node model agree
on them (they were spelled out in each before).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NewType

Phase = Literal["prefill", "decode"]

# A KV block's id in the directory: an SGLang page hash (DESIGN §2: signed 64-bit, from the
# page's chained sha256), or in the simulator a trace's block hash standing in for one.
BlockHash = NewType("BlockHash", int)

TOKEN_ID_LIMIT = 2**32  # SGLang's page hash reads each token as 4 unsigned bytes


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks `tokens` occupy: a partial block still takes a whole page."""
    return -(-max(tokens, 0) // block_size)


def token_ids_valid(value: Sequence[object]) -> bool:
    """Whether `value` holds only ints (bools are not) in [0, TOKEN_ID_LIMIT). A prompt is
    ~100k ids: checked in C (the types, then the bounds), ~3x faster than a loop over them,
    which the router and every engine would run per request."""
    if not value:
        return True
    if set(map(type, value)) != {int}:
        return False
    ints: Sequence[int] = value  # type: ignore[assignment]  # checked just above
    return min(ints) >= 0 and max(ints) < TOKEN_ID_LIMIT
