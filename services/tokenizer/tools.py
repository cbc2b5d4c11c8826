"""Tool calls (OpenAI `tools` / `tool_choice`): the call formats models write, read back from text.

Two formats, picked from the model's chat template (what the model was trained to write):

- **Hermes / Qwen**: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number,
  after optional content.
- **Llama 3 JSON**: the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `;`.

`required` and a named function are forced by a grammar (`forced_grammar`): one call of one of the
allowed functions, its arguments valid under the function's `parameters` schema, in the format's
markers. `auto` leaves the model free and parses what it writes; `none` sends no tools.

`CallReader` reads a choice's text as it streams: content goes out as soon as it cannot be the
start of a call, a call goes out whole once its closing marker (or the end) is seen. A whole
response is read by the same reader fed once.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from contracts.scheduler import Grammar, GrammarKind

HERMES, LLAMA3 = "hermes", "llama3"
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def tool_format(chat_template: str | None) -> str:
    """The format the model's chat template teaches: Llama 3's where the template speaks of
    `<|python_tag|>` or `ipython` without `<tool_call>`, else Hermes (Qwen, Hermes, Mistral-likes)."""
    source = chat_template or ""
    if HERMES_START not in source and (PYTHON_TAG in source or "ipython" in source):
        return LLAMA3
    return HERMES


def _call_schema(function: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
        "required": ["name", arguments_key],
    }


def forced_grammar(functions: list[dict[str, Any]], fmt: str) -> Grammar:
    """One call of one of `functions` (OpenAI function objects), in `fmt`'s markers."""
    key = "arguments" if fmt == HERMES else "parameters"
    calls = [_call_schema(f, key) for f in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if fmt == HERMES:
        return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema), prefix=HERMES_START + "\n", suffix="\n" + HERMES_END)
    return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema))


def openai_call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def _parsed_call(text: str) -> dict[str, Any] | None:
    """A call object (`name` and `arguments` or `parameters`) as OpenAI's tool call; None if not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return openai_call(value["name"], arguments)


@dataclass
class Read:
    """What one piece of text adds: content to send, and the calls completed by it."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


class CallReader:
    """Content and tool calls out of a choice's text, fed in pieces (`feed`, then `finish`)."""

    def __init__(self, fmt: str, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls  # calls past it are dropped (`parallel_tool_calls: false`)
        self._held = ""  # text not sent yet: a possible or open call
        self._in_call = False
        self.num_calls = 0
        self._decided = fmt == HERMES  # Llama 3: whether the answer is calls, known at its first character

    def feed(self, text: str) -> Read:
        self._held += text
        return self._hermes() if self.fmt == HERMES else self._llama3()

    def finish(self) -> Read:
        """The rest at the end of the output: an unclosed call that parses is a call, else content."""
        held, self._held = self._held, ""
        read = Read()
        if self.fmt == LLAMA3 and self._in_call:
            read = _llama3_calls(held)
        elif self._in_call:
            call = _parsed_call(held[len(HERMES_START) :].strip())
            read = Read(calls=[call]) if call is not None else Read(content=held)
        else:
            read = Read(content=held)
        if self.num_calls and not read.content.strip():
            read.content = ""
        read.calls = read.calls[: self._room()]
        self.num_calls += len(read.calls)
        return read

    def _room(self) -> int | None:
        return None if self.max_calls is None else max(self.max_calls - self.num_calls, 0)

    def _hermes(self) -> Read:
        read = Read()
        while True:
            if not self._in_call:
                start = self._held.find(HERMES_START)
                if start < 0:
                    keep = _partial_suffix(self._held, HERMES_START)
                    read.content += self._sendable(self._held[: len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep :]
                    return read
                read.content += self._sendable(self._held[:start])
                self._held, self._in_call = self._held[start:], True
            end = self._held.find(HERMES_END)
            if end < 0:
                return read
            body, self._held, self._in_call = self._held[len(HERMES_START) : end], self._held[end + len(HERMES_END) :], False
            call = _parsed_call(body.strip())
            if call is None:
                read.content += HERMES_START + body + HERMES_END
            elif self._room() != 0:
                read.calls.append(call)
                self.num_calls += 1

    def _sendable(self, content: str) -> str:
        """Whitespace between calls is the format's, not content."""
        return "" if (self.num_calls or self._in_call) and not content.strip() else content

    def _llama3(self) -> Read:
        if not self._decided:
            stripped = self._held.lstrip()
            if not stripped or PYTHON_TAG.startswith(stripped):
                return Read()
            self._decided = True
            self._in_call = stripped.startswith(("{", PYTHON_TAG))
        if self._in_call:
            return Read()  # a call is read whole at the end
        held, self._held = self._held, ""
        return Read(content=held)


def _llama3_calls(text: str) -> Read:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, calls, position = json.JSONDecoder(), [], 0
    while position < len(body):
        try:
            value, end = decoder.raw_decode(body, position)
        except ValueError:
            return Read(content=text)
        call = _parsed_call(json.dumps(value))
        if call is None:
            return Read(content=text)
        calls.append(call)
        position = end
        while position < len(body) and body[position] in "; \n\t":
            position += 1
    return Read(calls=calls)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (it may be completed next)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
