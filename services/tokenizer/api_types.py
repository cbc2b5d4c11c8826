"""HTTP request bodies, decoded straight from JSON by msgspec (via Litestar).

Field names are the ones SGLang, OpenAI and vLLM clients send. Fields that change results but
are not implemented are declared too, typed `Unsupported`, so that `validation` can refuse them
with a 400 naming them instead of ignoring them; fields that change nothing (`user`, `metadata`,
...) stay unknown and ignored. Range checks live in `validation`; these types only fix the shapes.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec



def doc(text: str) -> msgspec.Meta:
    """A field's description in the OpenAPI schema, and so in docs/api-parameters.md."""
    return msgspec.Meta(description=text)


# Any JSON: refused (400) unless absent or its neutral value (validation.refuse_unsupported).
Unsupported = Annotated[
    Any, doc("Not supported here: any value but an absent, null, false or empty one is a 400 naming it.")
]


class SamplingParamsBody(msgspec.Struct, kw_only=True):
    max_new_tokens: Annotated[int, doc("Output tokens at most")] = 128
    temperature: Annotated[float, doc("0: greedy")] = 1.0
    top_p: float = 1.0
    top_k: Annotated[int, doc("-1: off")] = -1
    min_p: float = 0.0
    stop: Annotated[
        str | list[str] | None, doc("Strings that end the output; the matched one is cut off unless no_stop_trim")
    ] = None
    stop_token_ids: Annotated[
        list[int] | None, doc("Token ids that end the output")
    ] = None
    ignore_eos: Annotated[bool, doc("Keep generating past the model's end-of-sequence token")] = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: Annotated[bool, doc("Keep the matched stop string at the end of the text")] = False
    seed: Annotated[int | None, doc("Seeded sampling: the same seed and request give the same output")] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: Annotated[
        int, doc("EOS, stop ids and stop strings are held back until this many tokens (vLLM's min_tokens)")
    ] = 0
    logit_bias: Annotated[
        dict[str, float] | None, doc("Token id (as a string) to a bias in [-100, 100] added to its logit")
    ] = None
    n: Annotated[int, doc("Outputs per prompt, sharing one prefill; the answer is then a list")] = 1
    regex: Annotated[str | None, doc("Structured output: the text matches this regular expression")] = None
    json_schema: Annotated[
        str | None, doc("Structured output: the text is JSON valid under this JSON Schema (given as a JSON string)")
    ] = None
    ebnf: Annotated[str | None, doc("Structured output: the text matches this EBNF grammar (xgrammar's; start rule `root`)")] = None
    stop_regex: Unsupported = None
    sampling_seed: Unsupported = None
    structural_tag: Unsupported = None
    custom_params: Unsupported = None


class GenerateBody(msgspec.Struct, kw_only=True):
    """POST /generate (SGLang native). `text` or `input_ids`; a list of prompts is a batch."""

    text: Annotated[
        str | list[str] | None, doc("The prompt, or a list of prompts (a batch); give text or input_ids")
    ] = None
    input_ids: Annotated[list[int | list[int]] | None, doc("The prompt as token ids, or a list of such prompts")] = None
    sampling_params: SamplingParamsBody | None = None
    stream: Annotated[
        bool, doc("Server-sent events, text and output_ids cumulative, logprob lists only the new entries")
    ] = False
    rid: Annotated[
        str | list[str] | None, doc("A label for the request, returned as meta_info.id (a list for a batch)")
    ] = None
    return_logprob: Annotated[bool, doc("Logprobs of the model's own (raw) distribution in meta_info")] = False
    logprob_start_len: Annotated[int, doc("-1: output positions only; k >= 0: prompt positions from k on too")] = -1
    top_logprobs_num: Annotated[int, doc("The k most likely tokens at each returned position")] = 0
    token_ids_logprob: Annotated[
        list[int] | None, doc("The logprobs of these token ids at each returned position")
    ] = None
    return_text_in_logprobs: Annotated[bool, doc("Each logprob entry carries its token's text")] = False
    return_flat_raw_top_logprobs: Annotated[
        bool, doc("Prompt top logprobs as flat row-major value and id lists with their shape")
    ] = False
    return_flat_raw_top_logprobs_b64: Annotated[
        bool, doc("The flat prompt top logprobs as base64 of little-endian float32 / int32")
    ] = False
    custom_logit_processor: Unsupported = None
    lora_path: Unsupported = None
    image_data: Unsupported = None
    audio_data: Unsupported = None
    video_data: Unsupported = None
    input_embeds: Unsupported = None
    return_hidden_states: Unsupported = None
    session_params: Unsupported = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: Annotated[bool, doc("One last chunk with the call's usage (OpenAI)")] = False
    continuous_usage_stats: Annotated[bool, doc("The call's usage so far in every chunk (vLLM)")] = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: Annotated[dict[str, Any] | None, doc("The JSON Schema every answer is valid under")] = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Annotated[str, doc("text, json_object (any JSON object) or json_schema")]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: Annotated[dict[str, Any] | None, doc("JSON Schema of the arguments (a forced call's are valid under it)")] = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str = "function"
    function: NamedFunction


