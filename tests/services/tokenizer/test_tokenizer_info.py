"""The endpoints scripts ask a server about itself (SGLang's /version, /get_model_info,
/get_server_info) and vLLM's /tokenize with `prompt` or `messages`, on /tokenize and /v1/tokenize."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import httpx
import pytest

from ops.api_reference import openapi_schema
from services.tokenizer.api_types import ChatMessage, TokenizeBody
from services.tokenizer.openai_api import completion_prompts, tokenize_ids
from services.tokenizer.text_model import TextModel
from tests.services.tokenizer.conftest import MODEL_DIR, SCHEDULER_ID

pytestmark = pytest.mark.timeout(30)

HI = [{"role": "user", "content": "hi"}]
RENDERED_HI = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # the tiny model's template


async def test_version_is_the_installed_package_s(url):
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.get("/version")
    assert response.json() == {"version": importlib.metadata.version("sparkwire")}


async def test_model_info_names_the_served_model(url):
    async with httpx.AsyncClient(base_url=url) as client:
        info = (await client.get("/get_model_info")).json()
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert info["model_path"] == info["tokenizer_path"] == str(MODEL_DIR)
    assert (info["model_type"], info["architectures"]) == (config["model_type"], config["architectures"])
    assert info["is_generation"] is True and info["has_image_understanding"] is False
    assert info["served_model_name"] == "sparkwire-tiny" and info["max_model_len"] == config["max_position_embeddings"]


async def test_server_info_shows_the_front_end_the_live_services_and_a_scheduler_s_state(url, tokenizer):
    async with httpx.AsyncClient(base_url=url) as client:
        info = (await client.get("/get_server_info")).json()
    assert info["version"] == importlib.metadata.version("sparkwire") and info["port"] == tokenizer.config.port
    assert info["context_length"] == 32768 and info["api_key_required"] is False
    assert info["services"]["tokenizer"] == ["tok-test"] and SCHEDULER_ID in info["services"]["scheduler"]
    assert [state["scheduler_id"] for state in info["internal_states"]] == [SCHEDULER_ID]
    assert info["internal_states"][0]["speculative_algorithm"] == info["speculative_algorithm"] == "none"


@pytest.mark.parametrize("path", ["/tokenize", "/v1/tokenize"])
async def test_tokenize_a_prompt_or_chat_messages(url, text_model, path):
    async with httpx.AsyncClient(base_url=url) as client:
        prompt = (await client.post(path, json={"prompt": "hello world", "return_token_strs": True})).json()
        chat = (await client.post(path, json={"messages": HI})).json()
        bare = (await client.post(path, json={"messages": HI, "add_generation_prompt": False})).json()
    ids = text_model.encode("hello world")
    assert prompt == {"tokens": ids, "count": len(ids), "max_model_len": 32768,
                      "token_strs": [text_model.tokenizer.id_to_token(i) for i in ids]}  # fmt: skip
    assert chat["tokens"] == text_model.encode(RENDERED_HI, add_special_tokens=False) and chat["count"] == len(chat["tokens"])
    assert text_model.decode(bare["tokens"], skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize(
    "body, param",
    [({"prompt": "a", "messages": HI}, "prompt"), ({}, "prompt"), ({"prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
     ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0].type")],
)  # fmt: skip
async def test_tokenize_refuses_what_it_cannot_honour_by_name(url, body, param):
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/tokenize", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


async def test_v1_detokenize_is_detokenize(url, text_model):
    ids = text_model.encode("hello world")
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/detokenize", json={"tokens": ids})
    assert response.json() == {"prompt": "hello world"}


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory) -> TextModel:
    """The tiny model with a tokenizer that writes <|endoftext|> before every text, as BOS tokenizers do."""
    directory = tmp_path_factory.mktemp("bos-model")
    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, directory / name)
    tokenizer = json.loads((MODEL_DIR / "tokenizer.json").read_text())
    bos = next(t for t in tokenizer["added_tokens"] if t["content"] == "<|endoftext|>")
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [bos["id"]], "tokens": ["<|endoftext|>"]}},
    }  # fmt: skip
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return TextModel.from_dir(Path(directory))


def test_special_tokens_default_on_for_a_prompt_and_off_for_messages_as_vllm(bos_model):
    bos = bos_model.encode("x")[0]
    assert tokenize_ids(TokenizeBody(prompt="x"), bos_model)[0] == bos
    assert tokenize_ids(TokenizeBody(prompt="x", add_special_tokens=False), bos_model)[0] != bos
    messages = [ChatMessage(role="user", content="hi")]
    assert tokenize_ids(TokenizeBody(messages=messages), bos_model)[0] != bos
    assert tokenize_ids(TokenizeBody(messages=messages, add_special_tokens=True), bos_model)[0] == bos


def test_completions_honour_add_special_tokens_too(bos_model):
    bos = bos_model.encode("x")[0]
    assert completion_prompts("x", bos_model)[0][0][0] == bos
    assert completion_prompts("x", bos_model, add_special_tokens=False)[0][0][0] != bos


async def test_openapi_json_is_the_schema_the_parameter_reference_is_written_from(url):
    async with httpx.AsyncClient(base_url=url) as client:
        served = (await client.get("/openapi.json")).json()
    assert served == openapi_schema()
