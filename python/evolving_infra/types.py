"""Names every part shares: a node's phase, an SGLang page hash, and the pages some tokens take.

One definition each, so that the router, the engines, the timing model and the node model agree
on them (they were spelled out in each before).
"""

from __future__ import annotations

from typing import Literal, NewType

Phase = Literal["prefill", "decode"]

# A KV block's id in the directory: an SGLang page hash (DESIGN §2: signed 64-bit, from the
# page's chained sha256), or in the simulator a trace's block hash standing in for one.
BlockHash = NewType("BlockHash", int)


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks `tokens` occupy: a partial block still takes a whole page."""
    return -(-max(tokens, 0) // block_size)
