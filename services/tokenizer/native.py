"""The native /generate API (SGLang-compatible): response bodies and SSE events.

A request's deltas are folded into a `GenerationResult`; non-stream responses format it once,
stream events format each delta's new entries (text and output_ids cumulative, as SGLang does).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any


from contracts.detokenizer import Finish
from services.common import metrics
from services.tokenizer.json_body import encode_json
from services.tokenizer.logprobs_format import FormatOptions, LogprobChunks, meta_logprobs
from services.tokenizer.requests import Delta, PendingRequest, RequestFailed
from services.tokenizer.text_model import TextModel
from services.tokenizer.validation import GenerationSpec

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: Any) -> bytes:
    return b"data: " + encode_json(payload) + b"\n\n"


def error_body(
    message: str, kind: str = "service_unavailable", code: int | None = 503, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape (HTTP bodies and SSE error events alike)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def finish_reason(finish: Finish | None) -> dict[str, Any] | None:
    if finish is None:
        return None
    reason: dict[str, Any] = {"type": metrics.finish_reason(finish.type), "matched": finish.matched}
    if finish.message is not None:
        reason["message"] = finish.message
    return reason


def format_options(spec: GenerationSpec, model: TextModel) -> FormatOptions:
    params = spec.logprobs
    return FormatOptions(
        top_logprobs_num=params.top_logprobs_num,
        token_ids_logprob=params.token_ids_logprob or None,
        text_of=model.token_text if spec.text_in_logprobs else None,
        flat=params.flat_prompt_top_logprobs,
        flat_b64=spec.flat_b64,
    )


@dataclass
class GenerationResult:
    """Everything one request produced so far."""

    spec: GenerationSpec
    started_at: float = field(default_factory=time.perf_counter)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    finish: Finish | None = None
    spec_verify_ct: int | None = None
    cached_tokens: int = 0  # prompt tokens the scheduler found in KV (SGLang's meta_info.cached_tokens)
    weight_version: str | None = None  # the weights of its last tokens
    chunks: LogprobChunks = field(default_factory=LogprobChunks)

    def add(self, delta: Delta) -> None:
        """A streamed request's result keeps no logprob arrays: each event formats its own entries,
        and its end needs only the counts."""
        self.text += delta.text
        self.output_ids.extend(delta.token_ids)
        self.prompt_tokens = delta.prompt_tokens or self.prompt_tokens or len(self.spec.prompt_ids)
        self.finish = delta.finish
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        if delta.spec_verify_ct is not None:
            self.spec_verify_ct = delta.spec_verify_ct
        self.weight_version = delta.weight_version or self.weight_version
        if not self.spec.stream:
            self.chunks.add_all(delta.logprobs)

    @property
    def e2e_latency(self) -> float:
        return time.perf_counter() - self.started_at


async def collect(pending: PendingRequest, result: GenerationResult | None = None) -> GenerationResult:
    result = result or GenerationResult(pending.spec)
    async for delta in pending.deltas():
        result.add(delta)
    return result


def accept_length(num_output_tokens: int, num_verifies: int) -> float:
    """Tokens each verify pass committed: the prefill samples the first token, so it is not counted."""
    return max(num_output_tokens - 1, 0) / max(num_verifies, 1)


def meta_info(result: GenerationResult, logprob_fields: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": result.spec.response_id or result.spec.rid,
        "prompt_tokens": result.prompt_tokens or len(result.spec.prompt_ids),
        "completion_tokens": len(result.output_ids),
        "cached_tokens": result.cached_tokens,
        "finish_reason": finish_reason(result.finish),
        "e2e_latency": result.e2e_latency,
        **logprob_fields,
    }
    if result.weight_version is not None:  # the scheduler's policy version (absent only from older schedulers)
        meta["weight_version"] = result.weight_version
    if result.spec_verify_ct is not None:
        meta["spec_verify_ct"] = result.spec_verify_ct
        meta["spec_accept_length"] = accept_length(len(result.output_ids), result.spec_verify_ct)
    return meta


def native_response(result: GenerationResult, model: TextModel) -> dict[str, Any]:
    """The full non-stream body; logprob fields are built once, from all the arrays."""
    spec = result.spec
    fields: dict[str, Any] = {}
    if spec.logprobs.return_logprob:
        fields = meta_logprobs(result.chunks, spec.prompt_ids, result.output_ids, format_options(spec, model))
    return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta_info(result, fields)}


def native_event(result: GenerationResult, delta: Delta, model: TextModel) -> dict[str, Any]:
    """One SSE event after `delta` was added: cumulative text/ids, only the new logprob entries."""
    spec = result.spec
    fields: dict[str, Any] = {}
    if spec.logprobs.return_logprob:
        chunks = LogprobChunks()
        chunks.add_all(delta.logprobs)
        opts = replace(format_options(spec, model), stream_event=True)
        fields = meta_logprobs(chunks, spec.prompt_ids, delta.token_ids, opts)
    return {"text": result.text, "output_ids": list(result.output_ids), "meta_info": meta_info(result, fields)}


async def native_events(pending: PendingRequest, model: TextModel, result: GenerationResult) -> AsyncIterator[bytes]:
    """SSE events until the finish; a failure becomes an error event. Always ends with [DONE]."""
    try:
        async for delta in pending.deltas():
            result.add(delta)
            yield sse(native_event(result, delta, model))
    except RequestFailed as exc:
        yield sse(error_body(str(exc)))
    yield SSE_DONE
