"""Tokenize once per turn (`router.turns`, issue 29): a branch's next turn reuses the ids and
page digests of its last prompt where the new one still starts with it, and the result is always
exactly what a whole tokenization and hashing give.

The tokenizer is a real byte-level BPE (Hugging Face `tokenizers`, trained here on a few
sentences) whose merges cross spaces and newlines, so that ids really depend on their context.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer as HfRaw
from tokenizers import decoders, models, pre_tokenizers, trainers

from evolving_infra import InvalidArgumentError, PagedPrompt, block_hashes
from evolving_infra.router.api import ChatMessage, ChatRequest, CompletionRequest, SamplingParams
from evolving_infra.router.tokenize import ByteTokenizer, HfTokenizer, Tokenizer, encode_chat
from evolving_infra.router.turns import INLINE_CHARS, INLINE_IDS, Encoded, TurnCache
from router_helpers import PAGE, Router, run_router

CORPUS = [
    "the agent reads the file and runs the tests again",
    "<|user|>\nfix the failing test<|end|>\n<|assistant|>\nI will read the file first<|end|>\n",
    'tool_calls=[{"name": "bash", "arguments": {"command": "pytest -q"}}]',
    "def main() -> None:\n    print('hello world')\n\n",
]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    raw = HfRaw(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    raw.train_from_iterator(CORPUS * 20, trainer)
    return HfTokenizer(raw, "bpe")


def chat(*messages: ChatMessage, tools: str | None = None) -> ChatRequest:
    return ChatRequest("m", tuple(messages), SamplingParams(), tools=tools)


def user(text: str) -> ChatMessage:
    return ChatMessage("user", text)


def reply(text: str) -> ChatMessage:
    return ChatMessage("assistant", text)


def encode(
    cache: TurnCache,
    req: ChatRequest | CompletionRequest,
    branch: str | None,
    after: str | None = None,
) -> Encoded:
    """As the router does: against the branch's last turn (a fork's first: its parent's)."""
    return cache.encode(req, branch, None if branch is None else cache.last(branch, after))


def whole(tok: Tokenizer, req: ChatRequest) -> list[int]:
    return encode_chat(tok, req.messages, req.tools)


def test_a_turn_tokenizes_only_the_messages_it_adds(bpe: Tokenizer) -> None:
    cache = TurnCache(bpe, PAGE)
    first = chat(user("fix the failing test " * 30), tools='[{"name": "bash"}]')
    a = encode(cache, first, "b")
    assert list(a.ids) == whole(bpe, first)
    assert a.hashes == block_hashes(a.ids, PAGE)
    assert (a.reused, a.tokenized) == (0, len(a.ids) - len(bpe.encode("<|assistant|>\n")))
    second = chat(*first.messages, reply("I will read the file first"), user("run the tests"),
                  tools=first.tools)  # fmt: skip
    b = encode(cache, second, "b")
    assert list(b.ids) == whole(bpe, second)
    assert b.hashes == block_hashes(b.ids, PAGE)
    added = sum(len(bpe.encode(p)) for p in _parts(second)[2:])
    assert b.tokenized == added
    # Reused: everything up to the end of the first message (the assistant header that ended
    # the first prompt is where the reply's part now starts).
    assert b.reused == len(a.ids) - len(bpe.encode("<|assistant|>\n"))
    assert len(cache) == 1
    assert cache.nbytes > 0


def test_an_edited_history_reuses_only_what_it_still_shares(bpe: Tokenizer) -> None:
    cache = TurnCache(bpe, PAGE)
    msgs = [user("the agent reads the file " * 10), reply("ok " * 40), user("again " * 20)]
    before = encode(cache, chat(*msgs), "b").ids
    # A compaction: the second message is rewritten, the third kept.
    edited = chat(msgs[0], reply("summary of the work so far"), msgs[2])
    e = encode(cache, edited, "b")
    assert list(e.ids) == whole(bpe, edited)
    assert e.hashes == block_hashes(e.ids, PAGE)
    # What the text kept: the first message (the ids may share a few more, the header of the
    # rewritten reply, which are hashed again).
    assert e.reused == len(bpe.encode(_parts(edited)[0])) <= _common(before, e.ids)
    assert e.tokenized == sum(len(bpe.encode(p)) for p in _parts(edited)[1:])


