"""Tool calls (OpenAI `tools` / `tool_choice`): the call formats models write, read back from text.

Two formats, picked from the model's chat template (what the model was trained to write):

- **Hermes / Qwen**: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number,
  after optional content.
- **Llama 3 JSON**: the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `;`.

`required` and a named function are forced by a grammar (`forced_grammar`): one call of one of the
allowed functions, its arguments valid under the function's `parameters` schema, in the format's
markers. `auto` leaves the model free and parses what it writes; `none` sends no tools.

`CallReader` reads a choice's text as it streams, into OpenAI's stream deltas: content goes out as
soon as it cannot be the start of a call; a call goes out as soon as its head
(`{"name": "...", "arguments": ` or `"parameters": `) is read — its index, id, type and name —
then its arguments object as fragments, exactly as the model writes them, while they are generated.
A call whose head is written otherwise (keys in another order, ...) is read whole once its closing
marker (or the end) is seen, and is content if it does not parse. Every decision depends on the
text so far alone, never on how it was split, so a whole response (the same reader fed once, its
deltas merged by `whole_calls`) has the calls the stream's deltas add up to.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from contracts.scheduler import Grammar, GrammarKind

HERMES, LLAMA3 = "hermes", "llama3"
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HEAD = r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"%s"\s*:\s*(?=\{)'  # up to the arguments object's "{"
HERMES_HEAD = re.compile(_HEAD % "arguments")
LLAMA3_HEAD = re.compile(r"[\s;]*(?:<\|python_tag\|>)?" + _HEAD % "parameters")  # calls after the first follow a ";"


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


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parsed_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object (`name` and `arguments` or `parameters`); None if not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


@dataclass
class Read:
    """What one piece of text adds: content to send, and tool-call deltas in OpenAI's stream shape
    (a call's first: index, id, type, function name and arguments; its next: index and an arguments fragment)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: Read) -> Read:
        """Both reads as one, deltas of one call next to each other merged (one entry per call per chunk)."""
        merged = Read(self.content + other.content, [])
        for delta in self.calls + other.calls:
            last = merged.calls[-1] if merged.calls else None
            if last is not None and last["index"] == delta["index"]:
                last["function"] = last["function"] | {"arguments": last["function"]["arguments"] + delta["function"]["arguments"]}
            else:
                merged.calls.append(dict(delta))
        return merged


def whole_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool calls that stream deltas add up to (as OpenAI's accumulator rebuilds them)."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.get(delta["index"])
        if call is None:
            calls[delta["index"]] = {"id": delta["id"], "type": delta["type"], "function": dict(delta["function"])}
        else:
            call["function"]["arguments"] += delta["function"]["arguments"]
    return [calls[index] for index in sorted(calls)]


class _ArgumentsEnd:
    """Where a call's arguments object ends: a JSON scanner fed its text piece by piece."""

    def __init__(self, stop: str | None) -> None:
        self.stop = stop  # the call's closing marker: outside a string it ends the call, arguments complete or not
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> tuple[int, bool]:
        """(characters of `text` that are arguments, whether the object ended with them). Stops short
        of a closing marker, or of what may begin one."""
        for position, char in enumerate(text):
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (char == "\\", char != '"')
                continue
            if self.stop and char == self.stop[0] and (text.startswith(self.stop, position) or self.stop.startswith(text[position:])):
                return position, False
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return position + 1, True
        return len(text), False


OUTSIDE, UNDECIDED, CONTENT, HEAD, ARGUMENTS, TAIL = range(6)  # `CallReader`'s states


class CallReader:
    """Content and tool-call deltas out of a choice's text, fed in pieces (`feed`, then `finish`).

    Hermes: OUTSIDE (content) -> `<tool_call>` -> HEAD -> ARGUMENTS -> TAIL -> `</tool_call>` -> OUTSIDE.
    Llama 3: UNDECIDED -> CONTENT (plain text), or -> HEAD -> ARGUMENTS -> TAIL (the call's "}") -> HEAD ...
    """

    def __init__(self, fmt: str, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls  # calls past it are dropped (`parallel_tool_calls: false`)
        self.num_calls = 0
        self._held = ""  # text not read yet: a possible marker, an unfinished call head
        self._state = OUTSIDE if fmt == HERMES else UNDECIDED
        self._arguments = _ArgumentsEnd(None)
        self._index: int | None = None  # the open call's; None: dropped

    def feed(self, text: str) -> Read:
        self._held += text
        read = Read()
        while self._step(read):
            pass
        return Read().add(read)

    def finish(self) -> Read:
        """The rest at the end of the output: an unfinished call head that parses as a whole call is
        one, else content; an open call's arguments stay as far as they came."""
        read = self.feed("")
        held, self._held = self._held, ""
        if self._state == HEAD and self.fmt == HERMES:
            self._whole_hermes(read, held, closed=False)
        elif self._state == HEAD and held.strip(" \n\t;"):
            self._whole_llama3(read, held)
        elif self._state == ARGUMENTS:
            self._fragment(read, held)
        elif self._state in (OUTSIDE, UNDECIDED, CONTENT):
            read.content += held
        if self.num_calls and not read.content.strip():
            read.content = ""
        return Read().add(read)

    def _step(self, read: Read) -> bool:
        """Read what the held text decides; whether anything changed (then step again)."""
        if self._state == OUTSIDE:
            return self._outside(read)
        if self._state == UNDECIDED:
            return self._undecided()
        if self._state == CONTENT:
            read.content, self._held = read.content + self._held, ""
            return False
        if self._state == HEAD:
            return self._head(read)
        if self._state == ARGUMENTS:
            return self._read_arguments(read)
        return self._tail()

    def _outside(self, read: Read) -> bool:
        start = self._held.find(HERMES_START)
        if start < 0:
            keep = len(self._held) - _partial_suffix(self._held, HERMES_START)
            read.content += self._sendable(self._held[:keep])
            self._held = self._held[keep:]
            return False
        read.content += self._sendable(self._held[:start])
        self._held, self._state = self._held[start + len(HERMES_START) :], HEAD
        return True

    def _sendable(self, content: str) -> str:
        """Whitespace between calls is the format's, not content."""
        return "" if self.num_calls and not content.strip() else content

    def _undecided(self) -> bool:
        """Llama 3: whether the answer is calls, known at its first character."""
        stripped = self._held.lstrip()
        if not stripped or PYTHON_TAG.startswith(stripped):
            return False
        self._state = HEAD if stripped.startswith(("{", PYTHON_TAG)) else CONTENT
        return True

    def _head(self, read: Read) -> bool:
        match = (HERMES_HEAD if self.fmt == HERMES else LLAMA3_HEAD).match(self._held)
        if match is not None:
            self._open(read, json.loads(match.group(1)), "")
            self._held, self._state = self._held[match.end() :], ARGUMENTS
            self._arguments = _ArgumentsEnd(HERMES_END if self.fmt == HERMES else None)
            return True
        end = self._held.find(HERMES_END) if self.fmt == HERMES else -1
        if end < 0:
            return False
        body, self._held, self._state = self._held[:end], self._held[end + len(HERMES_END) :], OUTSIDE
        self._whole_hermes(read, body, closed=True)
        return True

    def _read_arguments(self, read: Read) -> bool:
        size, ended = self._arguments.scan(self._held)
        self._fragment(read, self._held[:size])
        self._held = self._held[size:]
        if ended:
            self._state = TAIL
            return True
        if self.fmt == HERMES and self._held.startswith(HERMES_END):  # the call closed before its arguments did
            self._held, self._state = self._held[len(HERMES_END) :], OUTSIDE
            return True
        return False

    def _tail(self) -> bool:
        """After the arguments: the rest of the call object, up to its end (Hermes: the closing marker)."""
        marker = HERMES_END if self.fmt == HERMES else "}"
        end = self._held.find(marker)
        if end < 0:
            self._held = self._held[len(self._held) - _partial_suffix(self._held, marker) :]
            return False
        self._held, self._state = self._held[end + len(marker) :], OUTSIDE if self.fmt == HERMES else HEAD
        return True

    def _open(self, read: Read, name: str, arguments: str) -> None:
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            self._index = None
            return
        self._index, self.num_calls = self.num_calls, self.num_calls + 1
        read.calls.append({"index": self._index, "id": _call_id(), "type": "function", "function": {"name": name, "arguments": arguments}})

    def _fragment(self, read: Read, text: str) -> None:
        if text and self._index is not None:
            read.calls.append({"index": self._index, "function": {"arguments": text}})

    def _whole_hermes(self, read: Read, body: str, closed: bool) -> None:
        """A call read whole (its head written otherwise); text that is not one stays content."""
        call = _parsed_call(body.strip())
        if call is None:
            read.content += HERMES_START + body + (HERMES_END if closed else "")
        else:
            self._open(read, *call)

    def _whole_llama3(self, read: Read, text: str) -> None:
        body = text.strip(" \n\t;").removeprefix(PYTHON_TAG).strip()
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except ValueError:
                read.content += text
                return
            call = _parsed_call(json.dumps(value))
            if call is None:
                read.content += text
                return
            calls.append(call)
            position = end
            while position < len(body) and body[position] in "; \n\t":
                position += 1
        for call in calls:
            self._open(read, *call)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (it may be completed next)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
