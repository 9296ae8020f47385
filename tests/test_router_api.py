"""The router's HTTP front end: OpenAI shapes (JSON and SSE), errors, metrics, health, tokenizers,
config.

The dispatcher is a deterministic stand-in (`router_helpers.EchoDispatcher`): the real dispatch
core to the engines comes after the front end. Server and client are real aiohttp on loopback.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer as HfRaw
from tokenizers import models, pre_tokenizers

from evolving_infra import block_hashes
from evolving_infra.cli import ConfigError, config_defaults
from evolving_infra.router import api, config
from evolving_infra.router.api import ChatMessage
from evolving_infra.router.dispatcher import EngineFailedError, NoEngineError
from evolving_infra.router.tokenize import (
    ByteTokenizer,
    HfTokenizer,
    TokenizerLoadError,
    encode_chat,
    load_tokenizer,
    render_chat,
)
from router_helpers import PAGE, EchoDispatcher, Router, expected_text, parse_sse, run_router

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello world"}]}
COMPLETION = {"model": "m", "prompt": "hello world, again"}


def chat_ids(*messages: ChatMessage) -> list[int]:
    return list(render_chat(messages).encode())


def sample_values(r: Router, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """{sorted labels: value} of every sample called `name` in the rendered /metrics."""
    out = {}
    for family in text_string_to_metric_families(r.metrics.render().decode()):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


async def error_of(resp: Any, status: int, code: str) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    error: dict[str, Any] = body["error"]
    return error


# -- OpenAI shapes -----------------------------------------------------------------------------


def test_chat_non_streaming_shape() -> None:
    async def test(r: Router) -> None:
        resp = await r.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
        assert resp.status == 200
        body = await resp.json()
        assert body["object"] == "chat.completion"
        assert body["id"].startswith("chatcmpl-")
        assert body["model"] == "m"
        assert isinstance(body["created"], int)
        [choice] = body["choices"]
        assert choice == {
            "index": 0,
            "message": {"role": "assistant", "content": expected_text(5)},
            "logprobs": None,
            "finish_reason": "length",
        }
        ids = chat_ids(ChatMessage("user", "hello world"))
        full = len(ids) // PAGE
        assert body["usage"] == {
            "prompt_tokens": len(ids),
            "completion_tokens": 5,
            "total_tokens": len(ids) + 5,
            "prompt_tokens_details": {"cached_tokens": full * PAGE},
        }
        [prepared] = r.dispatcher.seen
        assert prepared.kind == "chat"
        assert list(prepared.token_ids) == ids
        assert list(prepared.block_hashes) == block_hashes(ids, PAGE)
        assert prepared.sampling.max_tokens == 5
        assert not prepared.stream
        assert resp.headers["X-Request-Id"] == body["id"].removeprefix("chatcmpl-")

    run_router(test)


def test_completion_non_streaming_shape_and_token_prompt() -> None:
    async def test(r: Router) -> None:
        resp = await r.client.post("/v1/completions", json=COMPLETION)
        body = await resp.json()
        assert resp.status == 200
        assert body["object"] == "text_completion"
        assert body["id"].startswith("cmpl-")
        assert body["choices"] == [
            {"index": 0, "text": expected_text(3), "logprobs": None, "finish_reason": "stop"}
        ]
        assert body["usage"]["prompt_tokens"] == len(COMPLETION["prompt"])
        # A prompt of token ids goes to dispatch as it is (no tokenizer involved).
        ids = [5, 6, 7, 8, 9, 10, 70000]
        resp = await r.client.post(
            "/v1/completions", json={"model": "m", "prompt": ids, "max_completion_tokens": 1}
        )
        assert resp.status == 200
        assert list(r.dispatcher.seen[-1].token_ids) == ids
        assert list(r.dispatcher.seen[-1].block_hashes) == block_hashes(ids, PAGE)

    run_router(test)


def test_chat_streaming_chunks_usage_and_done() -> None:
    async def test(r: Router) -> None:
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        resp = await r.client.post("/v1/chat/completions", json=body)
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        events = parse_sse(await resp.text())
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        ids = {c["id"] for c in chunks}
        assert len(ids) == 1
        assert ids.pop().startswith("chatcmpl-")
        for c in chunks:
            assert c["object"] == "chat.completion.chunk"
            assert c["model"] == "m"
            assert "usage" in c
        *choice_chunks, usage_chunk = chunks
        assert usage_chunk["choices"] == []
        n_prompt = len(chat_ids(ChatMessage("user", "hello world")))
        assert usage_chunk["usage"]["prompt_tokens"] == n_prompt
        assert usage_chunk["usage"]["completion_tokens"] == 3
        assert all(c["usage"] is None for c in choice_chunks)
        deltas = [c["choices"][0]["delta"] for c in choice_chunks]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert "".join(d.get("content", "") for d in deltas) == expected_text(3)
        assert [c["choices"][0]["finish_reason"] for c in choice_chunks] == [None] * 4 + ["stop"]
        assert deltas[-1] == {}

    run_router(test)


def test_completion_streaming_without_usage() -> None:
    async def test(r: Router) -> None:
        resp = await r.client.post(
            "/v1/completions", json={**COMPLETION, "stream": True, "max_tokens": 2}
        )
        events = parse_sse(await resp.text())
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text(2)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert r.dispatcher.seen[0].stream

    run_router(test)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"messages": CHAT["messages"]}, api.MISSING_FIELD, "model"),
        ({"model": "m"}, api.MISSING_FIELD, "messages"),
        ({"model": 3, "messages": CHAT["messages"]}, api.INVALID_VALUE, "model"),
        ({**CHAT, "messages": []}, api.INVALID_VALUE, "messages"),
        ({**CHAT, "messages": ["hi"]}, api.INVALID_VALUE, "messages[0]"),
        ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, api.INVALID_VALUE, None),
        ({**CHAT, "messages": [{"role": "user"}]}, api.MISSING_FIELD, "messages[0].content"),
        ({**CHAT, "max_tokens": "10"}, api.INVALID_VALUE, "max_tokens"),
        ({**CHAT, "max_tokens": 0}, api.INVALID_VALUE, "max_tokens"),
        ({**CHAT, "max_tokens": 4, "max_completion_tokens": 5}, api.INVALID_VALUE, None),
        ({**CHAT, "temperature": 3}, api.INVALID_VALUE, "temperature"),
        ({**CHAT, "stream": "yes"}, api.INVALID_VALUE, "stream"),
        ({**CHAT, "stream_options": {"include_usage": True}}, api.INVALID_VALUE, None),
        ({**CHAT, "n": 2}, api.UNSUPPORTED, "n"),
        ({**CHAT, "stop": [1]}, api.INVALID_VALUE, "stop"),
        ({**CHAT, "agent": "main"}, api.INVALID_VALUE, "agent"),
        ({**CHAT, "tools": {"name": "bash"}}, api.INVALID_VALUE, "tools"),
        ({**CHAT, "logprobs": True}, api.UNSUPPORTED, "logprobs"),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            api.UNSUPPORTED,
            "messages[0].content[0].type",
        ),
        ([1, 2], api.INVALID_VALUE, None),
    ],
)
def test_chat_bad_bodies_are_400(body: Any, code: str, param: str | None) -> None:
    async def test(r: Router) -> None:
        resp = await r.client.post("/v1/chat/completions", json=body)
        error = await error_of(resp, 400, code)
        assert error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param
        assert r.dispatcher.seen == []

    run_router(test)


@pytest.mark.parametrize(
    "prompt",
    [None, "", [], ["a", "b"], [1, -1], [1, 2**32], [1, "a"], {"text": "x"}, [True]],
)
def test_completion_bad_prompts_are_400(prompt: Any) -> None:
    async def test(r: Router) -> None:
        resp = await r.client.post("/v1/completions", json={"model": "m", "prompt": prompt})
        error = await error_of(resp, 400, (await resp.json())["error"]["code"])
        assert error["param"] == "prompt"
        assert r.tracker.anonymous_live == 0

    run_router(test)


def test_malformed_json_wrong_content_type_and_constants() -> None:
    async def test(r: Router) -> None:
        json_type = {"Content-Type": "application/json"}
        for data in (b"{not json", b'{"model": "m",', b"\xff\xfe\x00", b"", b'{"a": NaN}'):
            resp = await r.client.post("/v1/chat/completions", data=data, headers=json_type)
            error = await error_of(resp, 400, api.INVALID_JSON)
            assert "malformed JSON" in error["message"]
        resp = await r.client.post(
            "/v1/completions", data=json.dumps(COMPLETION), headers={"Content-Type": "text/plain"}
        )
        error = await error_of(resp, 400, api.INVALID_CONTENT_TYPE)
        assert "text/plain" in error["message"]
        # The server is still up and serving.
        assert (await r.client.post("/v1/completions", json=COMPLETION)).status == 200

    run_router(test)


def test_body_over_the_limit_is_413_with_or_without_length() -> None:
    async def test(r: Router) -> None:
        big = json.dumps({**COMPLETION, "prompt": "x" * 4096}).encode()
        headers = {"Content-Type": "application/json"}
        resp = await r.client.post("/v1/completions", data=big, headers=headers)
        error = await error_of(resp, 413, api.TOO_LARGE)
        assert "2048 bytes" in error["message"]

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the read must stop
            for i in range(0, len(big), 512):
                yield big[i : i + 512]

        resp = await r.client.post("/v1/completions", data=chunked(), headers=headers)
        await error_of(resp, 413, api.TOO_LARGE)
        assert (await r.client.post("/v1/completions", json=COMPLETION)).status == 200
        assert sample_values(r, "evolving_errors_total") == {
            (("code", api.TOO_LARGE), ("type", "invalid_request_error")): 2.0
        }

    run_router(test, max_body_bytes=2048)


def test_unknown_route_404_and_wrong_method_405_are_json() -> None:
    async def test(r: Router) -> None:
        error = await error_of(await r.client.get("/v1/nothing"), 404, api.NOT_FOUND)
        assert "/v1/nothing" in error["message"]
        resp = await r.client.get("/v1/chat/completions")
        error = await error_of(resp, 405, api.METHOD_NOT_ALLOWED)
        assert resp.headers["Allow"] == "POST"
        assert (
            sample_values(r, "evolving_requests_total")[(("route", "other"), ("status", "404"))]
            == 1.0
        )

    run_router(test)


def test_unknown_model_is_404_and_models_lists_served() -> None:
    async def test(r: Router) -> None:
        body = await (await r.client.get("/v1/models")).json()
        assert body["object"] == "list"
        assert [m["id"] for m in body["data"]] == ["m", "m2"]
        resp = await r.client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-x"})
        error = await error_of(resp, 404, api.UNKNOWN_MODEL)
        assert error["param"] == "model"
        resp = await r.client.post("/v1/chat/completions", json={**CHAT, "model": "m2"})
        assert resp.status == 200

    run_router(test, models=("m", "m2"))


# -- dispatch failures -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_no_engine_is_503_with_the_reason(stream: bool) -> None:
    async def test(r: Router) -> None:
        resp = await r.client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        error = await error_of(resp, 503, api.NO_ENGINE)
        assert "no decode node up" in error["message"]
        assert error["type"] == "service_unavailable"
        assert r.tracker.anonymous_live == 0
        assert r.dispatcher.open == 0

    run_router(test, dispatcher=EchoDispatcher(fail=NoEngineError("no decode node up")))


@pytest.mark.parametrize(("unavailable", "status"), [(False, 502), (True, 503)])
def test_engine_failure_is_502_or_503(unavailable: bool, status: int) -> None:
    failure = EngineFailedError("connection refused", node=3, unavailable=unavailable)

    async def test(r: Router) -> None:
        resp = await r.client.post("/v1/completions", json=COMPLETION)
        error = await error_of(resp, status, api.ENGINE_FAILED)
        assert "connection refused" in error["message"]

    run_router(test, dispatcher=EchoDispatcher(fail=failure))


def test_failure_mid_stream_is_an_sse_error_then_done() -> None:
    async def test(r: Router) -> None:
        resp = await r.client.post("/v1/completions", json={**COMPLETION, "stream": True})
        assert resp.status == 200  # the headers were sent with the first piece
        events = parse_sse(await resp.text())
        assert events[-1] == "[DONE]"
        assert events[0]["choices"][0]["text"] == "t0 "
        assert events[-2]["error"]["code"] == api.ENGINE_FAILED
        assert "engine stream broke" in events[-2]["error"]["message"]
        assert r.tracker.anonymous_live == 0
        assert sample_values(r, "evolving_requests_total") == {
            (("route", "/v1/completions"), ("status", "503")): 1.0
        }

    run_router(test, dispatcher=EchoDispatcher(fail_after=1))


def test_unexpected_error_is_a_logged_500_and_the_server_lives() -> None:
    async def test(r: Router) -> None:
        with structlog.testing.capture_logs() as logs:
            resp = await r.client.post("/v1/chat/completions", json=CHAT)
        error = await error_of(resp, 500, api.INTERNAL)
        assert "a bug" not in error["message"]  # internals stay in the log
        assert any(e["event"] == "unexpected error" and "exc_info" in e for e in logs)
        assert r.tracker.anonymous_live == 0
        r.dispatcher.raise_bug = False
        assert (await r.client.post("/v1/chat/completions", json=CHAT)).status == 200

    run_router(test, dispatcher=EchoDispatcher(raise_bug=True))


def test_errors_are_logged_with_code_and_request_id() -> None:
    async def test(r: Router) -> None:
        with structlog.testing.capture_logs() as logs:
            resp = await r.client.post(
                "/v1/chat/completions", json={"model": "m"}, headers={"X-Request-Id": "req-7"}
            )
        assert resp.headers["X-Request-Id"] == "req-7"
        [failed] = [e for e in logs if e["event"] == "request failed"]
        assert failed["code"] == api.MISSING_FIELD
        assert failed["status"] == 400
        assert failed["log_level"] == "warning"

    run_router(test)


# -- metrics and health ------------------------------------------------------------------------


def test_metrics_count_requests_tokens_and_latencies() -> None:
    async def test(r: Router) -> None:
        for _ in range(2):
            assert (await r.client.post("/v1/completions", json=COMPLETION)).status == 200
        assert (await r.client.post("/v1/completions", json={"model": "m"})).status == 400
        resp = await r.client.get("/metrics")
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
        families = list(text_string_to_metric_families(text))
        names = {f.name for f in families}
        # The router's own series and the process's; no `_created` beside each counter.
        assert all(n.startswith(("evolving_", "process_")) for n in names), names
        assert "process_resident_memory_bytes" in names
        assert not [s.name for f in families for s in f.samples if s.name.endswith("_created")]
        requests = sample_values(r, "evolving_requests_total")
        assert requests[(("route", "/v1/completions"), ("status", "200"))] == 2.0
        assert requests[(("route", "/v1/completions"), ("status", "400"))] == 1.0
        n = len(COMPLETION["prompt"])
        assert sample_values(r, "evolving_prompt_tokens_total") == {(): 2.0 * n}
        assert sample_values(r, "evolving_completion_tokens_total") == {(): 6.0}
        assert sample_values(r, "evolving_cached_prompt_tokens_total") == {
            (): 2.0 * (n // PAGE * PAGE)
        }
        assert sample_values(r, "evolving_ttft_seconds_count") == {(("route", "completion"),): 2}
        assert sample_values(r, "evolving_e2e_seconds_count") == {(("route", "completion"),): 2}
        assert sample_values(r, "evolving_errors_total") == {
            (("code", api.MISSING_FIELD), ("type", "invalid_request_error")): 1.0
        }
        assert sample_values(r, "evolving_branches_live") == {
            (("kind", "anonymous"),): 0.0,
            (("kind", "named"),): 0.0,
        }

    run_router(test)


def test_health_reports_ready_and_unready() -> None:
    async def test(r: Router) -> None:
        resp = await r.client.get("/health")
        body = await resp.json()
        assert resp.status == 200
        assert body["status"] == "ok"
        assert body["tokenizer"] == "bytes"
        assert body["page_size"] == PAGE
        r.dispatcher.ready = False
        resp = await r.client.get("/health")
        body = await resp.json()
        assert resp.status == 503
        assert body["status"] == "unavailable"
        assert body["reason"] == "no engine registered"

    run_router(test)


# -- tokenizers --------------------------------------------------------------------------------


def test_byte_tokenizer_is_utf8_bytes() -> None:
    assert ByteTokenizer().encode("aé") == [97, 0xC3, 0xA9]
    m = ChatMessage("user", "hi", name="bob")
    assert render_chat([m]) == "<|user name=bob|>\nhi<|end|>\n<|assistant|>\n"
    assert encode_chat(ByteTokenizer(), [m]) == list(render_chat([m]).encode())


def test_chat_with_tools_and_tool_calls_renders_them_into_the_prompt() -> None:
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": "you are an agent"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "list "}, {"type": "text", "text": "files"}],
        },
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"},
    ]

    async def test(r: Router) -> None:
        body = {"model": "m", "messages": messages, "tools": tools}
        assert (await r.client.post("/v1/chat/completions", json=body)).status == 200
        text = bytes(r.dispatcher.seen[0].token_ids).decode()
        assert text == (
            f"<|tools|>\n{json.dumps(tools, sort_keys=True)}<|end|>\n"
            "<|system|>\nyou are an agent<|end|>\n"
            "<|user|>\nlist files<|end|>\n"
            f"<|assistant|>\n\ntool_calls={json.dumps([call], sort_keys=True)}<|end|>\n"
            "<|tool tool_call_id=c1|>\na.py b.py<|end|>\n"
            "<|assistant|>\n"
        )
        # The next turn resends the same history: every block of the first prompt is shared.
        more = [*messages, {"role": "user", "content": "now run the tests"}]
        body = {"model": "m", "messages": more, "tools": tools}
        assert (await r.client.post("/v1/chat/completions", json=body)).status == 200
        first, second = (p.block_hashes for p in r.dispatcher.seen)
        shared = (len(text) - len("<|assistant|>\n")) // PAGE  # pages before the reply header
        assert shared > 50
        assert second[:shared] == first[:shared]

    run_router(test)


def test_load_tokenizer_falls_back_to_bytes(tmp_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert logs[0]["log_level"] == "warning"
    tok = load_tokenizer(_tiny_tokenizer(tmp_path / "t.json"))
    assert tok.name == "hf:t.json"


def _tiny_tokenizer(path: Path) -> Path:
    words = ["[UNK]", "<|", "|>", "user", "assistant", "end", "hello", "world", "again"]
    raw = HfRaw(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.save(str(path))
    return path


def test_hf_tokenizer_from_a_tokenizer_json(tmp_path: Path) -> None:
    tok = HfTokenizer.from_file(_tiny_tokenizer(tmp_path / "tokenizer.json"))
    assert tok.name == "hf:tokenizer.json"
    assert tok.encode("hello world again zebra") == [6, 7, 8, 0]
    # <| user |> hello world <| end |> <| assistant |>
    assert encode_chat(tok, [ChatMessage("user", "hello world")]) == [
        1,
        3,
        2,
        6,
        7,
        1,
        5,
        2,
        1,
        4,
        2,
    ]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TokenizerLoadError, match=r"bad\.json"):
        HfTokenizer.from_file(tmp_path / "bad.json")


def test_app_with_hf_tokenizer_sends_its_ids(tmp_path: Path) -> None:
    tok = HfTokenizer.from_file(_tiny_tokenizer(tmp_path / "tokenizer.json"))

    async def test(r: Router) -> None:
        resp = await r.client.post("/v1/completions", json={"model": "m", "prompt": "hello " * 9})
        assert resp.status == 200
        assert (await resp.json())["usage"]["prompt_tokens"] == 9
        assert list(r.dispatcher.seen[0].token_ids) == [6] * 9
        assert list(r.dispatcher.seen[0].block_hashes) == block_hashes([6] * 9, PAGE)
        assert (await (await r.client.get("/health")).json())["tokenizer"] == "hf:tokenizer.json"

    run_router(test, tokenizer=tok)


# -- config ------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="router", description=config.DESCRIPTION)
    config.add_arguments(p)
    return p


def test_config_from_flags() -> None:
    args = _parser().parse_args(
        [
            *("--engines", "localhost:30000", "10.0.0.2:30001", "--port", "9000"),
            *("--model", "llama", "--page-size", "64", "--branch-ttl", "60"),
        ]
    )
    c = config.RouterConfig.from_args(args)
    assert c.engines == (
        config.EngineSpec("localhost:30000"),
        config.EngineSpec("10.0.0.2:30001"),
    )
    assert (c.host, c.port, c.models, c.page_size, c.branch_ttl) == (
        "127.0.0.1",
        9000,
        ("llama",),
        64,
        60.0,
    )
    assert c.tokenizer is None
    assert c.max_body_bytes == config.DEFAULT_MAX_BODY_MIB * 2**20
    help_text = _parser().format_help()
    for option in ("--engines", "--tokenizer", "--page-size", "--branch-ttl", "--max-body-mib"):
        assert option in help_text


def test_config_from_toml_with_flags_overriding(tmp_path: Path) -> None:
    toml = tmp_path / "router.toml"
    toml.write_text(
        'engines = ["a:1", "b:2"]\nport = 8100\ntokenizer = "tok/tokenizer.json"\n'
        'page-size = 32\nlog-level = "debug"\n'
    )
    p = _parser()
    p.set_defaults(**config_defaults(p, toml))
    c = config.RouterConfig.from_args(p.parse_args(["--port", "8200"]))
    assert [e.address for e in c.engines] == ["a:1", "b:2"]
    assert c.port == 8200  # the flag wins over the file
    assert c.page_size == 32
    assert c.log_level == "debug"
    assert c.tokenizer == tmp_path / "tok" / "tokenizer.json"  # relative to the file


@pytest.mark.parametrize("spec", ["nohost", "http://a:1", ":80", "a:x", "a:99999"])
def test_config_rejects_bad_engines(spec: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        config.engine_spec(spec)


def test_config_needs_distinct_engines() -> None:
    with pytest.raises(config.RouterConfigError, match="at least one"):
        config.RouterConfig.from_args(_parser().parse_args([]))
    args = _parser().parse_args(["--engines", "a:1", "a:1"])
    with pytest.raises(config.RouterConfigError, match="distinct"):
        config.RouterConfig.from_args(args)


def test_json_logging_renders_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    from evolving_infra.router.app import configure_json_logging

    old = structlog.get_config()
    try:
        configure_json_logging("info")
        structlog.get_logger("t").info("hello", n=1)
        structlog.get_logger("t").debug("hidden")
    finally:
        structlog.configure(**old)
    [line] = capsys.readouterr().err.splitlines()
    record = json.loads(line)
    assert record["event"] == "hello"
    assert record["n"] == 1
    assert record["level"] == "info"


def test_planner_options_from_flags_and_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    toml = tmp_path / "router.toml"
    toml.write_text('engines = ["a:1", "b:2"]\nplanner-option = ["min_gain=0.04", "slices=20"]\n')
    p = _parser()
    p.set_defaults(**config_defaults(p, toml))
    c = config.RouterConfig.from_args(p.parse_args([]))
    assert c.planner_options == (("min_gain", 0.04), ("slices", 20))
    flags = ["--engines", "a:1", "b:2", "--planner-option", "window_s=1200"]
    assert config.RouterConfig.from_args(_parser().parse_args(flags)).planner_options == (
        ("window_s", 1200.0),
    )
    with pytest.raises(SystemExit):  # the router's interval is --planner-interval
        _parser().parse_args(["--planner-option", "interval=5"])
    assert "use --planner-interval" in capsys.readouterr().err
    bad = _parser().parse_args(["--engines", "a:1", "b:2", "--planner-option", "alpha=1.5"])
    with pytest.raises(config.RouterConfigError, match=r"planner-option.*alpha"):
        config.RouterConfig.from_args(bad)
    toml.write_text('engines = ["a:1"]\nplanner-option = ["nope=1"]\n')
    with pytest.raises(ConfigError, match="planner-option: unknown planner option 'nope'"):
        config_defaults(_parser(), toml)
