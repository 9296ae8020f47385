"""Trace prompts as token ids: each trace block becomes a fixed run of `block_size` token ids.

A trace prompt is a chain of blocks (`workloads.blocks`): the identity of block i is its
directory hash, which digests the whole chain up to i. The router hashes token ids in pages of
its page size (SGLang page hashes), so a replayed prompt must turn equal block chains into equal
token sequences and different ones into different sequences. Here block i's tokens are
`block_size` bytes of SHAKE-128 of (the run's salt, the block's hash), each mapped into printable
ASCII (32..126): two prompts with the same first k blocks share exactly their first
k * block_size tokens and differ, with overwhelming probability, within the next block's first
few tokens. Printable bytes keep the ids readable by the router's byte tokenizer and the
simulated engine alike (both take ids as bytes), and far below any vocabulary size.

Pages: when `block_size` is a multiple of the router's page size (the Claude Code traces' 64-token
blocks against the default 16-token pages), each trace block is exactly block_size / page_size
pages, and a shared prefix of k blocks hits exactly its k * block_size / page_size pages. When
it is not, a page straddling two blocks matches only when both blocks do, so the live hit rate
can only be lower than the trace's by less than one page per prompt.

Tokens beyond the prompt's blocks (a Claude Code prompt counts only full blocks, so its last
`prompt_tokens % block_size` tokens are in none) are fresh: derived from the request's own
identity, so they are reproducible but never shared with another request. A prompt whose last
block is partial (Mooncake's) is cut to `prompt_tokens`.

NOTE: a trace's next prompt contains the previous response, which the engine generated with its
own tokens; the replay sends the trace's block tokens instead, so the engine's cached output
pages never match. The prompt part of every hit h* counts is still reproduced.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

FIRST_PRINTABLE, PRINTABLE = 32, 95  # ASCII ' ' .. '~'
# bytes.translate table: any byte -> a printable one (the 1-in-95 bias is harmless here).
_TO_PRINTABLE = bytes(FIRST_PRINTABLE + b % PRINTABLE for b in range(256))


class PromptTokens:
    """Token ids of trace prompts, deterministic in (salt, block hashes, request identity)."""

    def __init__(self, block_size: int, salt: str = "") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._salt = salt.encode()

    def block(self, block_hash: int) -> bytes:
        """The `block_size` printable bytes (token ids) of one block."""
        key = b"block/" + self._salt + b"/" + block_hash.to_bytes(8, "little", signed=True)
        return hashlib.shake_128(key).digest(self.block_size).translate(_TO_PRINTABLE)

    def fresh(self, identity: str, n: int) -> bytes:
        """`n` printable bytes that belong to `identity` alone (a request's unblocked tail)."""
        if n <= 0:
            return b""
        key = b"tail/" + self._salt + b"/" + identity.encode()
        return hashlib.shake_128(key).digest(n).translate(_TO_PRINTABLE)

    def prompt(self, hashes: Sequence[int], prompt_tokens: int, identity: str) -> list[int]:
        """The token ids of a prompt of `prompt_tokens` tokens whose blocks hash to `hashes`.

        At least one token: the router refuses an empty prompt.
        """
        body = b"".join(self.block(h) for h in hashes)[: max(prompt_tokens, 0)]
        body += self.fresh(identity, prompt_tokens - len(body))
        return list(body or self.fresh(identity, 1))
