"""Fields that change a result reach what acts on them, or are a 400 naming them (PRODUCT §7a):
image parts, tool-call messages, structured output, `include_stop_str_in_output`, `stream_options` usage, the vLLM
text extras. The detokenizer's side of `no_stop_trim` runs through the real stack in
tests/e2e/test_openai_client_e2e.py."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.timeout(30)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "hi", "max_tokens": 4}
# The process's first grammar imports xgrammar (and torch under it) in the tokenizer: seconds on a busy CI machine.
GRAMMAR_TIMEOUT_S = 25.0
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.mark.parametrize("part", [IMAGE, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])
async def test_a_content_part_that_is_not_text_is_a_400_naming_it(url, backend, part):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "what is"}, part]}]
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/chat/completions", json=CHAT | {"messages": messages})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[1].content[1].type" and part["type"] in error["message"]
    assert backend.requests == []


async def test_text_parts_are_joined_in_order(url, backend, text_model):
    parts = [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}]
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/chat/completions", json=CHAT | {"messages": [{"role": "user", "content": parts}]})
    assert response.status_code == 200, response.text
    sent = text_model.decode(list(backend.requests[-1].input_ids.data.cast("i")), skip_special_tokens=False)
    assert "user\none two<|im_end|>" in sent


async def test_a_message_carrying_tool_calls_is_a_400_naming_it(url, backend):
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": call}]
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/chat/completions", json=CHAT | {"messages": messages})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[1].tool_calls"


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("keep", [True, False])
async def test_include_stop_str_in_output_and_special_token_spacing_reach_the_detokenizer(url, backend, path, body, keep):
    extra = {"stop": ["world"], "include_stop_str_in_output": keep, "spaces_between_special_tokens": not keep}
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post(path, json=body | extra)
    assert response.status_code == 200, response.text
    params = backend.registrations[-1].params
    assert params.stop == ("world",) and params.no_stop_trim is keep and params.spaces_between_special_tokens is not keep


def sse_chunks(text: str) -> list[dict]:
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(url, backend, path, body):
    options = {"include_usage": True, "continuous_usage_stats": True}
    async with httpx.AsyncClient(base_url=url) as client:
        streamed = await client.post(path, json=body | {"stream": True, "stream_options": options})
        plain = await client.post(path, json=body | {"stream": True})
    chunks = sse_chunks(streamed.text)
    assert all("usage" in chunk for chunk in chunks), chunks
    completion = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert completion == sorted(completion) and completion[-1] == 4
    assert {chunk["usage"]["prompt_tokens"] for chunk in chunks} == {chunks[-1]["usage"]["prompt_tokens"]}
    assert chunks[-1]["choices"] == [] and chunks[-2]["usage"] == chunks[-1]["usage"]  # the last token's chunk has it all
    assert not any("usage" in chunk for chunk in sse_chunks(plain.text))


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", CHAT | {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
        ("/v1/completions", COMPLETION | {"vllm_xargs": {"k": 1}}, "vllm_xargs"),
        ("/generate", {"text": "hi", "sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
        ("/generate", {"text": "hi", "audio_data": "x"}, "audio_data"),
    ],
)
async def test_more_result_changing_extras_are_refused_by_name(url, backend, path, body, param):
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post(path, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


async def test_false_is_a_neutral_value_of_an_unsupported_flag(url, backend):
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/chat/completions", json=CHAT | {"return_token_ids": False, "echo": False})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path, body, kind, text", [
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "regex": "[ab]+"}}, "REGEX", "[ab]+"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "ebnf": 'root ::= "a"'}}, "EBNF", 'root ::= "a"'),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, "json_schema": '{"type": "integer"}'}}, "JSON_SCHEMA",
     '{"type":"integer"}'),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_object"}}, "JSON_OBJECT", ""),
    ("/v1/completions", COMPLETION | {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "boolean"}}}},
     "JSON_SCHEMA", '{"type":"boolean"}'),
])  # fmt: skip
async def test_structured_output_reaches_the_scheduler_as_a_grammar(url, backend, path, body, kind, text):
    async with httpx.AsyncClient(base_url=url, timeout=GRAMMAR_TIMEOUT_S) as client:
        response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    grammar = backend.requests[-1].sampling.grammar
    assert grammar.kind.name == kind and grammar.text == text


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
BROKEN_TOOL = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object", "properties": {"n": {"type": "int"}}}}}


@pytest.mark.parametrize("path, body, param, reason", [
    ("/generate", {"text": "hi", "sampling_params": {"ebnf": 'root ::= ("unclosed"'}}, "sampling_params.ebnf", "EBNF parser error"),
    ("/generate", {"text": "hi", "stream": True, "sampling_params": {"regex": "(?<=a)b"}}, "sampling_params.regex",
     "Lookbehind"),  # Python's `re` takes it; xgrammar does not
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": '{"type": "foo"}'}}, "sampling_params.json_schema", "foo"),
    ("/v1/chat/completions", CHAT | {"stream": True, "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}, "response_format.json_schema.schema", "minimum"),
    ("/v1/completions", COMPLETION | {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": []}}}},
     "response_format.json_schema.schema", "enum"),
    ("/v1/chat/completions", CHAT | {"tools": [WEATHER, BROKEN_TOOL], "tool_choice": "required"}, "tools[1].function.parameters", "int"),
])  # fmt: skip
async def test_a_grammar_that_does_not_compile_is_a_400_naming_its_field(url, backend, path, body, param, reason):
    """Refused before it is admitted (xgrammar parses it here), streamed or not: never a 200 that ends in abort."""
    async with httpx.AsyncClient(base_url=url, timeout=GRAMMAR_TIMEOUT_S) as client:
        response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(f"{param}: does not compile: ") and reason in error["message"], error
    assert backend.requests == []