def test_a_fork_starts_from_its_parent_and_keeps_its_own(bpe: Tokenizer) -> None:
    cache = TurnCache(bpe, PAGE)
    base = [user("the agent reads the file " * 12), reply("done " * 30)]
    encode(cache, chat(*base), "parent")
    child = chat(*base, user("now the sub-task"))
    c = encode(cache, child, "child", after="parent")
    assert list(c.ids) == whole(bpe, child)
    assert c.tokenized == len(bpe.encode(_parts(child)[2]))
    assert len(cache) == 2
    cache.drop("parent")
    cache.drop("parent")  # twice: nothing
    assert len(cache) == 1


def test_no_branch_is_computed_whole_and_not_kept(bpe: Tokenizer) -> None:
    cache = TurnCache(bpe, PAGE)
    req = chat(user("hello world " * 9))
    for _ in range(2):
        e = encode(cache, req, None)
        assert e.reused == 0
        assert list(e.ids) == whole(bpe, req)
    assert len(cache) == 0
    assert cache.nbytes == 0


def test_token_ids_are_kept_as_sent_and_only_new_pages_hashed() -> None:
    cache = TurnCache(ByteTokenizer(), PAGE)
    ids = tuple(range(1000, 1500))
    a = encode(cache, CompletionRequest("m", ids, SamplingParams()), "b")
    assert tuple(a.ids) == ids
    assert a.ids.json() == orjson.dumps(ids)
    assert a.tokenized == 0
    assert a.hashes == block_hashes(ids, PAGE)
    longer = (*ids, *range(7, 300))
    b = encode(cache, CompletionRequest("m", longer, SamplingParams()), "b")
    assert b.reused == len(ids)
    assert b.hashes == block_hashes(longer, PAGE)
    # A different prompt on the same branch (a client's bug, or a new context): verified, so
    # its hashes are its own.
    other = (5, *longer[1:])
    c = encode(cache, CompletionRequest("m", other, SamplingParams()), "b")
    assert c.reused == 0
    assert c.hashes == block_hashes(other, PAGE)
    text = encode(cache, CompletionRequest("m", "hello " * 40, SamplingParams()), "b")
    assert text.tokenized == len(text.ids) == 240
    assert text.reused == 0


def test_the_budget_drops_the_least_recently_used_branch(bpe: Tokenizer) -> None:
    probe = TurnCache(bpe, PAGE)  # how big one kept prompt is
    req = chat(user("the agent reads the file " * 20))
    encode(probe, req, "x")
    size = probe.nbytes
    cache = TurnCache(bpe, PAGE, budget_bytes=2 * size)
    encode(cache, req, "a")
    encode(cache, req, "b")
    encode(cache, req, "a")  # a is now the most recent
    encode(cache, req, "c")
    assert len(cache) == 2
    assert cache.nbytes == 2 * size
    assert encode(cache, req, "a").reused > 0  # kept
    assert encode(cache, req, "b").reused == 0  # dropped
    tiny = TurnCache(bpe, PAGE, budget_bytes=size - 1)
    encode(tiny, req, "a")
    assert len(tiny) == 0
    assert tiny.nbytes == 0
    with pytest.raises(ValueError, match="page_size"):
        TurnCache(bpe, 0)


def test_paged_prompt_refuses_bad_ids_and_pages() -> None:
    with pytest.raises(InvalidArgumentError):
        PagedPrompt([1, -1], PAGE)
    with pytest.raises(InvalidArgumentError):
        PagedPrompt([1, 2**32], PAGE)
    with pytest.raises(InvalidArgumentError):
        PagedPrompt([1, 2], 0)
    with pytest.raises(TypeError):
        PagedPrompt("abc", PAGE)  # type: ignore[arg-type]
    p = PagedPrompt(list(range(40)), PAGE)
    assert (len(p), p.page_size, p[:3], list(p), p.reused) == (
        40,
        PAGE,
        [0, 1, 2],
        list(range(40)),
        0,
    )
    assert PagedPrompt(list(range(40)), 8, after=p).reused == 0  # other pages: nothing reused


WORDS = st.sampled_from(["the", "agent", "file", "tests", "\n", "  ", "é", "ok", "run", "{"])
TEXT = st.lists(WORDS, max_size=30).map(" ".join)
MESSAGE = st.builds(ChatMessage, st.sampled_from(["user", "assistant", "tool"]), TEXT)


