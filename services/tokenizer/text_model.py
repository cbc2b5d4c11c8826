"""The model's text side: `tokenizer.json`, the chat template and the limits from `config.json`.

Everything here is plain and synchronous, so it is tested without NATS or HTTP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from services.tokenizer.chat_template import ChatTemplate, ChatTemplateError, special_tokens, template_source


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte maps to one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass(frozen=True)
class TextModel:
    tokenizer: Tokenizer
    token_bytes: tuple[bytes, ...]  # [vocab] each id's raw UTF-8 bytes (special tokens: their content)
    special_ids: frozenset[int]
    vocab_size: int  # ids >= this are rejected
    max_model_len: int
    chat_template: str | None
    chat: ChatTemplate | None = None  # compiled `chat_template`, with the tokenizer's special tokens
    model_type: str = ""  # config.json's, as /get_model_info shows it
    architectures: tuple[str, ...] = ()

    @classmethod
    def from_dir(
        cls, model_dir: Path, max_model_len: int | None = None, tokenizer_dir: Path | None = None,
        chat_template: str | None = None,
    ) -> TextModel:
        """tokenizer_dir: the tokenizer's files from there (default model_dir); chat_template: this
        template's source instead of tokenizer_config.json's."""
        text_dir = tokenizer_dir or model_dir
        tokenizer = Tokenizer.from_file(str(text_dir / "tokenizer.json"))
        config = _read_json(model_dir / "config.json")
        tokenizer_config = _read_json(text_dir / "tokenizer_config.json")
        vocab_size = int(config.get("vocab_size") or tokenizer.get_vocab_size(with_added_tokens=True))
        limit = max_model_len or int(config.get("max_position_embeddings") or tokenizer_config.get("model_max_length") or 4096)
        special = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        source = chat_template or template_source(tokenizer_config)
        chat = ChatTemplate(source, special_tokens(tokenizer_config)) if source else None
        return cls(
            tokenizer, _token_bytes_table(tokenizer, vocab_size), special, vocab_size, limit, source, chat,
            model_type=str(config.get("model_type") or ""), architectures=tuple(config.get("architectures") or ()),
        )  # fmt: skip

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # `encode_batch` releases the GIL while it works (`encode` holds it), so a large prompt
        # tokenized in a worker thread leaves the event loop free.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def token_labels(self) -> tuple[str, ...]:
        """[vocab] each id as OpenAI's logprobs show a token: its text, or `bytes:\\xNN...` when its
        bytes are not valid UTF-8 on their own (a top-20 row looks up 20 of them per token). Built
        on first use; the server builds it at start-up (`warm_logprob_tables`), not in a request."""
        return tuple(map(_label, self.token_bytes))

    @cached_property
    def token_byte_lists(self) -> tuple[tuple[int, ...], ...]:
        """[vocab] each id's bytes as the integers of chat logprobs' `bytes` field (a JSON array)."""
        return tuple(map(tuple, self.token_bytes))

    def warm_logprob_tables(self) -> None:
        """Build `token_labels` and `token_byte_lists` now: a pass over every id of the vocabulary."""
        for table in ("token_labels", "token_byte_lists"):
            getattr(self, table)  # a cached_property: built on this first read

    def token_text(self, token_id: int) -> str:
        """One token shown on its own (partial UTF-8 shows as U+FFFD, as `decode([id])` does)."""
        return self.token_bytes[token_id].decode("utf-8", errors="replace")

    def out_of_vocab(self, ids: list[int]) -> int | None:
        """The first id outside [0, vocab_size), or None."""
        return next((i for i in ids if not 0 <= i < self.vocab_size), None)

    def render_chat(self, messages: list[dict[str, Any]], **options: Any) -> str:
        """The prompt text of a conversation, as `transformers`' `apply_chat_template` renders it
        (`options`: add_generation_prompt, continue_final_message, tools, documents, extra).
        Raises `ChatTemplateError` (a ValueError) with the template's message."""
        if self.chat is None:
            raise ChatTemplateError("this model has no chat_template")
        return self.chat.render(messages, **options)


def _label(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _token_bytes_table(tokenizer: Tokenizer, vocab_size: int) -> tuple[bytes, ...]:
    """Built once at start-up; ids past the tokenizer's vocabulary (model padding) are empty."""
    added = {i: t.content.encode() for i, t in tokenizer.get_added_tokens_decoder().items()}
    byte_level = json.loads(tokenizer.to_str()).get("decoder", {}) or {}
    inverse = {c: b for b, c in _bytes_to_unicode().items()} if byte_level.get("type") == "ByteLevel" else None
    table = []
    for token_id in range(vocab_size):
        piece = tokenizer.id_to_token(token_id)
        if token_id in added:
            table.append(added[token_id])
        elif piece is None:
            table.append(b"")
        elif inverse is not None:
            table.append(bytes(inverse[c] for c in piece))
        else:
            table.append(tokenizer.decode([token_id], skip_special_tokens=False).encode())
    return tuple(table)
