"""OpenAI-compatible endpoints: /v1/completions and /v1/chat/completions.

Each prompt x `n` becomes one `GenerationSpec`; a prompt's `n` choices are submitted together
(one scheduler request that forks them after one prefill), and the choices are assembled from
their results with `openai_format`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Request, post
from litestar.response import Response, Stream

from contracts.detokenizer import Finish, FinishType
from contracts.scheduler import Grammar
from services.common.metrics import finish_reason
from services.tokenizer.api_types import (
    ChatBody,
    ChatMessage,
    CompletionBody,
    SamplingParamsBody,
    StreamOptions,
    TokenizeBody,
)
from services.tokenizer.edge import request_id_of
from services.tokenizer.error_schema import ERROR_RESPONSES
from services.tokenizer.frontend import SSE_HEADERS, Frontend, merged_deltas, stream_then_abort
from services.tokenizer.logprobs_format import LogprobChunks
from services.tokenizer.native import SSE_DONE, GenerationResult, error_body, sse
from services.tokenizer.openai_format import (
    Positions,
    chat_content,
    completion_logprobs,
    output_positions,
    prompt_positions,
    visible_bytes,
)
from services.tokenizer.requests import Delta, RequestFailed
from services.tokenizer.structured import ToolPlan, response_format_grammar, template_tools, tool_plan
from services.tokenizer.tools import CallReader, Read
from services.tokenizer.text_model import TextModel
from services.tokenizer.validation import (
    GenerationSpec,
    InvalidRequest,
    LogprobRequest,
    check_logprobs,
    check_n,
    choice_sampling,
    check_prompt,
    check_sampling,
    check_text_size,
    refuse_unsupported,
    require,
    wire_rids,
)


class ModelNotFound(Exception):
    """The body names a model this server does not serve (HTTP 404)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.")
        self.name = name

SAMPLING_NAMES = {name: name for name in SamplingParamsBody.__struct_fields__} | {
    "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
}  # fmt: skip
COMPLETION_LOGPROB_NAMES = {"logprob_start_len": "echo", "top_logprobs_num": "logprobs", "token_ids_logprob": "logprobs"}
CHAT_LOGPROB_NAMES = {"logprob_start_len": "messages", "top_logprobs_num": "top_logprobs", "token_ids_logprob": "top_logprobs"}


@dataclass(frozen=True)
class Choice:
    spec: GenerationSpec
    prompt_text: str  # what `echo` returns


@dataclass(frozen=True)
class Plan:
    """One OpenAI call: its id, choices (prompt-major, then n) and output options."""

    id: str
    created: int
    model: str
    choices: list[Choice]
    echo: bool
    top_k: int | None  # None: no logprobs
    skip_special_tokens: bool
    tools: ToolPlan | None = None  # chat with tools: calls are read back from each choice's text


def finish_name(finish: Finish | None) -> str | None:
    return None if finish is None else finish_reason(finish.type)


def completion_prompts(
    prompt: str | list[Any], model: TextModel, add_special_tokens: bool = True
) -> list[tuple[tuple[int, ...], str]]:
    """(token ids, echo text) per prompt, for str, [str], [int] and [[int]] prompts."""
    for text in [prompt] if isinstance(prompt, str) else prompt:
        if isinstance(text, str):
            check_text_size(text, model, "prompt")
    if isinstance(prompt, str):
        return [(check_prompt(model.encode(prompt, add_special_tokens), model, "prompt"), prompt)]
    require(len(prompt) > 0, "the prompt is empty", "prompt")
    kinds = {type(item) for item in prompt}
    require(len(kinds) == 1, "mixes strings, token ids and lists of token ids", "prompt")
    if kinds == {str}:
        return [(check_prompt(model.encode(p, add_special_tokens), model, "prompt"), p) for p in prompt]
    rows = [prompt] if kinds == {int} else prompt
    return [(check_prompt(row, model, "prompt"), model.decode(row, skip_special_tokens=False)) for row in rows]


