"""A chat request's conversation rendered into prompt text: each message checked as the model's
chat template will read it (a part it cannot read, or tools it would drop, is a 400 naming it),
then rendered with the template (`chat_template.py`)."""

from __future__ import annotations

import json
from typing import Any

from services.tokenizer.api_types import ChatMessage
from services.tokenizer.text_model import TextModel
from services.tokenizer.invalid import InvalidRequest, require
from services.tokenizer.validation import check_text_size, refuse_unsupported


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