@settings(max_examples=60, deadline=None)
@given(
    turns=st.lists(
        st.tuples(st.integers(0, 6), st.lists(MESSAGE, min_size=1, max_size=3)),
        min_size=1,
        max_size=6,
    )
)
def test_any_sequence_of_turns_gives_whole_tokenizations(
    bpe: Tokenizer, turns: list[tuple[int, list[ChatMessage]]]
) -> None:
    """Each turn keeps a prefix of the last turn's messages (all of them, or fewer: a
    compaction) and adds some: the ids and hashes are always the whole prompt's."""
    cache = TurnCache(bpe, PAGE)
    history: list[ChatMessage] = []
    for keep, added in turns:
        history = history[: max(len(history) - keep, 0)] + added
        req = chat(*history)
        e = encode(cache, req, "b")
        assert list(e.ids) == whole(bpe, req)
        assert e.hashes == block_hashes(e.ids, PAGE)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _parts(req: ChatRequest) -> list[str]:
    from evolving_infra.router.tokenize import render_parts

    return render_parts(req.messages, req.tools)


def _value(r: Router, name: str) -> float:
    for family in text_string_to_metric_families(r.metrics.render().decode()):
        for s in family.samples:
            if s.name == name:
                return float(s.value)
    raise AssertionError(f"no sample {name}")


@pytest.mark.parametrize("repeat", [20, 200])  # 500 characters: encoded inline; 5,000: in a thread
def test_the_app_tokenizes_a_branch_once_and_forgets_it_when_it_ends(
    bpe: Tokenizer, repeat: int
) -> None:
    content = "the agent reads the file " * repeat
    assert TurnCache.light(chat(user(content))) == (repeat == 20)
    first: list[dict[str, str]] = [{"role": "user", "content": content}]
    second = [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "run"}]
    headers = {"X-Agent-Branch": "b"}

    async def test(r: Router) -> None:
        for messages in (first, second):
            body = {"model": "m", "messages": messages, "max_tokens": 2}
            resp = await r.client.post("/v1/chat/completions", json=body, headers=headers)
            assert resp.status == 200, await resp.text()
        a, b = r.dispatcher.seen
        assert list(b.token_ids) == whole(bpe, chat(*_messages(second)))
        assert list(b.block_hashes) == block_hashes(b.token_ids, PAGE)
        new = sum(len(bpe.encode(p)) for p in _parts(chat(*_messages(second)))[1:])
        assert (
            _value(r, "evolving_prompt_tokens_tokenized_total")
            == len(a.token_ids) - len(bpe.encode("<|assistant|>\n")) + new
        )
        assert _value(r, "evolving_prompt_tokens_reused_total") >= len(a.token_ids) - 8
        assert _value(r, "evolving_turn_cache_branches") == 1
        assert (await r.client.post("/v1/branches/b/end")).status == 200
        assert _value(r, "evolving_turn_cache_branches") == 0
        assert _value(r, "evolving_turn_cache_bytes") == 0

    run_router(test, tokenizer=bpe)


def test_light_turns_are_those_with_little_new_to_encode() -> None:
    """`TurnCache.light`: what a turn brings anew (not what its branch's last turn left out,
    `kept`) is small enough to encode on the event loop rather than in a worker thread."""
    params = SamplingParams()
    assert TurnCache.light(CompletionRequest("m", tuple(range(INLINE_IDS)), params))
    assert not TurnCache.light(CompletionRequest("m", tuple(range(INLINE_IDS + 1)), params))
    kept = CompletionRequest("m", (1, 2, 3), params, kept=100_000)
    assert TurnCache.light(kept)  # 100k ids kept from the last turn, three new
    assert TurnCache.light(CompletionRequest("m", "x" * INLINE_CHARS, params))
    assert not TurnCache.light(CompletionRequest("m", "x" * (INLINE_CHARS + 1), params))
    half = "y" * (INLINE_CHARS // 2)
    assert TurnCache.light(chat(user(half), reply(half)))
    assert not TurnCache.light(chat(user(half), reply(half), user("z")))
    tools = "t" * INLINE_CHARS
    assert not TurnCache.light(chat(user("hi"), tools=tools))  # the tools are rendered too
    again = ChatRequest("m", (user("hi"),), params, tools=tools, kept=4)
    assert TurnCache.light(again)  # its tools come with the kept messages
    call = ChatMessage("assistant", None, tool_calls="c" * (INLINE_CHARS + 1))
    assert not TurnCache.light(chat(call))


def _messages(raw: Sequence[dict[str, str]]) -> list[ChatMessage]:
    return [ChatMessage(m["role"], m["content"]) for m in raw]
