"""Decode once per turn: the leading elements of a body's context (a chat request's
`messages`, a completion's `prompt` of token ids) that are byte for byte those of the branch's
last request are not decoded again (issue 29).

An agent re-sends its whole context every turn; at 100k tokens the body is ~400-600 KB of JSON,
and decoding it (~0.4-0.6 ms for chat text, ~3 ms for 100k ids as Python ints) was the largest
cost that still grew with the context once `turns.TurnCache` stopped tokenizing it again. The
branch's last body is kept (`KeptBody`: the bytes as received, where the context array lies in
them and, for messages, each element, found by the native scanner `array_spans` without
decoding). The next body is compared with it byte for byte (`common_prefix`, ~20 µs at
400 KB); the elements wholly inside the common prefix are *kept*: not decoded, and their tokens
reused. What follows them is decoded as the document `body[:open + 1] + body[first new
element:]`: the body with the kept elements (and the comma after them) cut out. Token ids are
too many to keep a span each: the kept ones are those followed by a comma inside the common
prefix (counted with `bytes.count`).

Why that is exact: the kept bytes were decoded and checked as part of the last body, and the
scanner checks that what is cut between them and the first new element is whitespace and one
comma, so the body is valid JSON exactly when the cut document is, and decodes to the same
object with the kept elements put back. Keys after the array are in the cut document; keys
before it are in the common prefix. A body the scanner cannot read unambiguously (a key written
with an escape, the key twice) is decoded whole and not kept.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import orjson

from evolving_infra._core import array_spans, common_prefix
from evolving_infra.router.api import INVALID_JSON, ApiError

MESSAGES = "messages"
PROMPT = "prompt"


@dataclass(frozen=True, slots=True)
class KeptBody:
    """A body as received and where its context array lies in it."""

    raw: bytes
    key: str  # MESSAGES or PROMPT
    open: int  # offset of the array's `[`
    close: int  # offset of its `]`
    # Chat messages: the end offset (exclusive) and the start offset of each; () for ids.
    ends: tuple[int, ...] = ()
    starts: tuple[int, ...] = ()
    ids: int = 0  # token ids in the array (a completion's prompt)

    @property
    def nbytes(self) -> int:
        return len(self.raw) + 16 * len(self.ends)

    def message(self, i: int) -> bytes:
        """Message `i`'s JSON text."""
        return self.raw[self.starts[i] : self.ends[i]]


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded body; its context leaves out the first `kept` elements (those of `last`)."""

    value: Any
    kept: int
    body: KeptBody | None  # what the branch's next request is compared with (None: unreadable)


def loads(raw: bytes) -> Any:
    """The JSON value of `raw`, or a 400 `ApiError` naming what is wrong."""
    try:
        # orjson: ~3x json's speed on a prompt of ids; it refuses NaN and Infinity as JSON
        # does not have them, and reads an int past 64 bits as a float (refused later).
        return orjson.loads(raw)
    except ValueError as e:  # JSONDecodeError, also for invalid UTF-8 and deep nesting
        raise ApiError(400, f"malformed JSON body: {e}", code=INVALID_JSON) from None


def decode_chat(raw: bytes, last: KeptBody | None, keep: bool = True) -> Decoded:
    """`raw` decoded, without the leading messages it shares byte for byte with `last`; and,
    with `keep`, what the next request is to be compared with (a body no branch names is not
    scanned for it)."""
    if last is not None and last.key == MESSAGES and (cut := _after_message(raw, last)):
        return cut
    value = loads(raw)
    found = array_spans(raw, MESSAGES) if keep else None
    if found is None:
        return Decoded(value, 0, None)
    open_, close, spans = found
    ends, starts = tuple(e for _, e in spans), tuple(s for s, _ in spans)
    return Decoded(value, 0, KeptBody(raw, MESSAGES, open_, close, ends, starts))


def decode_ids(raw: bytes, last: KeptBody | None, keep: bool = True) -> Decoded:
    """`raw` (a completion) decoded, without the leading token ids of its `prompt` array that
    it shares byte for byte with `last` (whose `prompt` was an array of ids); `keep` as for
    `decode_chat`."""
    if last is not None and last.key == PROMPT and (cut := _after_id(raw, last)):
        return cut
    value = loads(raw)
    found = array_spans(raw, PROMPT, spans=False) if keep else None
    if found is None or not isinstance(value, dict) or not isinstance(value.get(PROMPT), list):
        return Decoded(value, 0, None)
    return Decoded(value, 0, KeptBody(raw, PROMPT, found[0], found[1], ids=len(value[PROMPT])))


def _after_message(raw: bytes, last: KeptBody) -> Decoded | None:
    """`raw` decoded from its first message not in `last`; None where nothing is shared or
    the rest does not decode (the whole body is then decoded, and names the error)."""
    kept = bisect_right(last.ends, common_prefix(raw, last.raw))
    if kept == 0:
        return None
    found = array_spans(raw, MESSAGES, (last.open, last.ends[kept - 1]))
    if found is None:
        return None
    _, close, new = found
    value = _cut(raw, last.open, new[0][0] if new else close)
    if value is None:
        return None
    ends = last.ends[:kept] + tuple(e for _, e in new)
    starts = last.starts[:kept] + tuple(s for s, _ in new)
    return Decoded(value, kept, KeptBody(raw, MESSAGES, last.open, close, ends, starts))


def _after_id(raw: bytes, last: KeptBody) -> Decoded | None:
    """As `_after_message` for an array of ids: kept, each id followed by its comma inside the
    common prefix (the id's text is then whole, and equal)."""
    shared = min(common_prefix(raw, last.raw), last.close)
    start = last.open + 1
    if shared - start < last.close - shared:
        kept = last.raw.count(b",", start, shared)
    else:  # counted from the end: a next turn shares all but the last few ids
        kept = last.ids - 1 - last.raw.count(b",", shared, last.close)
    if kept <= 0:
        return None
    comma = last.raw.rfind(b",", last.open + 1, shared)
    found = array_spans(raw, PROMPT, (last.open, comma))
    if found is None or not found[2]:
        return None
    _, close, new = found
    value = _cut(raw, last.open, new[0][0])
    if value is None:
        return None
    # The scanner found the array under PROMPT in an object: the cut document has it.
    ids = kept + len(value[PROMPT])
    return Decoded(value, kept, KeptBody(raw, PROMPT, last.open, close, ids=ids))


def _cut(raw: bytes, open_: int, cut: int) -> Any:
    """The body decoded with the bytes between the array's `[` and `cut` left out; None where
    that is not JSON (the whole body is then decoded, and names the error)."""
    try:
        return orjson.loads(raw[: open_ + 1] + raw[cut:])
    except ValueError:
        return None
