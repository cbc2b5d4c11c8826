"""Chat templates rendered as Hugging Face's `apply_chat_template` renders them.

The same jinja2 set-up (sandboxed, `trim_blocks`, `lstrip_blocks`, loop controls, the
`{% generation %}` block), the same globals (`raise_exception`, `strftime_now`), the same
`tojson` (no HTML escaping, non-ASCII kept), the tokenizer's special tokens as variables
(`bos_token`, `eos_token`, ...) and the same render arguments (`messages`, `tools`,
`documents`, `add_generation_prompt`, extra template kwargs). `continue_final_message` cuts
the rendering right after the last message's content, so the model continues it.

Compiled once per model; a template that fails (its own `raise_exception`, or a jinja error)
raises `ChatTemplateError` with the template's message, which the API turns into a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

RENDER_ARGUMENTS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation or failed to render; the message is the template's."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; when
    rendering a prompt it is just its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def special_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """`bos_token`, `eos_token`, ... as strings (tokenizer_config.json may store `{"content": ...}`);
    unset ones are left out, so the template sees them undefined, as in transformers."""
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = tokenizer_config.get(key)
        value = value.get("content") if isinstance(value, Mapping) else value
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def template_source(tokenizer_config: Mapping[str, Any]) -> str | None:
    """The `chat_template` string; a list of named templates gives its "default" one."""
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):
        named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, Mapping)}
        source = named.get("default")
    return source if isinstance(source, str) and source else None


class ChatTemplate:
    def __init__(self, source: str, tokens: Mapping[str, str]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from None
        self._tokens = dict(tokens)

    def render(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
        continue_final_message: bool = False, tools: Sequence[Any] | None = None,
        documents: Sequence[Any] | None = None, extra: Mapping[str, Any] | None = None,
    ) -> str:  # fmt: skip
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be true")
        clash = RENDER_ARGUMENTS & set(extra or {})
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(sorted(clash))}")
        variables = {**self._tokens, **(extra or {})}
        try:
            text = self._template.render(
                messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                **variables,
            )  # fmt: skip
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from None
        return _cut_after_final_message(text, messages) if continue_final_message else text


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """The rendering up to the end of the last message's content (which may have lost its
    surrounding whitespace to the template)."""
    final = _text_of(messages[-1].get("content")) if messages else ""
    stripped = final.strip()
    if not stripped or stripped not in text:
        raise ChatTemplateError("continue_final_message: the last message's content does not appear in the rendering")
    start = text.rindex(stripped)
    kept = final.lstrip()
    if text[start : start + len(kept)] == kept:
        return text[: start + len(kept)]
    return text[: start + len(stripped)]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if isinstance(part, Mapping) and part.get("type") == "text"]
        return texts[-1] if texts else ""
    return ""
