"""The answers of /v1/completions and /v1/chat/completions: a call's `Plan` (its choices) and the
bodies built from its results — whole, or streamed as chunks (`stream_events`), with usage,
logprobs in OpenAI's shapes (`openai_format`) and tool calls read back from the text."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from contracts.detokenizer import Finish, FinishType
from services.common.metrics import finish_reason
from services.tokenizer.api_types import StreamOptions
from services.tokenizer.frontend import Frontend, merged_deltas
from services.tokenizer.logprobs_format import LogprobChunks
from services.tokenizer.native import SSE_DONE, GenerationResult, error_body, sse
from services.tokenizer.openai_format import Positions, chat_content, completion_logprobs, output_positions, prompt_positions, visible_bytes
from services.tokenizer.requests import Delta, RequestFailed
from services.tokenizer.structured import ToolPlan
from services.tokenizer.text_model import TextModel
from services.tokenizer.tools import CallReader, whole_calls
from services.tokenizer.validation import GenerationSpec


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
            read = reader.feed(result.text).add(reader.finish())
            message = {"role": "assistant", "content": read.content or None, "tool_calls": whole_calls(read.calls)}
        choices.append({
            "index": index,
            "message": message,
            "logprobs": _chat_logprobs(plan, result.chunks, result.output_ids, model),
            "finish_reason": _chat_finish(result.finish, reader),
        })  # fmt: skip
    return _body(plan, "chat.completion", choices, _usage(plan, results), _fingerprint(results))


def _reader(plan: Plan) -> CallReader | None:
    return None if plan.tools is None else CallReader(plan.tools.format, plan.tools.max_calls)


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
            read = read.add(reader.finish())
        message = {"content": read.content or None, "tool_calls": read.calls} if read.calls else {"content": read.content}
    return {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": _chat_finish(delta.finish, reader)}


@dataclass(frozen=True)
class StreamUsage:
    """`stream_options`: `final` (OpenAI's include_usage) adds a last chunk with the call's usage;
    `continuous` (vLLM's continuous_usage_stats) puts the call's usage so far in every chunk."""

    final: bool = False
    continuous: bool = False


def stream_usage(options: StreamOptions | None) -> StreamUsage:
    return StreamUsage() if options is None else StreamUsage(options.include_usage, options.continuous_usage_stats)


async def stream_events(plan: Plan, frontend: Frontend, pendings: list, chat: bool, usage: StreamUsage) -> AsyncIterator[bytes]:
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
