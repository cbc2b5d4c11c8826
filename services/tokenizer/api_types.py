"""HTTP request bodies, decoded straight from JSON by msgspec (via Litestar).

Field names are the ones SGLang, OpenAI and vLLM clients send. Fields that change results but
are not implemented are declared too, typed `Unsupported`, so that `validation` can refuse them
with a 400 naming them instead of ignoring them; fields that change nothing (`user`, `metadata`,
...) stay unknown and ignored. Range checks live in `validation`; these types only fix the shapes.
"""

from __future__ import annotations

from typing import Any

import msgspec

Unsupported = Any  # any JSON: refused (400) unless absent or its neutral value, see validation.UNSUPPORTED


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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI's) -> bias
    n: int = 1  # parallel samples of each prompt, sharing its prefill
    regex: Unsupported = None
    stop_regex: Unsupported = None
    sampling_seed: Unsupported = None
    json_schema: Unsupported = None
    ebnf: Unsupported = None
    structural_tag: Unsupported = None
    custom_params: Unsupported = None


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
    custom_logit_processor: Unsupported = None
    lora_path: Unsupported = None
    image_data: Unsupported = None
    audio_data: Unsupported = None
    video_data: Unsupported = None
    input_embeds: Unsupported = None
    return_hidden_states: Unsupported = None
    session_params: Unsupported = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False  # one last chunk with the call's usage (OpenAI)
    continuous_usage_stats: bool = False  # usage so far in every chunk (vLLM)


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
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM extra: the matched stop string stays in the text
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None  # vLLM extra
    min_tokens: int = 0  # vLLM extra
    best_of: Unsupported = None
    use_beam_search: Unsupported = None
    guided_json: Unsupported = None
    guided_regex: Unsupported = None
    guided_choice: Unsupported = None
    guided_grammar: Unsupported = None
    structured_outputs: Unsupported = None
    response_format: Unsupported = None
    allowed_token_ids: Unsupported = None
    bad_words: Unsupported = None
    prompt_logprobs: Unsupported = None
    truncate_prompt_tokens: Unsupported = None
    logits_processors: Unsupported = None
    vllm_xargs: Unsupported = None
    return_tokens_as_token_ids: Unsupported = None
    return_token_ids: Unsupported = None
    session_params: Unsupported = None
    lora_path: Unsupported = None


class CompletionBody(OpenAIBody, kw_only=True):
    """POST /v1/completions. `prompt`: str, [str], [int] or [[int]]."""

    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM extra: the tokenizer's BOS/EOS around a text prompt
    suffix: Unsupported = None


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content. Only `text` parts are read: the served models take text
    alone, so any other type (`image_url`, `input_audio`, `file`, ...) is a 400 naming it."""

    type: str = "text"
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # handed to the chat template, as transformers hands it
    tool_calls: Unsupported = None
    tool_call_id: Unsupported = None


class ChatBody(OpenAIBody, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM extra: passed to the chat template
    continue_final_message: bool = False  # vLLM extra: the last (assistant) message is continued
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extra: more template variables
    add_special_tokens: bool = False  # vLLM extra: the template already writes BOS and the like
    tools: Unsupported = None
    tool_choice: Unsupported = None
    functions: Unsupported = None
    function_call: Unsupported = None
    audio: Unsupported = None
    modalities: Unsupported = None
    prediction: Unsupported = None
    reasoning_effort: Unsupported = None
    web_search_options: Unsupported = None
    chat_template: Unsupported = None
    documents: Unsupported = None
    echo: Unsupported = None


class TokenizeBody(msgspec.Struct, kw_only=True):
    prompt: str
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeBody(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None
