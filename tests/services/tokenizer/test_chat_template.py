"""Chat templates render exactly as `transformers.apply_chat_template` renders them.

The two templates below are written here in the style of Llama 3's and Qwen's (special tokens
from the tokenizer config, `raise_exception`, a default system prompt, `tojson`, loop controls,
the generation prompt); both are rendered by Sparkwire and by transformers from the same model
directory and compared character for character.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import transformers

from services.models import RANDOM_TINY_MODEL
from services.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from services.tokenizer.text_model import TextModel

MODEL_DIR = RANDOM_TINY_MODEL

LLAMA3_STYLE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{%- if system %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- else %}{{- eos_token }}{%- endif %}"
)

QWEN_STYLE = """{%- if tools %}
<|im_start|>system
{{- messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{%- elif messages[0]['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first and tools %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

ADDED_EOT = {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False, "normalized": False, "rstrip": False,
             "single_word": False, "special": True}  # how tokenizer_config.json may store a special token  # fmt: skip
CONFIGS = {
    "llama3": {"chat_template": LLAMA3_STYLE, "bos_token": "<|begin_of_text|>", "eos_token": ADDED_EOT},
    "qwen": {"chat_template": QWEN_STYLE, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
}
CONVERSATIONS = [
    [{"role": "user", "content": "  Hi there "}],
    [{"role": "system", "content": "Be brief. café ✓"}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
]  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b <sum>", "parameters": {"type": "object"}}}]


def model_dir(tmp_path: Path, name: str) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    shutil.copy(MODEL_DIR / "tokenizer.json", directory / "tokenizer.json")
    shutil.copy(MODEL_DIR / "config.json", directory / "config.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **CONFIGS[name]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("name", list(CONFIGS))
def test_renders_exactly_as_transformers(tmp_path, name):
    directory = model_dir(tmp_path, name)
    ours, theirs = TextModel.from_dir(directory), transformers.AutoTokenizer.from_pretrained(directory)
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert ours.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected
        continued = [*messages, {"role": "assistant", "content": "The answer is "}] if name == "qwen" else None
        if continued:
            expected = theirs.apply_chat_template(continued, tokenize=False, continue_final_message=True)
            assert ours.render_chat(continued, add_generation_prompt=False, continue_final_message=True) == expected
    if name == "qwen":
        expected = theirs.apply_chat_template(CONVERSATIONS[1], tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert ours.render_chat(CONVERSATIONS[1], tools=TOOLS) == expected
        assert '"a + b <sum>"' in expected  # tojson without HTML escaping
    else:
        assert ours.render_chat(CONVERSATIONS[0]).startswith("<|begin_of_text|><|start_header_id|>user")
        assert ours.render_chat(CONVERSATIONS[0], add_generation_prompt=False).endswith("<|eot_id|><|eot_id|>")


def test_raise_exception_is_a_template_error_with_its_message(tmp_path):
    directory = model_dir(tmp_path, "llama3")
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="must alternate"):
        transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        TextModel.from_dir(directory).render_chat(bad)


def test_template_kwargs_reach_the_template_but_cannot_replace_the_messages():
    template = ChatTemplate("{{ greeting }} {{ messages | length }}{% generation %}!{% endgeneration %}", {})
    assert template.render([{"role": "user", "content": "x"}], extra={"greeting": "hello"}) == "hello 1!"
    with pytest.raises(ChatTemplateError, match="may not set messages"):
        template.render([], extra={"messages": []})
    with pytest.raises(ChatTemplateError, match="cannot both"):
        template.render([], add_generation_prompt=True, continue_final_message=True)


@pytest.mark.timeout(30)
async def test_a_template_error_is_a_400_with_the_templates_message(tmp_path, start_tokenizer):
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "max_tokens": 2}
    async with start_tokenizer(model_dir=model_dir(tmp_path, "llama3")) as frontend:
        url = f"http://127.0.0.1:{frontend.config.port}/v1/chat/completions"
        async with httpx.AsyncClient() as client:
            response = await client.post(url, json=bad)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "Conversation roles must alternate" in error["message"]


def test_the_bundled_template_renders_tools_and_tool_calls_as_transformers_does():
    from services.models import BUNDLED_MODEL

    ours, theirs = TextModel.from_dir(BUNDLED_MODEL), transformers.AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [*CONVERSATIONS[1], {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]  # fmt: skip
    expected = theirs.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages, tools=TOOLS) == expected
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in expected
    assert "<tool_response>\n3\n</tool_response>" in expected and '"a + b <sum>"' in expected
    plain = theirs.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(CONVERSATIONS[1]) == plain == "".join(
        f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATIONS[1]) + "<|im_start|>assistant\n"
