"""OpenAI-compatible endpoints: /v1/completions and /v1/chat/completions.

Each prompt x `n` becomes one `GenerationSpec`; a prompt's `n` choices are submitted together
(one scheduler request that forks them after one prefill), and the choices are assembled from
their results with `openai_format`.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from litestar import Request, post
from litestar.response import Response, Stream

from contracts.scheduler import Grammar
from services.tokenizer.api_types import ChatBody, CompletionBody, SamplingParamsBody, TokenizeBody
from services.tokenizer.chat_prompt import chat_prompt
from services.tokenizer.edge import request_id_of
from services.tokenizer.error_schema import ERROR_RESPONSES
from services.tokenizer.frontend import SSE_HEADERS, Frontend, stream_then_abort
from services.tokenizer.invalid import require
from services.tokenizer.openai_responses import Choice, Plan, chat_response, completion_response, stream_events, stream_usage
from services.tokenizer.structured import response_format_grammar, template_tools, tool_plan
from services.tokenizer.text_model import TextModel
from services.tokenizer.validation import (
    GenerationSpec,
    LogprobRequest,
    check_logprobs,
    check_n,
    choice_sampling,
    check_prompt,
    check_sampling,
    check_text_size,
    refuse_unsupported,
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


async def _serve(
    plan: Plan, frontend: Frontend, request: Request, body: CompletionBody | ChatBody, chat: bool
) -> Response[Any] | Stream:
    pendings = await frontend.submit_all([c.spec for c in plan.choices], body.n)
    if body.stream:
        events = stream_events(plan, frontend, pendings, chat, stream_usage(body.stream_options))
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