def _sampling_body(body: CompletionBody | ChatBody, max_tokens: int) -> SamplingParamsBody:
    return SamplingParamsBody(
        max_new_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        no_stop_trim=body.include_stop_str_in_output,
        seed=body.seed,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_new_tokens=body.min_tokens,
        logit_bias=body.logit_bias,
    )


def check_model(name: str | None, frontend: Frontend) -> None:
    """An unknown `model` is a 404 in OpenAI's shape (absent or empty: the served model)."""
    served = {frontend.config.model_name, str(frontend.config.model_dir)}
    if name and name not in served:
        raise ModelNotFound(name)


def _choices(
    prompts: list[tuple[tuple[int, ...], str]],
    body: CompletionBody | ChatBody,
    model: TextModel,
    request: LogprobRequest,
    names: dict[str, str],
    max_logprobs: int,
    max_tokens: int,
    request_id: str,
    grammar: Grammar | None = None,
) -> list[Choice]:
    check_n(body.n, len(prompts), "n")
    sampling_body = _sampling_body(body, max_tokens)
    sampling, detokenize = check_sampling(sampling_body, model, SAMPLING_NAMES)
    if grammar is not None:
        sampling = msgspec.structs.replace(sampling, grammar=grammar)
    rids = iter(wire_rids(request_id, len(prompts) * body.n))
    choices = []
    for ids, text in prompts:
        logprobs = check_logprobs(request, len(ids), model, max_logprobs, names)
        for j in range(body.n):
            seeded = choice_sampling(sampling, j)
            spec = GenerationSpec(next(rids), ids, seeded, logprobs, detokenize, body.stream, request_id=request_id)
            choices.append(Choice(spec, text))
    return choices


def completion_plan(body: CompletionBody, frontend: Frontend, request_id: str) -> Plan:
    check_model(body.model, frontend)
    refuse_unsupported(body, n=body.n)
    model, limit = frontend.model, frontend.config.max_logprobs
    require(body.logprobs is None or 0 <= body.logprobs <= limit, f"must be in [0, {limit}]", "logprobs")
    wants = body.logprobs is not None
    request = LogprobRequest(
        return_logprob=wants, logprob_start_len=0 if wants and body.echo else -1, top_logprobs_num=body.logprobs or 0
    )
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    prompts = completion_prompts(body.prompt, model, body.add_special_tokens)
    grammar = response_format_grammar(body.response_format)
    choices = _choices(prompts, body, model, request, COMPLETION_LOGPROB_NAMES, limit, max_tokens, request_id, grammar)
    name = frontend.config.model_name
    return Plan(f"cmpl-{request_id}", int(time.time()), name, choices, body.echo, body.logprobs, body.skip_special_tokens)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it. A part of a message's content that is not
    text is a 400 naming it, never dropped: the models served here read text alone."""
    require(len(messages) > 0, "needs at least one message", "messages")
    return [_template_message(message, f"messages[{index}]") for index, message in enumerate(messages)]


def _template_message(message: ChatMessage, where: str) -> dict[str, Any]:
    refuse_unsupported(message, f"{where}.")
    content = message.content
    if isinstance(content, list):
        for index, part in enumerate(content):
            require(part.type == "text", f"a {part.type!r} part cannot be read: this server's model takes text only",
                    f"{where}.content[{index}].type")  # fmt: skip
        content = "".join(part.text or "" for part in content)
    rendered: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_calls:
        rendered["tool_calls"] = [_template_call(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _template_call(call) -> dict[str, Any]:
    """An earlier tool call as chat templates read it: arguments as an object where they parse
    (as vLLM hands them; templates write them with `tojson`)."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": call.type, "function": function}


def chat_prompt(
    model: TextModel, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
    template_kwargs: dict[str, Any] | None, tools: list[dict[str, Any]] | None = None,
) -> str:  # fmt: skip
    """The prompt text of a conversation, rendered with the model's chat template (a template's
    refusal is a 400 naming `messages`; tools or tool calls it would not render, a 400 naming them)."""
    _check_template_reads(model.chat_template or "", messages, tools)
    try:
        text = model.render_chat(
            chat_messages(messages), add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, extra=template_kwargs, tools=tools,
        )  # fmt: skip
    except ValueError as exc:
        raise InvalidRequest(str(exc), "messages") from None
    check_text_size(text, model, "messages")
    return text


