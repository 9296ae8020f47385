"""Prompt -> token ids -> directory block hashes.

The router tokenizes every prompt itself because the directory names KV blocks by SGLang page
hashes of token ids (DESIGN §2): the router must know the ids to match a prompt against what the
engines hold. The ids computed here are also what the dispatcher sends to the engines (SGLang
`/generate` with `input_ids`), so the engines cache exactly the pages hashed here whatever the
tokenizer is: the hashes are right by construction, and a wrong tokenizer costs only quality.

Two tokenizers:
- `HfTokenizer`: a Hugging Face `tokenizer.json` (the `tokenizers` library). The file has no chat
  template (that lives in `tokenizer_config.json` as Jinja), so chat messages are rendered with
  `render_chat` below, a simple fixed format. It is NOT the model's own chat template: for real
  serving quality a model-specific renderer is still to come.
- `ByteTokenizer`: the fallback when no tokenizer file is given. Token ids are the prompt's UTF-8
  bytes (0..255), one token per byte. Block hashes stay consistent (same text, same blocks), so
  prefix matching and branch counts work; only token counts are ~4x those of a real tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import structlog
import tokenizers

from evolving_infra.router.api import ChatMessage

log = structlog.get_logger(__name__)


class Tokenizer(Protocol):
    @property
    def name(self) -> str:
        """What the tokenizer is, for logs and `/health`."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added."""


class TokenizerLoadError(ValueError):
    """A tokenizer file that cannot be loaded; the message names the file."""


class ByteTokenizer:
    """The documented fallback: one token per UTF-8 byte, ids 0..255."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HfTokenizer:
    """A `tokenizer.json` loaded with Hugging Face `tokenizers`."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, name: str) -> None:
        self._tokenizer = tokenizer
        self.name = name

    @classmethod
    def from_file(cls, path: Path | str) -> HfTokenizer:
        path = Path(path)
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for every failure
            raise TokenizerLoadError(f"{path}: not a tokenizer.json: {e}") from None
        return cls(tokenizer, f"hf:{path.name}")

    def encode(self, text: str) -> list[int]:
        # NOTE: no special tokens (BOS...): the rendered prompt is the whole input, and SGLang
        # adds none to `input_ids` either, so ids and pages stay identical on both sides.
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)


def load_tokenizer(path: Path | None) -> Tokenizer:
    """The tokenizer of `--tokenizer`: the file's, or the byte fallback (logged) when None."""
    if path is None:
        log.warning("no tokenizer file: prompts are tokenized as UTF-8 bytes (--tokenizer)")
        return ByteTokenizer()
    return HfTokenizer.from_file(path)


ASSISTANT_OPEN = "<|assistant|>\n"  # ends every chat prompt: the reply follows


def render_parts(messages: Sequence[ChatMessage], tools: str | None = None) -> list[str]:
    """Chat messages as prompt text, one part per message, in a fixed simple format (not the
    model's template).

    With `tools` (the request's tool definitions as JSON), the first part is `<|tools|>`, a
    newline, the JSON, `<|end|>` and a newline. Each message is `<|role|>` (with ` name=...` or
    ` tool_call_id=...` when given), a newline, its content, `tool_calls=<JSON>` on its own line
    when it has tool calls, then `<|end|>` and a newline. The prompt is the parts, then
    `ASSISTANT_OPEN` for the reply. Deterministic, so a branch that resends its history resends
    the same leading parts and hits the same blocks.
    """
    parts = [] if tools is None else [f"<|tools|>\n{tools}<|end|>\n"]
    for m in messages:
        header = m.role
        if m.name is not None:
            header += f" name={m.name}"
        if m.tool_call_id is not None:
            header += f" tool_call_id={m.tool_call_id}"
        body = m.content or ""
        if m.tool_calls is not None:
            body += f"\ntool_calls={m.tool_calls}"
        parts.append(f"<|{header}|>\n{body}<|end|>\n")
    return parts


def render_chat(messages: Sequence[ChatMessage], tools: str | None = None) -> str:
    """The whole prompt text of `render_parts`."""
    return "".join(render_parts(messages, tools)) + ASSISTANT_OPEN


def encode_chat(
    tokenizer: Tokenizer, messages: Sequence[ChatMessage], tools: str | None = None
) -> list[int]:
    """A chat prompt's token ids: each part's (`render_parts`), then `ASSISTANT_OPEN`'s.

    Tokenized part by part, not as one text, so that a message's ids never depend on the
    messages after it: an agent's next turn re-sends the same leading parts, whose ids the
    router then reuses instead of tokenizing them again (`turns.TurnCache`). Only a BPE merge
    across a message boundary is given up, where a model's own template puts special tokens.
    """
    ids: list[int] = []
    for part in render_parts(messages, tools):
        ids.extend(tokenizer.encode(part))
    ids.extend(assistant_ids(tokenizer))
    return ids


def assistant_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids of `ASSISTANT_OPEN`, which ends every chat prompt."""
    return tokenizer.encode(ASSISTANT_OPEN)
