"""Tokenize once per turn: each agent branch's last prompt is kept, so that its next turn
tokenizes and hashes only what it adds (issue 29).

An agent re-sends its whole context every turn. At 100k tokens a Hugging Face BPE spends
~100-200 ms of the router's CPU tokenizing it again and SHA-256 paging ~1 ms hashing it again,
so without this the router's cost per request grows with the context, turn after turn.

Kept per named branch (`Turn`): a chat prompt's rendered parts (the tools, then each message:
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

A chat body is not decoded whole either (`read_chat`, `bodies.decode_chat`): the branch's last
body is kept as received, and the messages the new body writes with the same bytes are neither
decoded nor compared again: their parts are the kept ones.

Memory: ~20 bytes a token (ids 4, their decimal text for the engines' bodies ~6, page digests
2 at 16-token pages, the chat text ~4, the chat body as received ~4), bounded by `budget_bytes`
with the least recently used branch dropped first; an ended branch's entry is dropped (`drop`).
`encode` runs in worker threads (`asyncio.to_thread`), or on the event loop where a turn brings
little to encode (`light`): one lock guards the entries, and the tokenizing and hashing run
outside it. The turn a request was read against (`last`) is handed
to `encode` with it, so that a concurrent request on the branch cannot swap it in between.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from evolving_infra import PagedPrompt, PageHashes
from evolving_infra.router.api import ChatRequest, CompletionRequest, parse_chat, parse_completion
from evolving_infra.router.bodies import KeptBody, decode_chat, decode_ids
from evolving_infra.router.tokenize import Tokenizer, assistant_ids, render_parts

DEFAULT_BUDGET_MIB = 512
# The most a turn may bring to encode on the router's event loop rather than in a worker thread
# (`light`): new characters to tokenize (~0.1-0.3 ms with a Hugging Face BPE), new token ids to
# page and hash (~0.05 ms). A worker thread's hop costs more than that work (~0.1 ms of handing
# over and waking, and the event loop runs whatever else is ready meanwhile): ids kept from the
# last turn, encoded inline, took the router's P50 overhead per warm turn from 0.27 to 0.12 ms at
# 1k tokens and from 0.46-0.56 to 0.35-0.36 ms at 100k on the quiet 2-core VM
# (`benches/router_overhead.py --api completions`, docs/live.md).
INLINE_CHARS = 2048
INLINE_IDS = 4096


@dataclass(frozen=True, slots=True)
class Encoded:
    """A prompt's token ids and page hashes, and what its branch's last turn spared."""

    ids: PagedPrompt  # a sequence of the ids, kept as the branch's last prompt
    hashes: PageHashes  # a sequence the directory reads natively
    tokenized: int  # tokens the tokenizer produced for this request (0 for ids sent as ids)
    reused: int  # leading tokens shared with the branch's last prompt: their pages not rehashed


@dataclass(frozen=True, slots=True)
class Turn:
    """A branch's last prompt."""

    parts: tuple[str, ...]  # a chat prompt's rendered parts; () for a completion
    ends: tuple[int, ...]  # token count at the end of each part
    prompt: PagedPrompt
    tools: str | None = None  # a chat prompt's tools (its first part)
    body: KeptBody | None = None  # the body as received (a chat's, or a completion's of ids)

    @property
    def nbytes(self) -> int:
        body = 0 if self.body is None else self.body.nbytes
        return self.prompt.nbytes + sum(len(p) for p in self.parts) + body


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
        self._turns: OrderedDict[str, Turn] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._assistant = tuple(assistant_ids(tokenizer))

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._turns)

    def read_chat(
        self, raw: bytes, last: Turn | None, keep: bool = True
    ) -> tuple[ChatRequest, KeptBody | None]:
        """A chat body, its messages that `last`'s body also starts with left out (counted in
        `ChatRequest.kept`); and the body to keep (`keep`: a branch will keep it). A 400
        `ApiError` if it is not one."""
        decoded = decode_chat(raw, None if last is None else last.body, keep)
        req = parse_chat(decoded.value, decoded.kept)
        if decoded.kept and (last is None or last.tools != req.tools or not last.parts):
            # New tools come before every message: nothing kept holds (a rare change).
            decoded = decode_chat(raw, None, keep)
            req = parse_chat(decoded.value)
        return req, decoded.body

    def read_completion(
        self, raw: bytes, last: Turn | None, keep: bool = True
    ) -> tuple[CompletionRequest, KeptBody | None]:
        """A completion body, the leading token ids of its `prompt` that `last`'s body also
        starts with left out (counted in `CompletionRequest.kept`); and the body to keep."""
        decoded = decode_ids(raw, None if last is None else last.body, keep)
        return parse_completion(decoded.value, decoded.kept), decoded.body

    @staticmethod
    def light(req: ChatRequest | CompletionRequest) -> bool:
        """Whether `encode` has little to do for `req` (`INLINE_CHARS`, `INLINE_IDS`): what
        the turns before it left out (`kept`) is not encoded again, the rest is."""
        if isinstance(req, CompletionRequest):
            if isinstance(req.prompt, str):
                return len(req.prompt) <= INLINE_CHARS
            return len(req.prompt) <= INLINE_IDS
        chars = 0 if req.kept or req.tools is None else len(req.tools)
        for m in req.messages:
            chars += len(m.content or "") + len(m.tool_calls or "")
            if chars > INLINE_CHARS:
                return False
        return True

    def last(self, branch: str | None, after: str | None = None) -> Turn | None:
        """`branch`'s last turn, else `after`'s (a fork's parent, when the branch has none)."""
        with self._lock:
            for key in (branch, after):
                if key is not None and (turn := self._turns.get(key)) is not None:
                    self._turns.move_to_end(key)
                    return turn
        return None

    def encode(
        self,
        req: ChatRequest | CompletionRequest,
        branch: str | None,
        last: Turn | None = None,
        body: KeptBody | None = None,
    ) -> Encoded:
        """The request's ids and hashes, from `last` (`last(branch, parent)`, the turn a chat
        request was read against) where it still holds; kept as `branch`'s last turn with
        `body` (`read_chat`'s). No branch: computed whole and not kept."""
        if isinstance(req, ChatRequest):
            turn, tokenized = self._chat(req, last, body)
        else:
            ids: Sequence[int]
            tokenized = 0
            if req.kept:  # `last`'s first ids, then these (`read_completion` found them)
                assert last is not None, "a request with kept ids was read against a turn"
                assert not isinstance(req.prompt, str), "kept ids are followed by ids"
                prompt = PagedPrompt.extend(last.prompt, req.kept, req.prompt)
            elif isinstance(req.prompt, str):
                ids = self.tokenizer.encode(req.prompt)
                tokenized = len(ids)
                prompt = PagedPrompt(ids, self.page_size, _prompt(last))
                # A prompt of text (`["..."]` too): its body's commas are not id separators,
                # so it is not kept to read the next body against.
                body = None
            else:  # token ids, already checked: hashed as they are
                prompt = PagedPrompt(req.prompt, self.page_size, _prompt(last))
            turn = Turn((), (), prompt, body=body)
        if branch is not None:
            self._put(branch, turn)
        prompt = turn.prompt
        # The kept prompt goes on as the request's ids (ids sent as ids too: it writes the
        # engines' JSON ~4x faster than orjson writes the tuple, `transport.ids_json`).
        return Encoded(prompt, prompt.hashes(), tokenized, prompt.reused)

    def _chat(self, req: ChatRequest, last: Turn | None, body: KeptBody | None) -> tuple[Turn, int]:
        """The chat prompt's turn and the tokens tokenized for it: the parts `last` ends with
        the same text are taken from it, ids and page digests, the rest tokenized."""
        if req.kept:  # the tools and the first `kept` messages: `last`'s, as `read_chat` found
            assert last is not None, "a request with kept messages was read against a turn"
            same = req.kept + (req.tools is not None)
            parts = [*last.parts[:same], *render_parts(req.messages)]
        else:
            parts, same = render_parts(req.messages, req.tools), 0
        if last is not None:
            for new, old in zip(parts[same:], last.parts[same:], strict=False):
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
        return Turn(tuple(parts), tuple(ends), prompt, req.tools, body), tokenized

    def drop(self, branch: str) -> None:
        """Forget `branch`'s last turn (it ended)."""
        with self._lock:
            turn = self._turns.pop(branch, None)
            if turn is not None:
                self._bytes -= turn.nbytes

    def _put(self, branch: str, turn: Turn) -> None:
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


def _prompt(turn: Turn | None) -> PagedPrompt | None:
    return None if turn is None else turn.prompt