def _check_template_reads(template: str, messages: list[ChatMessage], tools: list[dict[str, Any]] | None) -> None:
    """A template that never mentions tools or tool calls would drop them silently: refused."""
    require(not tools or "tools" in template, "this model's chat template does not render tools", "tools")
    for index, message in enumerate(messages):
        require(not message.tool_calls or "tool_calls" in template,
                "this model's chat template does not render tool calls", f"messages[{index}].tool_calls")  # fmt: skip


def tokenize_ids(body: TokenizeBody, model: TextModel) -> list[int]:
    """/tokenize's ids (vLLM's shape): a prompt's, or those of chat messages rendered as
    /v1/chat/completions renders them."""
    refuse_unsupported(body)
    require((body.prompt is None) != (body.messages is None), "give exactly one of prompt and messages", "prompt")
    require(not body.tools or body.messages is not None, "tools need messages (a prompt is tokenized as it is)", "tools")
    if body.messages is not None:
        tools = template_tools(body.tools) if body.tools else None
        text = chat_prompt(model, body.messages, body.add_generation_prompt, body.continue_final_message,
                           body.chat_template_kwargs, tools)  # fmt: skip
        return model.encode(text, add_special_tokens=body.add_special_tokens is True)
    assert body.prompt is not None
    check_text_size(body.prompt, model, "prompt")
    return model.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)


def chat_plan(body: ChatBody, frontend: Frontend, request_id: str) -> Plan:
    check_model(body.model, frontend)
    refuse_unsupported(body, n=body.n)
    model, limit = frontend.model, frontend.config.max_logprobs
    top = body.top_logprobs or 0
    require(0 <= top <= min(limit, 20), f"must be in [0, {min(limit, 20)}]", "top_logprobs")
    require(body.logprobs or top == 0, "top_logprobs needs logprobs=true", "top_logprobs")
    tools = tool_plan(body, model.chat_template)
    grammar = response_format_grammar(body.response_format)
    if tools is not None and tools.grammar is not None:
        require(grammar is None, "cannot be combined with a forced tool call (tool_choice)", "response_format")
        grammar = tools.grammar
    text = chat_prompt(model, body.messages, body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
                       None if tools is None else tools.tools)  # fmt: skip
    ids = check_prompt(model.encode(text, add_special_tokens=body.add_special_tokens), model, "messages")
    max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    max_tokens = model.max_model_len - len(ids) if max_tokens is None else max_tokens
    request = LogprobRequest(return_logprob=body.logprobs, top_logprobs_num=top)
    choices = _choices([(ids, text)], body, model, request, CHAT_LOGPROB_NAMES, limit, max_tokens, request_id, grammar)
    top_k = top if body.logprobs else None
    name = frontend.config.model_name
    return Plan(f"chatcmpl-{request_id}", int(time.time()), name, choices, False, top_k, body.skip_special_tokens, tools)


def _usage(plan: Plan, results: list[GenerationResult]) -> dict[str, Any]:
    prompt = sum(len(spec.prompt_ids) for spec in {c.spec.prompt_ids: c.spec for c in plan.choices}.values())
    completion = sum(len(r.output_ids) for r in results)
    cached, seen = 0, set()
    for choice, result in zip(plan.choices, results):  # per distinct prompt, its first choice's (the others forked from it)
        if choice.spec.prompt_ids not in seen:
            seen.add(choice.spec.prompt_ids)
            cached += result.cached_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def _completion_logprobs(
    plan: Plan, choice: Choice, chunks: LogprobChunks, output_ids: list[int], model: TextModel, echo: bool, offset: int
) -> dict[str, Any] | None:
    if plan.top_k is None:
        return None
    positions = output_positions(chunks, output_ids, plan.top_k)
    visible = visible_bytes(output_ids, model, plan.skip_special_tokens)
    if echo:
        prompt = prompt_positions(chunks, choice.spec.prompt_ids, plan.top_k)
        positions, visible = prompt + positions, [model.token_bytes[i] for i in prompt.ids] + visible
    return completion_logprobs(positions, model, visible, offset)


