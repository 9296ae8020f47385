"""Decode once per turn (`router.bodies`, issue 29): a chat body's messages, or a completion's
token ids, that repeat the branch's last body byte for byte are not decoded again, and what is
decoded is always exactly what decoding the whole body gives, or the same 400 when the body is
not JSON.

The scanner (`array_spans`) is checked against `json` on generated documents; the cut decoding
against whole decoding on turn sequences written in several JSON styles.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evolving_infra._core import array_spans, block_hashes, common_prefix
from evolving_infra.router.api import ApiError, ChatRequest, parse_chat, parse_completion
from evolving_infra.router.bodies import KeptBody, decode_chat, decode_ids, loads
from evolving_infra.router.tokenize import ByteTokenizer, encode_chat
from evolving_infra.router.turns import TurnCache

PAGE = 16

# Text with what a scanner can trip on: quotes, backslashes, brackets, braces, commas, unicode.
TEXT = st.text(alphabet=st.sampled_from([*'ab "\\[]{},:é\n\t\u2028', "😀"]), max_size=20)
SCALAR = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | TEXT
VALUE = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system"]), "content": TEXT},
    optional={"name": st.sampled_from(["a", "b\\c"]), "extra": VALUE},
)
STYLES: list[Callable[[Any], bytes]] = [
    lambda v: orjson.dumps(v),
    lambda v: json.dumps(v).encode(),
    lambda v: json.dumps(v, indent=1, ensure_ascii=False).encode(),
    lambda v: json.dumps(v, separators=(" ,", " : ")).encode(),
]


def body(messages: list[Any], before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    return {**before, "messages": messages, **after}


@settings(max_examples=200, deadline=None)
@given(
    messages=st.lists(VALUE, max_size=5),
    before=st.dictionaries(TEXT.filter(lambda k: k != "messages"), VALUE, max_size=2),
    after=st.dictionaries(TEXT.filter(lambda k: k != "messages"), VALUE, max_size=2),
    style=st.sampled_from(STYLES),
)
def test_the_scanner_finds_each_message_as_json_decodes_it(
    messages: list[Any], before: dict[str, Any], after: dict[str, Any], style: Any
) -> None:
    raw = style(body(messages, before, after))
    found = array_spans(raw, "messages")
    if any("\\" in json.dumps(k)[1:-1] for k in [*before, *after]):
        return  # an escaped key: the scanner may turn the body down (checked below)
    assert found is not None
    open_, close, spans = found
    assert raw[open_ : open_ + 1] == b"["
    assert raw[close : close + 1] == b"]"
    assert [json.loads(raw[s:e]) for s, e in spans] == messages
    for i in range(len(spans)):  # resumed after any element: the ones after it
        assert array_spans(raw, "messages", (open_, spans[i][1])) == (open_, close, spans[i + 1 :])
    assert array_spans(raw, "messages", spans=False) == (open_, close, [])


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [1], "messages": [2]}',
        b'{"messag\\u0065s": [2], "messages": [1]}',
        b'{"messages": [1,]}',
        b'{"messages": [1 2]}',
        b'{"messages": "x"}',
        b'{"model": "m"}',
        b'[{"messages": []}]',
        b'{"messages": [1]} trailing',
        b'{"messages": ["unterminated]}',
    ],
)
def test_the_scanner_turns_down_what_it_cannot_read_unambiguously(raw: bytes) -> None:
    assert array_spans(raw, "messages") is None


def test_a_body_no_branch_keeps_is_not_scanned() -> None:
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "prompt": [1, 2]}'
    assert decode_chat(raw, None).body is not None
    assert decode_chat(raw, None, keep=False).body is None
    assert decode_ids(raw, None).body is not None
    assert decode_ids(raw, None, keep=False).body is None


def test_common_prefix() -> None:
    assert common_prefix(b"abcdef" * 100, b"abcdef" * 50 + b"x") == 300
    assert common_prefix(b"", b"abc") == 0
    assert common_prefix(b"abc", b"abc") == 3


def _decoded_equals_whole(raw: bytes, last: KeptBody | None) -> int:
    whole = json.loads(raw)
    d = decode_chat(raw, last)
    assert {k: v for k, v in d.value.items() if k != "messages"} == {
        k: v for k, v in whole.items() if k != "messages"
    }
    assert d.value["messages"] == whole["messages"][d.kept :]
    if last is not None:  # what is kept is written with the same bytes in both bodies
        for i in range(d.kept):
            assert last.message(i) == raw[d.body.starts[i] : d.body.ends[i]]  # type: ignore[union-attr]
    return d.kept


@settings(max_examples=200, deadline=None)
@given(
    turns=st.lists(
        st.tuples(
            st.integers(0, 3),  # messages the turn drops from the end (a compaction: >0)
            st.lists(MESSAGE, max_size=3),
            st.sampled_from(STYLES),
            st.dictionaries(st.sampled_from(["user", "stream", "agent"]), VALUE, max_size=2),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_a_cut_body_decodes_as_the_whole_body(
    turns: list[tuple[int, list[Any], Any, dict[str, Any]]],
) -> None:
    history: list[Any] = []
    last: KeptBody | None = None
    last_style = None
    for drop, added, style, after in turns:
        history = history[: max(len(history) - drop, 0)] + added
        raw = style(body(history, {"model": "m"}, after))
        kept = _decoded_equals_whole(raw, last)
        if style is last_style and last is not None and not drop:
            # Appended in the same style: every message the last body had is kept.
            assert kept == len(last.ends)
        last = decode_chat(raw, last).body
        last_style = style


@pytest.mark.parametrize(
    "tail",
    [
        b', {"role": "user", "content": "x"}, ]}',  # a trailing comma: not valid JSON
        b' {"role": "user", "content": "x"}]}',  # no comma
        b', {"role": "user", "content": "x}]}',  # an unterminated string
        b', {"role": "user", "content": "\xff"}]}',  # invalid UTF-8
        b', {"role": "user", "content": "x"}], "messages": []}',  # messages twice
        b"]",  # the object never closed
    ],
)
def test_a_bad_tail_is_the_400_the_whole_body_gives(tail: bytes) -> None:
    first = b'{"model": "m", "messages": [{"role": "user", "content": "hello"}'
    last = decode_chat(first + b"]}", None).body
    assert last is not None
    raw = first + tail
    try:
        whole = orjson.loads(raw)
    except ValueError:
        with pytest.raises(ApiError) as e:
            decode_chat(raw, last)
        with pytest.raises(ApiError) as w:
            loads(raw)
        assert (e.value.status, e.value.code, e.value.message) == (
            400,
            w.value.code,
            w.value.message,
        )
    else:  # valid JSON whose scan is refused ("messages" twice): decoded whole, not kept
        d = decode_chat(raw, last)
        assert (d.value, d.kept, d.body) == (whole, 0, None)


ROLE = st.sampled_from(["user", "assistant", "tool"])
CHAT_MESSAGE = st.builds(lambda r, c: {"role": r, "content": c}, ROLE, TEXT)


@settings(max_examples=80, deadline=None)
@given(
    turns=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.lists(CHAT_MESSAGE, min_size=1, max_size=3),
            st.sampled_from(STYLES),
            st.sampled_from([None, [{"name": "bash"}], [{"name": "edit"}]]),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_turns_read_from_bytes_give_whole_tokenizations(
    turns: list[tuple[int, list[dict[str, str]], Any, list[Any] | None]],
) -> None:
    """Bodies read against the branch's last turn (messages kept, tools changed, styles
    changed, compactions): the request's ids are always the whole prompt's."""
    tok = ByteTokenizer()
    cache = TurnCache(tok, PAGE)
    history: list[dict[str, str]] = []
    for drop, added, style, tools in turns:
        history = history[: max(len(history) - drop, 0)] + added
        value: dict[str, Any] = {"model": "m", "messages": history}
        if tools is not None:
            value["tools"] = tools
        raw = style(value)
        last = cache.last("b")
        req, kept_body = cache.read_chat(raw, last)
        full: ChatRequest = parse_chat(orjson.loads(raw))
        assert req.messages == full.messages[req.kept :]
        assert req.tools == full.tools
        e = cache.encode(req, "b", last, kept_body)
        assert list(e.ids) == encode_chat(tok, full.messages, full.tools)


IDS = st.lists(st.integers(0, 2**32 - 1), max_size=40)


@settings(max_examples=200, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.integers(0, 5), IDS, st.sampled_from(STYLES)), min_size=1, max_size=6
    )
)
def test_a_cut_completion_decodes_as_the_whole_body(
    turns: list[tuple[int, list[int], Any]],
) -> None:
    """Ids appended, dropped from the end (an id's digits cut: `12` then `123`), restyled."""
    ids: list[int] = []
    last: KeptBody | None = None
    for drop, added, style in turns:
        ids = ids[: max(len(ids) - drop, 0)] + added
        raw = style({"model": "m", "prompt": ids, "max_tokens": 3})
        whole = json.loads(raw)
        d = decode_ids(raw, last)
        assert {k: v for k, v in d.value.items() if k != "prompt"} == {
            k: v for k, v in whole.items() if k != "prompt"
        }
        assert d.value["prompt"] == ids[d.kept :]
        if last is not None and d.kept:
            assert json.loads(last.raw)["prompt"][: d.kept] == ids[: d.kept]
        last = d.body


def test_turns_of_ids_keep_what_they_share() -> None:
    cache = TurnCache(ByteTokenizer(), PAGE)
    ids = list(range(1000, 1400))
    for turn, style in enumerate(s for s in STYLES for _ in range(2)):
        raw = style({"model": "m", "prompt": ids})
        last = cache.last("b")
        req, kept_body = cache.read_completion(raw, last)
        if turn % 2:  # the turn before's style, ids appended: all kept but its last id
            assert req.kept == len(ids) - 7 - 1
        e = cache.encode(req, "b", last, kept_body)
        assert list(e.ids) == ids
        assert e.hashes == block_hashes(ids, PAGE)
        ids = [*ids, *range(7)]
    # A chat body's turn is not read as ids (nor the other way round).
    chat_raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "1,2,3"}]})
    req_c, body_c = cache.read_chat(chat_raw, cache.last("b"))
    assert req_c.kept == 0
    cache.encode(req_c, "b", cache.last("b"), body_c)
    req_i, _ = cache.read_completion(
        orjson.dumps({"model": "m", "prompt": [1, 2, 3]}), cache.last("b")
    )
    assert req_i.kept == 0
    assert req_i.prompt == (1, 2, 3)


