"""The official `openai` client against the tokenizer's OpenAI endpoints (stand-in backend)."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(30)

REPLY = "Hello world, this is a reply."


@pytest.fixture
def client(url):
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_completion_echo_logprobs(client, text_model):
    prompt = "The café is open"
    result = await client.completions.create(model="sparkwire-tiny", prompt=prompt, max_tokens=5, logprobs=3, echo=True)
    choice = result.choices[0]
    prompt_ids = text_model.encode(prompt)
    output_ids = text_model.encode(REPLY)[:5]
    assert choice.text == prompt + text_model.decode(output_ids)
    lp = choice.logprobs
    n = len(prompt_ids) + 5
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert all(len(row) == 3 for row in lp.top_logprobs[1:])
    # each token's text starts at its offset (ASCII tokens) and offsets never go back
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        if token.startswith("bytes:"):  # a piece of a multi-byte character: that character's offset
            assert choice.text[offset] == "é"
        else:
            assert choice.text[offset : offset + len(token)] == token
    assert lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[len(prompt_ids)] == len(prompt)
    assert result.usage.prompt_tokens == len(prompt_ids) and result.usage.completion_tokens == 5


async def test_completion_extra_body_and_ids_prompt(client):
    result = await client.completions.create(
        model="sparkwire-tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, n=2, extra_body={"top_k": 5, "unknown_field": 1}
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert all(c.logprobs is None and c.finish_reason == "length" for c in result.choices)
    assert result.usage.prompt_tokens == 5


async def test_completion_stream_matches_non_stream(client):
    kwargs = dict(model="sparkwire-tiny", prompt="Say hi", max_tokens=8, logprobs=2, echo=True)
    plain = (await client.completions.create(**kwargs)).choices[0]
    chunks = [c async for c in await client.completions.create(stream=True, **kwargs)]
    text = "".join(c.choices[0].text for c in chunks)
    assert text == plain.text
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert offsets == plain.logprobs.text_offset
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_chat_logprobs(client, text_model):
    result = await client.chat.completions.create(
        model="sparkwire-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, logprobs=True, top_logprobs=2
    )
    choice = result.choices[0]
    assert choice.message.content == text_model.decode(text_model.encode(REPLY)[:6])
    content = choice.logprobs.content
    assert len(content) == 6
    for item in content:
        assert bytes(item.bytes).decode() == item.token
        assert len(item.top_logprobs) == 2 and all(isinstance(t.bytes, list) for t in item.top_logprobs)
    assert "".join(item.token for item in content) == choice.message.content


async def test_chat_stream(client):
    stream = await client.chat.completions.create(
        model="sparkwire-tiny", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=6, stream=True, logprobs=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(i.token for c in chunks if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content)
    assert chunks[-1].usage.completion_tokens == 6


async def test_chat_template_reaches_scheduler(url, backend, text_model):
    async with httpx.AsyncClient(base_url=url) as http:
        await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    sent = text_model.decode(list(backend.requests[-1].input_ids.data.cast("i")), skip_special_tokens=False)
    assert sent == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


async def test_openai_client_sees_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model="sparkwire-tiny", prompt="hi", logprobs=21)
    assert info.value.body["param"] == "logprobs"
