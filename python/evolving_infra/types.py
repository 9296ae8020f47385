"""Names every part shares: a node's phase, an SGLang page hash, the pages some tokens take, and
what a token id may be.

One definition each, so that the router, the engines, the timing model and the node model agree
on them (they were spelled out in each before).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NewType

from evolving_infra import _core

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
    ~100k ids, checked by the router and every engine per request: read in place by the native
    module (~50 µs per 100k ids; the quickest check in Python, over the set of the items' types
    and then min and max, took ~4 ms and was on every request's path)."""
    return _core.token_ids_valid(value)
