"""Bounded everything: values past the documented limits get a 400 naming the field (or a 413 for
a body over the size limit), never a bare 500, and nothing fans out without bound."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from contracts.limits import MAX_CLIENT_RID_CHARS, MAX_STOP_STRINGS, MAX_TOKEN_IDS_LOGPROB
from services.tokenizer.validation import MAX_BODY_BYTES, MAX_SEQUENCES_PER_CALL

pytestmark = pytest.mark.timeout(60)

HUGE = 2**64  # past uint64: not even MessagePack can carry it
CHAT = [{"role": "user", "content": "x"}]

CASES = [
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": HUGE}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2**31}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": HUGE}}, "sampling_params.top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"seed": HUGE}}, "sampling_params.seed"),
    ("/generate", {"text": "hi", "sampling_params": {"seed": -(2**63) - 1}}, "sampling_params.seed"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": "x" * 2000}}, "sampling_params.stop"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}}, "sampling_params.stop"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [1] * 1000}}, "sampling_params.stop_token_ids"),
    ("/generate", {"text": "hi", "rid": "r" * (MAX_CLIENT_RID_CHARS + 1)}, "rid"),
    ("/generate", {"text": "hi", "rid": ""}, "rid"),
    ("/generate", {"text": "hi", "return_logprob": True, "token_ids_logprob": [1] * (MAX_TOKEN_IDS_LOGPROB + 1)}, "token_ids_logprob"),
    ("/generate", {"text": ["hi"] * (MAX_SEQUENCES_PER_CALL + 1)}, "text"),
    ("/generate", {"input_ids": [[1]] * (MAX_SEQUENCES_PER_CALL + 1)}, "input_ids"),
    ("/generate", {"text": "a " * 2_000_000}, "text"),  # 4 MB of text: refused before tokenizing
    ("/v1/completions", {"prompt": "hi", "max_tokens": HUGE}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "seed": HUGE}, "seed"),
    ("/v1/completions", {"prompt": ["a"] * 20, "n": 64}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": HUGE}, "max_tokens"),
]


async def test_values_past_the_limits_get_400_naming_the_field(url, backend):
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for path, body, param in CASES:
            response = await client.post(path, json=body)
            assert response.status_code == 400, (path, param, response.text[:300])
            error = response.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", (path, error)
        assert (await client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})).status_code == 200


async def test_a_body_over_the_size_limit_gets_413_and_deep_nesting_400(url, backend):
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        big = b'{"text": "' + b"a" * MAX_BODY_BYTES + b'"}'
        response = await client.post("/generate", content=big, headers={"content-type": "application/json"})
        assert response.status_code == 413 and response.json()["error"]["message"]
        deep = b'{"text": "hi", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # an ignored field
        response = await client.post("/generate", content=deep, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text[:300]
        assert "nested" in response.json()["error"]["message"]


async def test_max_completion_tokens_zero_means_zero_not_unlimited(url, backend):
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        response = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 0


async def test_an_empty_body_and_a_non_json_content_type_are_named_plainly(url, backend):
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        empty = await client.post("/generate", content=b"", headers={"content-type": "application/json"})
        assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"], empty.text
        body = b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}'
        plain = await client.post("/generate", content=body, headers={"content-type": "text/plain"})
        assert plain.status_code == 415 and "application/json" in plain.json()["error"]["message"], plain.text
        typed = await client.post("/generate", content=body, headers={"content-type": "application/json; charset=utf-8"})
        assert typed.status_code == 200, typed.text


async def test_a_large_prompt_is_tokenized_off_the_event_loop(url, backend):
    """A prompt that takes the tokenizer a second or more (and then turns out too long) must not
    hold up a small request sent after it: the small one is answered first."""
    large = {"text": "hello world, this is a test of things. " * 25000}  # ~1M chars, > max_model_len tokens: a 400
    small = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    done: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def post(name: str, body: dict) -> int:
            response = await client.post("/generate", json=body)
            done.append(name)
            return response.status_code

        slow = asyncio.create_task(post("large", large))
        await asyncio.sleep(0.2)  # the large one is being tokenized by now (it takes ~0.6 s on an idle core)
        assert await post("small", small) == 200
        assert await slow == 400
    assert done == ["small", "large"]


async def test_wrong_json_types_are_refused_not_converted(url, backend):
    cases = [("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "10"}}, "sampling_params.max_new_tokens"),
             ("/v1/completions", {"prompt": "hi", "n": 1.0}, "n"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content")]  # fmt: skip
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for path, body, param in cases:
            response = await client.post(path, json=body)
            assert response.status_code == 400, (path, response.text)
            assert response.json()["error"]["param"] == param, response.text
