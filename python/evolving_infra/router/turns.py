"""Tokenize once per turn: each agent branch's last prompt is kept, so that its next turn
tokenizes and hashes only what it adds (issue 29).

An agent re-sends its whole context every turn. At 100k tokens a Hugging Face BPE spends
~100-200 ms of the router's CPU tokenizing it again and SHA-256 paging ~1 ms hashing it again,
so without this the router's cost per request grows with the context, turn after turn.

Kept per named branch (`_Turn`): a chat prompt's rendered parts (the tools, then each message:
`tokenize.render_parts`), the token count at the end of each part, and the prompt's
`PagedPrompt` (its ids and page digests). A new turn on the branch:

- chat: its parts are compared with the kept ones in order, by string equality (the prefix is
  verified, not assumed); the ids of the leading equal parts are reused and only the parts after
  them are tokenized. A chat prompt's ids are by definition its parts' ids concatenated
  (`tokenize.encode_chat`), so reuse gives exactly the ids a full tokenization gives;
- token ids: used as sent;
- text: tokenized whole (the tokens at a cut depend on the text after it; harnesses that
  keep long contexts send chat messages or ids);

then `PagedPrompt(ids, page_size, after=kept)` compares the ids with the kept prompt's and
hashes only the pages past their common prefix. A fork's first turn starts from its parent's
kept prompt; a compaction, whose context diverges early, reuses what it still shares.

Memory: ~10 bytes a token (ids 4, page digests 2 at 16-token pages, the chat text ~4), bounded
by `budget_bytes` with the least recently used branch dropped first; an ended branch's entry is
dropped (`drop`). `encode` runs in worker threads (`asyncio.to_thread`): one lock guards the
entries, and the tokenizing and hashing run outside it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from evolving_infra import PagedPrompt
from evolving_infra.router.api import ChatRequest, CompletionRequest
from evolving_infra.router.tokenize import Tokenizer, assistant_ids, render_parts

DEFAULT_BUDGET_MIB = 512


@dataclass(frozen=True, slots=True)
class Encoded:
    """A prompt's token ids and page hashes, and what its branch's last turn spared."""

    ids: PagedPrompt  # a sequence of the ids, kept as the branch's last prompt
    hashes: list[int]
    tokenized: int  # tokens the tokenizer produced for this request (0 for ids sent as ids)
    reused: int  # leading tokens shared with the branch's last prompt: their pages not rehashed


@dataclass(frozen=True, slots=True)
class _Turn:
    parts: tuple[str, ...]  # a chat prompt's rendered parts; () for a completion
    ends: tuple[int, ...]  # token count at the end of each part
    prompt: PagedPrompt

    @property
    def nbytes(self) -> int:
        return self.prompt.nbytes + sum(len(p) for p in self.parts)


class TurnCache:
    """The last prompt of each named branch, least recently used first out."""

    def __init__(
        self, tokenizer: Tokenizer, page_size: int, budget_bytes: int = DEFAULT_BUDGET_MIB << 20
    ) -> None:
        if page_size < 1 or budget_bytes < 0:
            raise ValueError("need page_size >= 1 and budget_bytes >= 0")
        self.tokenizer = tokenizer
        self.page_size = page_size
        self.budget_bytes = budget_bytes
        self._turns: OrderedDict[str, _Turn] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._assistant = tuple(assistant_ids(tokenizer))

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._turns)

    def encode(
        self, req: ChatRequest | CompletionRequest, branch: str | None, after: str | None = None
    ) -> Encoded:
        """The request's ids and hashes, from `branch`'s last turn where it still holds (or
        `after`'s, a fork's parent, when the branch has none yet); kept as `branch`'s last turn.
        No branch: computed whole and not kept."""
        last = self._get(branch, after)
        if isinstance(req, ChatRequest):
            turn, tokenized = self._chat(req, last)
        else:
            ids: Sequence[int]
            if isinstance(req.prompt, str):
                ids = self.tokenizer.encode(req.prompt)
                tokenized = len(ids)
            else:  # token ids, already checked: hashed as they are
                ids, tokenized = req.prompt, 0
            turn = _Turn((), (), PagedPrompt(ids, self.page_size, _prompt(last)))
        if branch is not None:
            self._put(branch, turn)
        prompt = turn.prompt
        # The kept prompt goes on as the request's ids (ids sent as ids too: it writes the
        # engines' JSON ~4x faster than orjson writes the tuple, `transport.ids_json`).
        return Encoded(prompt, prompt.hashes(), tokenized, prompt.reused)

    def _chat(self, req: ChatRequest, last: _Turn | None) -> tuple[_Turn, int]:
        """The chat prompt's turn and the tokens tokenized for it: the parts `last` ends with
        the same text are taken from it, ids and page digests, the rest tokenized."""
        parts = render_parts(req.messages, req.tools)
        same = 0
        if last is not None:
            for new, old in zip(parts, last.parts, strict=False):
                if new != old:
                    break
                same += 1
        kept = last.ends[same - 1] if last is not None and same else 0
        ends = [] if last is None else list(last.ends[:same])
        tail: list[int] = []
        for part in parts[same:]:
            tail.extend(self.tokenizer.encode(part))
            ends.append(kept + len(tail))
        tokenized = len(tail)
        tail.extend(self._assistant)
        if last is not None and same:
            prompt = PagedPrompt.extend(last.prompt, kept, tail)
        else:  # nothing kept by text: the ids may still share a page or two with the last turn
            prompt = PagedPrompt(tail, self.page_size, _prompt(last))
        return _Turn(tuple(parts), tuple(ends), prompt), tokenized

    def drop(self, branch: str) -> None:
        """Forget `branch`'s last turn (it ended)."""
        with self._lock:
            turn = self._turns.pop(branch, None)
            if turn is not None:
                self._bytes -= turn.nbytes

    def _get(self, branch: str | None, after: str | None) -> _Turn | None:
        with self._lock:
            for key in (branch, after):
                if key is not None and (turn := self._turns.get(key)) is not None:
                    self._turns.move_to_end(key)
                    return turn
        return None

    def _put(self, branch: str, turn: _Turn) -> None:
        size = turn.nbytes
        with self._lock:
            old = self._turns.pop(branch, None)
            if old is not None:
                self._bytes -= old.nbytes
            if size > self.budget_bytes:
                return
            self._turns[branch] = turn
            self._bytes += size
            while self._bytes > self.budget_bytes:
                _, out = self._turns.popitem(last=False)
                self._bytes -= out.nbytes


def _prompt(turn: _Turn | None) -> PagedPrompt | None:
    return None if turn is None else turn.prompt
