"""Structured output and tools in the tokenizer: request fields -> grammars, and tool calls read
back from text, whole or streamed in any split."""

from __future__ import annotations

import json

import msgspec
import pytest

from contracts.scheduler import GrammarKind
from services.common import grammars
from services.tokenizer.api_types import ChatBody, GenerateBody, ResponseFormat, SamplingParamsBody
from services.tokenizer.invalid import InvalidRequest
from services.tokenizer.structured import asks_for_grammar, generate_grammar, response_format_grammar, tool_plan
from services.tokenizer.tools import HERMES, LLAMA3, CallReader, Read, tool_format, whole_calls
from services.tokenizer.validation import GENERATE_NAMES

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatBody:
    return msgspec.convert({"messages": MESSAGES} | fields, ChatBody)


def read_deltas(fmt: str, pieces: list[str], max_calls: int | None = None) -> list[Read]:
    reader = CallReader(fmt, max_calls)
    return [reader.feed(piece) for piece in pieces] + [reader.finish()]


def read_all(fmt: str, pieces: list[str], max_calls: int | None = None) -> tuple[str, list[dict]]:
    reads = read_deltas(fmt, pieces, max_calls)
    return "".join(read.content for read in reads), whole_calls([delta for read in reads for delta in read.calls])


HERMES_TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')  # fmt: skip


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hermes_calls_read_the_same_whole_or_streamed_in_any_split(size):
    pieces = [HERMES_TEXT[i : i + size] for i in range(0, len(HERMES_TEXT), size)]
    content, calls = read_all(HERMES, pieces)
    assert content == "Let me check. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]  # fmt: skip
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize("fmt, text, arguments", [
    (HERMES, HERMES_TEXT, '{"city": "Paris"}'),
    (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city":"Oslo", "q": "a}\\"{"}}; {"name": "get_time", "parameters": {}}',
     '{"city":"Oslo", "q": "a}\\"{"}'),
])  # fmt: skip
def test_calls_stream_as_a_head_then_argument_fragments_as_they_are_written(fmt, text, arguments):
    """OpenAI's stream shape: a call's first delta has its index, id, type and name; the next ones
    add fragments of its arguments, exactly as the model writes them (a brace in a string too)."""
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    deltas = [delta for read in read_deltas(fmt, pieces) for delta in read.calls]
    first = deltas[0]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"]["name"] == "get_weather"
    fragments = [d for d in deltas if d["index"] == 0][1:]
    assert len(fragments) > 3 and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in fragments)
    assert first["function"]["arguments"] + "".join(d["function"]["arguments"] for d in fragments) == arguments
    assert [d["index"] for d in deltas] == sorted(d["index"] for d in deltas)  # call 1 begins once call 0 has ended


def without_ids(read: tuple[str, list[dict]]) -> tuple[str, list[dict]]:
    return read[0], [{key: value for key, value in call.items() if key != "id"} for call in read[1]]


def test_a_call_is_the_same_whole_or_streamed_in_any_split_also_when_it_is_cut_short():
    cut = HERMES_TEXT[: HERMES_TEXT.index("Paris") + 2]  # max_tokens ended it inside the arguments
    texts = [(HERMES, t) for t in (HERMES_TEXT, cut, '<tool_call>{"arguments": {}, "name": "f"}</tool_call>', "<tool_call>{nope</tool_call>")]
    texts += [(LLAMA3, t) for t in ('{"name": "a", "parameters": {"x": [1, {"y": 2}]}}; {"parameters": {}, "name": "b"}', '{"name": "a", "par')]
    for fmt, text in texts:
        whole = without_ids(read_all(fmt, [text]))
        for size in (1, 2, 5):
            assert without_ids(read_all(fmt, [text[i : i + size] for i in range(0, len(text), size)])) == whole, (text, size)
    assert read_all(HERMES, [cut])[1][0]["function"]["arguments"] == '{"city": "Pa'


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = read_all(HERMES, [HERMES_TEXT], max_calls=1)
    assert content == "Let me check. " and [c["function"]["name"] for c in calls] == ["get_weather"]
    text = '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}'
    assert [c["function"]["name"] for c in read_all(LLAMA3, [text], max_calls=1)[1]] == ["a"]
    assert tool_plan(chat(tools=[WEATHER], parallel_tool_calls=False), "<tool_call>").max_calls == 1


def test_streamed_content_is_sent_as_soon_as_it_cannot_start_a_call():
    reader = CallReader(HERMES)
    assert reader.feed("Hello <tool").content == "Hello "  # "<tool" may begin a call: held
    assert reader.feed("box> there").content == "<toolbox> there"


def test_a_call_that_does_not_parse_is_content_and_an_unclosed_one_that_parses_is_a_call():
    assert read_all(HERMES, ["<tool_call>not json</tool_call> ok"]) == ("<tool_call>not json</tool_call> ok", [])
    content, calls = read_all(HERMES, ['<tool_call>\n{"name": "f", "arguments": {"a": 1}}'])
    assert content == "" and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_llama3_json_calls():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    content, calls = read_all(LLAMA3, [text[:5], text[5:]])
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert read_all(LLAMA3, ["Just ", "text."]) == ("Just text.", [])