def completion_response(plan: Plan, results: list[GenerationResult], model: TextModel) -> dict[str, Any]:
    choices = []
    for index, (choice, result) in enumerate(zip(plan.choices, results, strict=True)):
        prefix = choice.prompt_text if plan.echo else ""
        logprobs = _completion_logprobs(plan, choice, result.chunks, result.output_ids, model, plan.echo, 0)
        text = prefix + result.text
        choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_name(result.finish)})
    return _body(plan, "text_completion", choices, _usage(plan, results), _fingerprint(results))


def _fingerprint(results: list[GenerationResult]) -> str | None:
    """OpenAI's `system_fingerprint`: the weight_version of the policy that answered."""
    return next((result.weight_version for result in results if result.weight_version), None)


def _body(
    plan: Plan, kind: str, choices: list[dict[str, Any]], usage: dict[str, int] | None, fingerprint: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"id": plan.id, "object": kind, "created": plan.created, "model": plan.model, "choices": choices}
    if fingerprint is not None:
        body["system_fingerprint"] = fingerprint
    if usage is not None:
        body["usage"] = usage
    return body


def _chat_logprobs(plan: Plan, chunks: LogprobChunks, output_ids: list[int], model: TextModel) -> dict[str, Any] | None:
    if plan.top_k is None:
        return None
    positions: Positions = output_positions(chunks, output_ids, plan.top_k)
    return {"content": chat_content(positions, model)}


def chat_response(plan: Plan, results: list[GenerationResult], model: TextModel) -> dict[str, Any]:
    choices = []
    for index, result in enumerate(results):
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        reader = _reader(plan)
        if reader is not None:
            read = _joined(reader.feed(result.text), reader.finish())
            message = {"role": "assistant", "content": read.content or None, "tool_calls": read.calls}
        choices.append({
            "index": index,
            "message": message,
            "logprobs": _chat_logprobs(plan, result.chunks, result.output_ids, model),
            "finish_reason": _chat_finish(result.finish, reader),
        })  # fmt: skip
    return _body(plan, "chat.completion", choices, _usage(plan, results), _fingerprint(results))


def _reader(plan: Plan) -> CallReader | None:
    return None if plan.tools is None else CallReader(plan.tools.format, plan.tools.max_calls)


def _joined(first: Read, second: Read) -> Read:
    return Read(first.content + second.content, first.calls + second.calls)


def _chat_finish(finish: Finish | None, reader: CallReader | None) -> str | None:
    """OpenAI's `tool_calls` where a choice that stopped by itself made calls."""
    if finish is not None and finish.type == FinishType.STOP and reader is not None and reader.num_calls:
        return "tool_calls"
    return finish_name(finish)


def _delta_chunks(delta: Delta) -> LogprobChunks:
    chunks = LogprobChunks()
    chunks.add_all(delta.logprobs)
    return chunks


class _StreamState:
    """Per-choice progress of one streamed call: results so far and characters sent."""

    def __init__(self, plan: Plan) -> None:
        self.results = [GenerationResult(c.spec) for c in plan.choices]
        self.offsets = [0] * len(plan.choices)  # characters of text already sent per choice
        self.echoed = [False] * len(plan.choices)
        self.readers = [_reader(plan) for _ in plan.choices]


def _chunk(
    plan: Plan, kind: str, choices: list[dict[str, Any]], usage: dict[str, int] | None = None, fingerprint: str | None = None
) -> bytes:
    return sse(_body(plan, kind, choices, usage, fingerprint))


