"""Decode once per turn: a chat body's messages that are byte for byte those of the branch's
last request are not decoded again (issue 29).

An agent re-sends its whole context every turn; at 100k tokens the body is ~400 KB of JSON,
and decoding it (~0.4-0.6 ms with orjson, the strings built again) was the largest cost that
still grew with the context once `turns.TurnCache` stopped tokenizing it again. The branch's
last body is kept (`KeptBody`: the bytes as received, and where each message lies in them,
found by the native scanner `message_spans` without decoding). The next body is compared with
it byte for byte (`common_prefix`, ~20 µs at 400 KB); the messages wholly inside the common
prefix are *kept*: not decoded, and their tokens reused. What follows them is decoded as the
document `body[:open + 1] + body[first new message:]`: the body with the kept messages (and
the comma after them) cut out.

Why that is exact: the kept bytes were decoded and checked as part of the last body, and the
scanner checks that what is cut between them and the first new message is whitespace and one
comma, so the body is valid JSON exactly when the cut document is, and decodes to the same
object with the kept messages put back. Keys after the messages array are in the cut document;
keys before it are in the common prefix. A body the scanner cannot read unambiguously (a key
written with an escape, `"messages"` twice) is decoded whole and not kept.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import orjson

from evolving_infra._core import common_prefix, message_spans
from evolving_infra.router.api import INVALID_JSON, ApiError


@dataclass(frozen=True, slots=True)
class KeptBody:
    """A chat body as received and where its messages lie in it."""

    raw: bytes
    open: int  # offset of the messages array's `[`
    ends: tuple[int, ...]  # end offset (exclusive) of each message
    starts: tuple[int, ...]  # start offset of each message

    @property
    def nbytes(self) -> int:
        return len(self.raw) + 16 * len(self.ends)

    def message(self, i: int) -> bytes:
        """Message `i`'s JSON text."""
        return self.raw[self.starts[i] : self.ends[i]]


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded chat body; its `messages` leave out the first `kept` (those of `last`)."""

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


def decode_chat(raw: bytes, last: KeptBody | None) -> Decoded:
    """`raw` decoded, without the leading messages it shares byte for byte with `last`."""
    if last is not None and (cut := _after(raw, last)) is not None:
        return cut
    value = loads(raw)
    return Decoded(value, 0, _kept(raw, message_spans(raw)))


def _kept(raw: bytes, found: tuple[int, int, list[tuple[int, int]]] | None) -> KeptBody | None:
    if found is None:
        return None
    open_, _, spans = found
    return KeptBody(raw, open_, tuple(e for _, e in spans), tuple(s for s, _ in spans))


def _after(raw: bytes, last: KeptBody) -> Decoded | None:
    """`raw` decoded from its first message not in `last`; None where nothing is shared or
    the rest does not decode (the whole body is then decoded, and names the error)."""
    kept = bisect_right(last.ends, common_prefix(raw, last.raw))
    if kept == 0:
        return None
    found = message_spans(raw, (last.open, last.ends[kept - 1]))
    if found is None:
        return None
    _, close, new = found
    cut = new[0][0] if new else close
    try:
        value = orjson.loads(raw[: last.open + 1] + raw[cut:])
    except ValueError:
        return None
    body = KeptBody(
        raw,
        last.open,
        last.ends[:kept] + tuple(e for _, e in new),
        last.starts[:kept] + tuple(s for s, _ in new),
    )
    return Decoded(value, kept, body)


def same_messages(a: KeptBody, b: KeptBody) -> int:
    """How many leading messages `a` and `b` write with the same bytes."""
    n = 0
    for i in range(min(len(a.ends), len(b.ends))):
        if a.message(i) != b.message(i):
            break
        n += 1
    return n
