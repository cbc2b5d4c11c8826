"""HTTP request bodies, decoded straight from JSON by msgspec (via Litestar).

Field names are the ones SGLang, OpenAI and vLLM clients send. Unknown fields are ignored, so
OpenAI clients' `extra_body` fields and options we do not implement never cause an error.
Range checks live in `validation`; these types only fix the JSON shapes.
"""

from __future__ import annotations

import msgspec


class SamplingParamsBody(msgspec.Struct, kw_only=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None


class GenerateBody(msgspec.Struct, kw_only=True):
    """POST /generate (SGLang native). `text` or `input_ids`; a list of prompts is a batch."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    sampling_params: SamplingParamsBody | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    return_flat_raw_top_logprobs: bool = False
    return_flat_raw_top_logprobs_b64: bool = False


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class OpenAIBody(msgspec.Struct, kw_only=True):
    """Fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM/SGLang extras that clients send through `extra_body`.
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class CompletionBody(OpenAIBody, kw_only=True):
    """POST /v1/completions. `prompt`: str, [str], [int] or [[int]]."""

    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    type: str = "text"
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None


class ChatBody(OpenAIBody, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeBody(msgspec.Struct, kw_only=True):
    prompt: str
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeBody(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None