def _completion_entry(plan: Plan, state: _StreamState, index: int, delta: Delta, model: TextModel) -> dict[str, Any]:
    choice, result = plan.choices[index], state.results[index]
    result.add(delta)
    echo = plan.echo and not state.echoed[index]
    state.echoed[index] = True
    text = (choice.prompt_text if echo else "") + delta.text
    logprobs = _completion_logprobs(plan, choice, _delta_chunks(delta), delta.token_ids, model, echo, state.offsets[index])
    state.offsets[index] += len(text)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_name(delta.finish)}


def _chat_entry(plan: Plan, state: _StreamState, index: int, delta: Delta, model: TextModel) -> dict[str, Any]:
    state.results[index].add(delta)
    logprobs = _chat_logprobs(plan, _delta_chunks(delta), delta.token_ids, model)
    reader = state.readers[index]
    if reader is None:
        message = {"content": delta.text}
    else:
        read = reader.feed(delta.text)
        if delta.finish is not None:
            read = _joined(read, reader.finish())
        message = _call_delta(read, reader.num_calls - len(read.calls))
    return {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": _chat_finish(delta.finish, reader)}


def _call_delta(read: Read, first_index: int) -> dict[str, Any]:
    """A stream delta of `read`: its content, and each call whole, numbered from `first_index`."""
    message: dict[str, Any] = {"content": read.content}
    if read.calls:
        message["tool_calls"] = [{"index": first_index + i} | call for i, call in enumerate(read.calls)]
    return message


@dataclass(frozen=True)
class StreamUsage:
    """`stream_options`: `final` (OpenAI's include_usage) adds a last chunk with the call's usage;
    `continuous` (vLLM's continuous_usage_stats) puts the call's usage so far in every chunk."""

    final: bool = False
    continuous: bool = False


def stream_usage(options: StreamOptions | None) -> StreamUsage:
    return StreamUsage() if options is None else StreamUsage(options.include_usage, options.continuous_usage_stats)


async def _events(plan: Plan, frontend: Frontend, pendings: list, chat: bool, usage: StreamUsage) -> AsyncIterator[bytes]:
    state = _StreamState(plan)
    kind = "chat.completion.chunk" if chat else "text_completion"
    so_far = (lambda: _usage(plan, state.results)) if usage.continuous else (lambda: None)
    if chat:
        for index in range(len(plan.choices)):
            role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield _chunk(plan, kind, [role], so_far())
    entry = _chat_entry if chat else _completion_entry
    try:
        async for index, delta in merged_deltas(pendings):
            yield _chunk(plan, kind, [entry(plan, state, index, delta, frontend.model)], so_far(), delta.weight_version)
    except RequestFailed as exc:
        yield sse(error_body(str(exc)))
        yield SSE_DONE
        return
    if usage.final:
        yield _chunk(plan, kind, [], _usage(plan, state.results))
    yield SSE_DONE


async def _serve(
    plan: Plan, frontend: Frontend, request: Request, body: CompletionBody | ChatBody, chat: bool
) -> Response[Any] | Stream:
    pendings = await frontend.submit_all([c.spec for c in plan.choices], body.n)
    if body.stream:
        events = _events(plan, frontend, pendings, chat, stream_usage(body.stream_options))
        return Stream(stream_then_abort(frontend, pendings, events), media_type="text/event-stream", headers=SSE_HEADERS)
    results = await frontend.collect_all(pendings, request)
    build = chat_response if chat else completion_response
    return Response(build(plan, results, frontend.model))


@post("/v1/completions", status_code=200, responses=ERROR_RESPONSES, summary="OpenAI completions")
async def completions(data: CompletionBody, frontend: Frontend, request: Request) -> Response[Any] | Stream:
    plan = await frontend.prepare(request, completion_plan, data, frontend, request_id_of(request))
    return await _serve(plan, frontend, request, data, chat=False)


@post("/v1/chat/completions", status_code=200, responses=ERROR_RESPONSES, summary="OpenAI chat completions")
async def chat_completions(data: ChatBody, frontend: Frontend, request: Request) -> Response[Any] | Stream:
    plan = await frontend.prepare(request, chat_plan, data, frontend, request_id_of(request))
    return await _serve(plan, frontend, request, data, chat=True)


ROUTES = [completions, chat_completions]