@pytest.mark.parametrize(
    "tail",
    [b", 5, ]}", b" 5]}", b', "x"]}', b", -1]}", b", 5]", b', 5], "prompt": [1]}'],
)
def test_a_bad_id_tail_is_what_the_whole_body_gives(tail: bytes) -> None:
    first = b'{"model": "m", "prompt": [1, 2, 3'
    cache = TurnCache(ByteTokenizer(), PAGE)
    req, body = cache.read_completion(first + b"]}", None)
    cache.encode(req, "b", None, body)
    raw = first + tail.replace(b"\\", b"")
    try:
        whole: Any = parse_completion(loads(raw))
    except ApiError as e:
        expect: ApiError | None = e
    else:
        expect = None
    if expect is None:
        got_req, _ = cache.read_completion(raw, cache.last("b"))
        assert (*(1, 2, 3)[: got_req.kept], *got_req.prompt) == whole.prompt
        return
    with pytest.raises(ApiError) as got:
        cache.read_completion(raw, cache.last("b"))
    assert (got.value.status, got.value.code) == (expect.status, expect.code)
    assert got.value.message == expect.message


def test_a_text_prompt_body_is_not_kept_as_ids() -> None:
    """A prompt of one string is text, not ids: its commas are not id separators, so its body
    must not be read as a kept array of ids (the next body, here malformed JSON whose cut
    document would be valid, gets the whole body's 400)."""
    cache = TurnCache(ByteTokenizer(), PAGE)
    first = b'{"model": "m", "prompt": ["5, 6 and a longer text after it"]}'
    req, body = cache.read_completion(first, None)
    cache.encode(req, "b", None, body)
    assert cache.last("b") is not None
    with pytest.raises(ApiError) as e:
        cache.read_completion(b'{"model": "m", "prompt": ["5, 7]}', cache.last("b"))
    assert (e.value.status, e.value.code) == (400, "invalid_json")