def test_the_format_comes_from_the_chat_template():
    assert tool_format("... <tool_call> ...") == HERMES
    assert tool_format("{{ '<|python_tag|>' }} ipython") == LLAMA3
    assert tool_format(None) == HERMES


def test_required_and_named_force_a_call_auto_and_none_do_not():
    template = "<tool_call> tools"
    assert tool_plan(chat(tools=[WEATHER]), template).grammar is None  # auto
    assert tool_plan(chat(tools=[WEATHER], tool_choice="none"), template) is None
    required = tool_plan(chat(tools=[WEATHER, TIME], tool_choice="required"), template).grammar
    assert required.prefix == "<tool_call>\n" and required.suffix == "\n</tool_call>"
    assert [c["properties"]["name"]["const"] for c in json.loads(required.text)["anyOf"]] == ["get_weather", "get_time"]
    named = tool_plan(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                      "<|python_tag|>").grammar  # fmt: skip
    schema = json.loads(named.text)
    assert named.prefix == "" and schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["parameters"] == WEATHER["function"]["parameters"]


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])  # fmt: skip
def test_bad_tool_choices_are_400s_naming_the_field(fields, param):
    with pytest.raises(InvalidRequest) as refused:
        tool_plan(chat(**fields), "<tool_call>")
    assert refused.value.param == param


def test_response_formats():
    assert response_format_grammar(ResponseFormat(type="text")) is None
    assert response_format_grammar(ResponseFormat(type="json_object")).kind == GrammarKind.JSON_OBJECT
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = msgspec.convert({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, ResponseFormat)
    grammar = response_format_grammar(spec)
    assert grammar.kind == GrammarKind.JSON_SCHEMA and json.loads(grammar.text) == schema
    with pytest.raises(InvalidRequest) as refused:
        response_format_grammar(ResponseFormat(type="json_schema"))
    assert refused.value.param == "response_format.json_schema"


def test_generate_grammar_fields():
    assert generate_grammar(SamplingParamsBody(), GENERATE_NAMES) is None
    assert generate_grammar(SamplingParamsBody(regex=r"\d+"), GENERATE_NAMES).text == r"\d+"
    assert generate_grammar(SamplingParamsBody(ebnf='root ::= "a"'), GENERATE_NAMES).kind == GrammarKind.EBNF
    assert json.loads(generate_grammar(SamplingParamsBody(json_schema='{"type": "integer"}'), GENERATE_NAMES).text) == {"type": "integer"}
    for body, param in [(SamplingParamsBody(json_schema="{nope"), "json_schema"), (SamplingParamsBody(json_schema="[1]"), "json_schema"),
                        (SamplingParamsBody(regex="a", ebnf="b"), "ebnf"), (SamplingParamsBody(regex=""), "regex")]:  # fmt: skip
        with pytest.raises(InvalidRequest) as refused:
            generate_grammar(body, GENERATE_NAMES)
        assert refused.value.param == f"sampling_params.{param}"


def test_a_grammar_xgrammar_refuses_is_a_400_with_its_reason_and_without_xgrammar_the_scheduler_decides(monkeypatch):
    bad = SamplingParamsBody(ebnf='root ::= "a" | b')
    with pytest.raises(InvalidRequest) as refused:
        generate_grammar(bad, GENERATE_NAMES)
    assert refused.value.param == "sampling_params.ebnf"
    message = refused.value.message  # xgrammar's words, without where in its C++ they were raised
    assert message.startswith("does not compile: EBNF parser error at line 1") and message.endswith('Rule "b" is not defined')
    monkeypatch.setattr(grammars, "xgrammar_installed", lambda: False)  # the torch-free front-end image
    assert generate_grammar(bad, GENERATE_NAMES).text == 'root ::= "a" | b'


def test_only_bodies_that_may_bring_a_grammar_are_prepared_off_the_loop():
    assert asks_for_grammar(msgspec.convert({"text": "x", "sampling_params": {"regex": "a"}}, GenerateBody))
    assert not asks_for_grammar(msgspec.convert({"text": "x", "sampling_params": {"temperature": 0}}, GenerateBody))
    assert asks_for_grammar(chat(tools=[WEATHER], tool_choice="required"))
    assert asks_for_grammar(chat(response_format={"type": "json_object"}))
    assert not asks_for_grammar(chat(tools=[WEATHER], tool_choice="auto"))


def test_an_output_that_ends_inside_the_arguments_keeps_what_was_held_back_as_its_last_fragment():
    reader = CallReader(HERMES)
    reader.feed('<tool_call>\n{"name": "f", "arguments": {"a": "x"')
    assert reader.feed(" <").calls == [{"index": 0, "function": {"arguments": " "}}]  # "<" may begin "</tool_call>": held
    assert reader.finish() == Read("", [{"index": 0, "function": {"arguments": "<"}}])