class OpenAIBody(msgspec.Struct, kw_only=True):
    """Fields /v1/completions and /v1/chat/completions share."""

    model: Annotated[str | None, doc("The served model's name or path; another name is a 404")] = None
    temperature: float | None = None
    top_p: float | None = None
    n: Annotated[int, doc("Choices per prompt, sharing one prefill")] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM/SGLang extras that clients send through `extra_body`.
    top_k: Annotated[int | None, doc("vLLM extra; -1 or absent: off")] = None
    min_p: Annotated[float | None, doc("vLLM extra")] = None
    stop_token_ids: Annotated[list[int] | None, doc("vLLM extra: token ids that end the output")] = None
    ignore_eos: Annotated[bool, doc("vLLM extra: keep generating past end-of-sequence")] = False
    skip_special_tokens: Annotated[bool, doc("vLLM extra: leave special tokens out of the text")] = True
    spaces_between_special_tokens: Annotated[bool, doc("vLLM extra")] = True
    include_stop_str_in_output: Annotated[
        bool, doc("vLLM extra: keep the matched stop string at the end of the text")
    ] = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: Annotated[float | None, doc("vLLM extra, in (0, 10]")] = None
    min_tokens: Annotated[
        int, doc("vLLM extra: EOS, stop ids and stop strings are held back until this many tokens")
    ] = 0
    best_of: Unsupported = None
    use_beam_search: Unsupported = None
    guided_json: Unsupported = None
    guided_regex: Unsupported = None
    guided_choice: Unsupported = None
    guided_grammar: Unsupported = None
    structured_outputs: Unsupported = None
    response_format: Annotated[
        ResponseFormat | None, doc("Structured output: json_object or json_schema (the answer is forced to match)")
    ] = None
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

    prompt: Annotated[
        str | list[str | int | list[int]], doc("A string, a list of strings, token ids or a list of token-id lists")
    ]
    max_tokens: int | None = 16
    logprobs: Annotated[int | None, doc("The k most likely tokens at each position (0 to --max-logprobs)")] = None
    echo: Annotated[
        bool, doc("The prompt first, with its logprobs when logprobs is set (the first position null)")
    ] = False
    add_special_tokens: Annotated[bool, doc("vLLM extra: the tokenizer's special tokens around a text prompt")] = True
    suffix: Unsupported = None


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content. Only `text` parts are read: the served models take text
    alone, so any other type (`image_url`, `input_audio`, `file`, ...) is a 400 naming it."""

    type: str = "text"
    text: str | None = None


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: Annotated[str, doc("The arguments as a JSON string (as OpenAI returns them)")]


class ToolCall(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: str = "function"
    function: CalledFunction


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: Annotated[str | None, doc("Handed to the chat template, as transformers hands it")] = None
    tool_calls: Annotated[list[ToolCall] | None, doc("An assistant's earlier tool calls")] = None
    tool_call_id: Annotated[str | None, doc("A tool message: the call it answers")] = None


class ChatBody(OpenAIBody, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], doc(
        "The conversation, rendered with the model's chat template; content parts other than text are a 400"
    )]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: Annotated[bool, doc("Logprobs of the output tokens")] = False
    top_logprobs: Annotated[int | None, doc("The k most likely tokens at each output position (needs logprobs)")] = None
    add_generation_prompt: Annotated[bool, doc("vLLM extra: passed to the chat template")] = True
    continue_final_message: Annotated[
        bool, doc("vLLM extra: the last (assistant) message is continued, not closed")
    ] = False
    chat_template_kwargs: Annotated[
        dict[str, Any] | None, doc("vLLM extra: more variables for the chat template")
    ] = None
    add_special_tokens: Annotated[
        bool, doc("vLLM extra: the tokenizer's special tokens around the rendered prompt (off: the template writes them)")
    ] = False
    tools: Annotated[list[Tool] | None, doc("Functions the model may call, shown to it through the chat template")] = None
    tool_choice: Annotated[str | NamedToolChoice | None, doc(
        "auto (default with tools): the model decides; required: one call, forced; a named function: "
        "a call of it, forced; none: no tools"
    )] = None
    parallel_tool_calls: Annotated[bool | None, doc("false: at most one tool call comes back (the model's first)")] = None
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
    """POST /tokenize and /v1/tokenize (vLLM's shape): `prompt` text, or chat `messages` rendered
    with the model's chat template first."""

    prompt: Annotated[str | None, doc("Text to tokenize; give prompt or messages")] = None
    messages: Annotated[list[ChatMessage] | None, doc(
        "Chat messages, rendered with the model's chat template as /v1/chat/completions renders them"
    )] = None
    add_special_tokens: Annotated[bool | None, doc(
        "The tokenizer's special tokens around the text; default true for a prompt, false for messages "
        "(the template writes them)"
    )] = None
    add_generation_prompt: Annotated[bool, doc("Messages only, as on /v1/chat/completions")] = True
    continue_final_message: Annotated[bool, doc("Messages only, as on /v1/chat/completions")] = False
    chat_template_kwargs: Annotated[dict[str, Any] | None, doc("Messages only, as on /v1/chat/completions")] = None
    return_token_strs: Annotated[bool, doc("Also return each token as the tokenizer spells it")] = False
    model: str | None = None
    tools: Annotated[list[Tool] | None, doc("Messages only, as on /v1/chat/completions")] = None
    chat_template: Unsupported = None


class DetokenizeBody(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None
