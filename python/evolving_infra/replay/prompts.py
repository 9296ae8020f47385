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

Responses: a trace's next prompt holds the previous response, which an agent's harness sends back
as the engine wrote it; the engine caches exactly those tokens after decoding. `answered` does
the same here: given a completed request's prompt and the engine's output, the blocks of the
next prompt that cover them (the request's unblocked tail and its response, as the simulator's
decode node caches them: `nodemodel.node.Node._finish`) take those tokens in place of the
trace's, in every prompt that holds them from then on (a block's hash names its whole chain, so
one hash is one content). Without it the next turn's response region never matched the pages
the decode engine kept, and the live system recomputed what the simulator found cached.
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
        self._answers: dict[int, bytes] = {}  # block hash -> the tokens an engine wrote there

    def block(self, block_hash: int) -> bytes:
        """The `block_size` printable bytes (token ids) of one block."""
        answer = self._answers.get(block_hash)
        if answer is not None:
            return answer
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

    def answered(
        self, hashes: Sequence[int], prompt: Sequence[int], output: bytes, following: Sequence[int]
    ) -> int:
        """Records a completed request's answer: `hashes` and `prompt` its blocks and token ids,
        `output` the engine's tokens, `following` the next prompt's block hashes in the trace.
        When the next prompt continues this one (it holds `hashes` as its first blocks, then
        more), its blocks over the rest of `prompt` and over `output` are these tokens from now
        on. A block already answered keeps its first answer (prompts may have sent it). Returns
        how many blocks were given an answer."""
        n, b = len(hashes), self.block_size
        if not n or len(following) <= n or following[n - 1] != hashes[n - 1]:
            return 0
        tokens = bytes(prompt[n * b :]) + output
        end = min(len(following), n + len(tokens) // b)
        given = 0
        for i in range(n, end):
            if following[i] not in self._answers:
                start = (i - n) * b
                self._answers[following[i]] = tokens[start : start + b]
                given += 1
        return given
