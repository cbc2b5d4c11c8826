"""Structured output and tools -> the `Grammar` the scheduler enforces.

OpenAI's `response_format` and `tools` / `tool_choice` (/v1/chat/completions, /v1/completions),
and SGLang's sampling params `json_schema`, `regex` and `ebnf` (/generate, `generate_grammar`).
Shapes are checked here, and every grammar is parsed by xgrammar before the request is admitted
(`compiles`): a bad schema, regex or EBNF is a 400 naming the field. Where xgrammar is not
installed (the torch-free front-end image) the scheduler's compile (`scheduler/grammar.py`) is the
only check, and its refusal fails the request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from contracts.limits import MAX_GRAMMAR_CHARS
from contracts.scheduler import Grammar, GrammarKind
from services.common.grammars import parse_failure
from services.tokenizer.api_types import ChatBody, CompletionBody, GenerateBody, NamedToolChoice, ResponseFormat, SamplingParamsBody, Tool
from services.tokenizer.invalid import require
from services.tokenizer.tools import forced_grammar, tool_format

MAX_TOOLS = 128


def compiles(grammar: Grammar, param: str) -> Grammar:
    """`grammar`, once xgrammar has parsed it; else a 400 naming `param` with xgrammar's reason."""
    failure = parse_failure(grammar)
    require(failure is None, failure or "", param)
    return grammar


def asks_for_grammar(body: msgspec.Struct) -> bool:
    """Whether a request body may bring a grammar: `compiles` parses it with xgrammar, which the
    process's first grammar imports (seconds), so such a body is prepared off the event loop."""
    if isinstance(body, GenerateBody):
        sampling = body.sampling_params
        return sampling is not None and any(getattr(sampling, name) is not None for name in ("json_schema", "regex", "ebnf"))
    if isinstance(body, ChatBody) and body.tool_choice not in (None, "none", "auto"):
        return True
    return isinstance(body, CompletionBody | ChatBody) and body.response_format is not None


def _sized(text: str, param: str) -> str:
    require(0 < len(text) <= MAX_GRAMMAR_CHARS, f"1 to {MAX_GRAMMAR_CHARS} characters", param)
    return text


def schema_text(schema: Any, param: str) -> str:
    """A JSON Schema (a JSON object, or its text) as compact text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            require(False, f"is not valid JSON: {exc}", param)
    require(isinstance(schema, dict), "must be a JSON Schema object", param)
    return _sized(json.dumps(schema, ensure_ascii=False, separators=(",", ":")), param)


def generate_grammar(body: SamplingParamsBody, names: Mapping[str, str]) -> Grammar | None:
    """/generate's `json_schema`, `regex` or `ebnf` (at most one)."""
    given = [name for name in ("json_schema", "regex", "ebnf") if getattr(body, name) is not None]
    if not given:
        return None
    require(len(given) == 1, f"give at most one of json_schema, regex and ebnf (got {', '.join(given)})", names[given[-1]])
    name = given[0]
    if name == "json_schema":
        return compiles(Grammar(GrammarKind.JSON_SCHEMA, schema_text(body.json_schema, names[name])), names[name])
    if name == "regex":
        try:
            re.compile(body.regex)
        except re.error as exc:
            require(False, f"is not a regular expression: {exc}", names[name])
        return compiles(Grammar(GrammarKind.REGEX, _sized(body.regex, names[name])), names[name])
    return compiles(Grammar(GrammarKind.EBNF, _sized(body.ebnf, names[name])), names[name])


def response_format_grammar(response_format: ResponseFormat | None) -> Grammar | None:
    """OpenAI's `response_format`: text (none), json_object, json_schema."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return Grammar(GrammarKind.JSON_OBJECT)
    require(response_format.type == "json_schema", "type must be text, json_object or json_schema", "response_format.type")
    spec = response_format.json_schema
    require(spec is not None and spec.schema is not None, "json_schema.schema is required", "response_format.json_schema")
    param = "response_format.json_schema.schema"
    return compiles(Grammar(GrammarKind.JSON_SCHEMA, schema_text(spec.schema, param)), param)


@dataclass(frozen=True)
class ToolPlan:
    """A chat call's tools: what the template shows, the format read back, the forcing grammar."""

    tools: list[dict[str, Any]]  # OpenAI tool objects, as the chat template reads them
    format: str  # tools.HERMES or tools.LLAMA3
    grammar: Grammar | None  # `required` or a named function; None: `auto`
    max_calls: int | None = None  # 1 with `parallel_tool_calls: false`


def tool_plan(body: ChatBody, chat_template: str | None) -> ToolPlan | None:
    """None without tools or with `tool_choice: none` (then the model is not shown them)."""
    choice = body.tool_choice
    if not body.tools:
        require(choice in (None, "none", "auto"), "needs tools", "tool_choice")
        return None
    require(len(body.tools) <= MAX_TOOLS, f"at most {MAX_TOOLS} tools", "tools")
    for index, tool in enumerate(body.tools):
        require(tool.type == "function", "only function tools are supported", f"tools[{index}].type")
        params = tool.function.parameters
        require(params is None or isinstance(params, dict), "must be a JSON Schema object", f"tools[{index}].function.parameters")
    if choice == "none":
        return None
    tools = template_tools(body.tools)
    functions = [tool["function"] for tool in tools]
    fmt = tool_format(chat_template)
    max_calls = 1 if body.parallel_tool_calls is False else None
    if choice in (None, "auto"):
        return ToolPlan(tools, fmt, None, max_calls)
    if isinstance(choice, NamedToolChoice):
        named = [i for i, f in enumerate(functions) if f["name"] == choice.function.name]
        require(bool(named), f"no tool is named {choice.function.name!r}", "tool_choice.function.name")
        return ToolPlan(tools, fmt, _forced(functions, named, fmt), max_calls)
    require(choice == "required", "must be none, auto, required or a named function", "tool_choice")
    return ToolPlan(tools, fmt, _forced(functions, list(range(len(functions))), fmt), max_calls)


def _forced(functions: list[dict[str, Any]], indexes: list[int], fmt: str) -> Grammar:
    """One call of one of the functions at `indexes`, each one's call parsed by xgrammar first, so
    that a `parameters` schema it refuses is a 400 naming that tool."""
    for index in indexes:
        compiles(forced_grammar([functions[index]], fmt), f"tools[{index}].function.parameters")
    return forced_grammar([functions[index] for index in indexes], fmt)


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """OpenAI tool objects as chat templates read them (unset fields left out, as clients send them)."""
    return [{"type": "function", "function": _function(tool.function)} for tool in tools]


def _function(function) -> dict[str, Any]:
    found = {"name": function.name}
    if function.description is not None:
        found["description"] = function.description
    if function.parameters is not None:
        found["parameters"] = function.parameters
    return found
