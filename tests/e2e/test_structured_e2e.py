"""Structured output and tools through the whole stack on the bundled trained pair (issue 41).

Two stacks on the same target, one with DSpark. 50 generated JSON schemas and 20 regexes are sent
to both, through /generate (json_schema, regex), /v1/chat/completions and /v1/completions
(response_format), streamed and not, sampled with seeds (varied answers) and greedy: every answer
validates (`jsonschema`, `re.fullmatch`), and greedy DSpark answers equal greedy plain ones. Then
the official `openai` client runs the tool-call flow (request -> tool_calls -> tool result ->
answer) with the bundled chat template, streamed and not, for `required`, a named function and
`auto`, and its stream accumulator rebuilds the whole answer from the streamed tool-call fragments.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from e2e.stack import Stack, plain_and_dspark_stacks

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["def parse(config):", "Return the result as JSON:", "import json\n\nvalue ="]
MAX_TOKENS = 160  # above the longest answer any of the generated schemas allows (its bytes)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory) -> Iterator[tuple[Stack, Stack]]:
    yield from plain_and_dspark_stacks(tmp_path_factory)


# ---- 50 schemas and 20 regexes, generated (seeded); every answer they allow is short ----


def _value_schema(rng: random.Random, depth: int) -> dict:
    kinds = ["integer", "boolean", "enum", "string", "number", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x", "yes", "no", "42"], rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(1, 6)}
    if kind == "array":
        return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": rng.randint(0, 3)}
    return _object_schema(rng, depth + 1)


def _object_schema(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["id", "name", "ok", "count", "tags", "kind", "score", "meta"], rng.randint(1, 3))
    properties = {name: _value_schema(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required}


def schemas() -> list[dict]:
    rng = random.Random(41)
    return [_object_schema(rng) if i % 5 else _value_schema(rng, 1) for i in range(50)]


def regexes() -> list[str]:
    rng = random.Random(7)
    atoms = [r"[a-z]{1,4}", r"\d{1,3}", r"(yes|no)", r"[A-F0-9]{2}", r"-", r"\.", r"(ab|cd)?", r"x{2}", r"[_a-z][_a-z0-9]{0,5}"]
    return [r"".join(rng.choice(atoms) for _ in range(rng.randint(1, 4))) for _ in range(20)]


# ---- one request, through one of the APIs, streamed or not -> its text ----


def _sse(response: httpx.Response) -> list[dict]:
    events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", response.text[-500:]
    return [json.loads(event) for event in events[:-1]]


def _generate(client: httpx.Client, grammar: dict, prompt: str, sampling: dict, stream: bool) -> tuple[str, str]:
    body = {"text": prompt, "stream": stream, "sampling_params": {"max_new_tokens": MAX_TOKENS, **sampling, **grammar}}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    last = _sse(response)[-1] if stream else response.json()
    return last["text"], last["meta_info"]["finish_reason"]["type"]


def _openai(client: httpx.Client, chat: bool, schema: dict, prompt: str, sampling: dict, stream: bool) -> tuple[str, str]:
    body = {**sampling, "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    return _openai_body(client, body, chat, stream)


def _openai_body(client: httpx.Client, body: dict, chat: bool, stream: bool) -> tuple[str, str]:
    body = {"max_tokens": MAX_TOKENS, "stream": stream, **body}
    response = client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        choice = response.json()["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), choice["finish_reason"]
    chunks = [chunk["choices"][0] for chunk in _sse(response) if chunk["choices"]]
    text = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in chunks)
    return text, chunks[-1]["finish_reason"]


def _cases() -> list[tuple[str, object, int]]:
    """(kind, schema or regex, route): each schema and regex once sampled, some greedy too."""
    cases = [("schema", schema, i) for i, schema in enumerate(schemas())]
    cases += [("regex", regex, i) for i, regex in enumerate(regexes())]
    return cases


def _ask(client: httpx.Client, case: tuple[str, object, int], greedy: bool) -> tuple[str, str]:
    kind, grammar, i = case
    sampling = {"temperature": 0} if greedy else {"temperature": 1.0, "seed": 1000 + i}
    prompt, stream = PROMPTS[i % len(PROMPTS)], i % 2 == 1
    if kind == "regex":
        return _generate(client, {"regex": grammar}, prompt, sampling, stream)
    route = i % 3
    if route == 0:
        return _generate(client, {"json_schema": json.dumps(grammar)}, prompt, sampling, stream)
    openai_sampling = {"temperature": sampling["temperature"], **({"seed": sampling["seed"]} if "seed" in sampling else {})}
    return _openai(client, route == 1, grammar, prompt, openai_sampling, stream)


def _valid(case: tuple[str, object, int], text: str) -> None:
    kind, grammar, _ = case
    if kind == "regex":
        assert re.fullmatch(grammar, text), (grammar, text)
    else:
        jsonschema.validate(json.loads(text), grammar)


def _run_all(stack: Stack, greedy: bool) -> list[tuple[str, str]]:
    with httpx.Client(base_url=stack.base_url, timeout=240) as client, ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda case: _ask(client, case, greedy), _cases()))


@pytest.fixture(scope="module")
def answers(stacks) -> dict[tuple[str, bool], list[tuple[str, str]]]:
    plain, spec = stacks
    return {(name, greedy): _run_all(stack, greedy) for name, stack in (("plain", plain), ("dspark", spec))
            for greedy in (False, True)}  # fmt: skip


@pytest.mark.parametrize("name", ["plain", "dspark"])
@pytest.mark.parametrize("greedy", [False, True])
def test_every_answer_validates_against_its_schema_or_regex(answers, name, greedy):
    for case, (text, finish) in zip(_cases(), answers[name, greedy], strict=True):
        assert finish in ("stop", "eos"), (case, text, finish)  # the grammar completed, well inside max_tokens
        _valid(case, text)


def test_greedy_dspark_equals_greedy_plain_under_the_same_grammar(answers):
    assert answers["dspark", True] == answers["plain", True]


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_answers_are_json_objects(stacks, stream):
    with httpx.Client(base_url=stacks[1].base_url, timeout=60) as client:
        for seed in range(3):
            body = {"messages": [{"role": "user", "content": "Give me a JSON object"}], "temperature": 1.0, "seed": seed,
                    "response_format": {"type": "json_object"}}  # fmt: skip
            text, finish = _openai_body(client, body, chat=True, stream=stream)
            assert finish == "stop" and isinstance(json.loads(text), dict), text


def test_a_grammar_that_does_not_compile_is_a_400_before_it_is_admitted(stacks, oai):
    body = {"text": "x", "sampling_params": {"ebnf": 'root ::= ("unclosed"'}}
    response = httpx.post(f"{stacks[0].base_url}/generate", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "sampling_params.ebnf", response.text
    assert "does not compile: EBNF parser error" in response.json()["error"]["message"]
    bad_regex = httpx.post(f"{stacks[0].base_url}/generate", json={"text": "x", "sampling_params": {"regex": "(a"}}, timeout=30)
    assert bad_regex.status_code == 400 and bad_regex.json()["error"]["param"] == "sampling_params.regex"
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            oai.chat.completions.create(model=oai.models.list().data[0].id, messages=QUESTION, stream=stream, max_tokens=8,
                                        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})  # fmt: skip
        assert refused.value.body["param"] == "response_format.json_schema.schema", refused.value.body


# ---- tools, with the official client ----

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]},
}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def oai(stacks) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=stacks[0].base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield client
    client.close()


def _create(oai: openai.OpenAI, stream: bool, **request):
    """The assistant's message as (content, tool calls as dicts, finish_reason), streamed or not."""
    model = oai.models.list().data[0].id
    if not stream:
        choice = oai.chat.completions.create(model=model, temperature=0, max_tokens=64, **request).choices[0]
        calls = [call.model_dump() for call in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in oai.chat.completions.create(model=model, temperature=0, max_tokens=64, stream=True, **request):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            entry["id"] = call.id or entry["id"]
            entry["function"]["name"] += call.function.name or ""
            entry["function"]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def _answer_after(oai: openai.OpenAI, stream: bool, calls: list[dict]) -> None:
    """The flow's second half: the tool's result goes back and the model answers in text."""
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": calls}]
    messages += [{"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C"} for call in calls]
    content, more_calls, finish = _create(oai, stream, messages=messages, tools=[WEATHER, TIME], tool_choice="none")
    assert isinstance(content, str) and content and more_calls == [] and finish in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_call_flow(oai, stream, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish = _create(oai, stream, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=tool_choice)
    assert finish == "tool_calls" and len(calls) == 1 and content is None
    call = calls[0]
    assert call["id"].startswith("call_") and call["type"] == "function"
    allowed = {"get_weather": WEATHER, "get_time": TIME} if choice == "required" else {"get_weather": WEATHER}
    assert call["function"]["name"] in allowed
    jsonschema.validate(json.loads(call["function"]["arguments"]), allowed[call["function"]["name"]]["function"]["parameters"])
    _answer_after(oai, stream, calls)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_flow(oai, stream):
    content, calls, finish = _create(oai, stream, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="auto")
    assert finish in ("stop", "length", "tool_calls")
    for call in calls:  # the small model rarely calls on its own; what it calls must parse
        json.loads(call["function"]["arguments"])
    assert calls or isinstance(content, str)
    earlier = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 7}'}}]
    _answer_after(oai, stream, earlier)


def _calls(choice) -> list[tuple[str, str, str]]:
    return [(call.type, call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]


@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_streamed_tool_calls_come_in_fragments_that_the_clients_accumulator_adds_up_to_the_whole_answer(oai, choice):
    """OpenAI's shape: a call's first delta carries its index, id, type and name, the next ones
    fragments of its arguments as they are generated; `openai`'s own stream accumulator rebuilds
    the non-streamed answer from them (ids aside)."""
    tool_choice = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}, "auto": "auto"}[choice]
    request = {"model": oai.models.list().data[0].id, "messages": QUESTION, "tools": [WEATHER, TIME],
               "tool_choice": tool_choice, "temperature": 0, "max_tokens": 64}  # fmt: skip
    whole = oai.chat.completions.create(**request).choices[0]
    state, deltas = ChatCompletionStreamState(), []
    for chunk in oai.chat.completions.create(stream=True, **request):
        state.handle_chunk(chunk)
        deltas += [call for streamed in chunk.choices for call in streamed.delta.tool_calls or []]
    streamed = state.current_completion_snapshot.choices[0]  # as accumulated (the final parse refuses a `length` answer)
    assert _calls(streamed) == _calls(whole) and streamed.finish_reason == whole.finish_reason
    assert (streamed.message.content or None) == whole.message.content
    if choice == "auto":
        return  # the small model rarely calls on its own: the answers agreeing is the point
    assert len(_calls(whole)) == 1 and whole.finish_reason == "tool_calls"
    head, fragments = deltas[0], deltas[1:]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function" and head.function.name == _calls(whole)[0][1]
    assert all(d.index == 0 and d.id is None and d.function.name is None and d.function.arguments for d in fragments)
    if choice == "named":  # get_weather's arguments (a city and a number of days) take several steps
        assert len(fragments) >= 3, deltas  # they arrive while they are generated, not in one piece at the end
