"""Bad input -> HTTP 400 with an OpenAI-style body naming the field; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.timeout(60)

LONG = [5] * 32768

CASES = [
    ("/generate", {"text": 3}, "text"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"min_p": 2}}, "sampling_params.min_p"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [99999]}}, "sampling_params.stop_token_ids"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ("/generate", {"text": "hi", "return_logprob": True, "token_ids_logprob": [2048]}, "token_ids_logprob"),
    ("/generate", {"text": "hi", "return_flat_raw_top_logprobs_b64": True}, "return_flat_raw_top_logprobs_b64"),
    ("/generate", {"input_ids": [1, 2, 5000]}, "input_ids"),
    ("/generate", {"input_ids": [-1]}, "input_ids"),
    ("/generate", {"input_ids": LONG}, "input_ids"),
    ("/generate", {"text": ""}, "text"),
    ("/generate", {}, "text"),
    ("/generate", {"text": "a", "input_ids": [1]}, "text"),
    ("/generate", {"text": ["a", "b"], "stream": True}, "stream"),
    ("/generate", {"text": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    # above the wire's bound: before, it passed here and the scheduler's decoder dropped the request
    ("/v1/completions", {"prompt": "hi", "temperature": 5.03e16}, "temperature"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": 1e7}}, "sampling_params.temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ["a", 1]}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
]


async def test_bad_input_gets_400_naming_the_field(url, backend):
    async with httpx.AsyncClient(base_url=url) as client:
        for path, body, param in CASES:
            response = await client.post(path, json=body)
            assert response.status_code == 400, (path, body, response.text)
            error = response.json()["error"]
            assert error["param"] == param, (path, body, error)
            assert error["type"] == "invalid_request_error" and error["code"] is None and error["message"]
        malformed = await client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
        ok = await client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert malformed.status_code == 400 and "error" in malformed.json()
    assert ok.status_code == 200
    assert backend.requests and len(backend.requests) == 1  # no bad request reached the scheduler


def test_every_bound_of_the_wire_types_is_a_400_naming_the_field():
    """The net under the hand-written checks: what the receiver's typed decoder would refuse."""
    from contracts.detokenizer import DetokenizeParams
    from contracts.scheduler import LogprobParams, SamplingParams
    from services.tokenizer.invalid import InvalidRequest
    from services.tokenizer.validation import wire_checked

    names = {"temperature": "sampling_params.temperature", "stop": "sampling_params.stop"}
    cases = [
        (SamplingParams(temperature=2e6), "sampling_params.temperature", "<= 1000000.0"),
        (DetokenizeParams(stop=("x" * 5000,)), "sampling_params.stop", "length <= 1024"),
        (LogprobParams(top_logprobs_num=10**5), "top_logprobs_num", "<= 4096"),
    ]
    for message, param, problem in cases:
        with pytest.raises(InvalidRequest) as refused:
            wire_checked(message, names)
        assert refused.value.param == param and problem in refused.value.message
    assert wire_checked(SamplingParams(temperature=0.7), names) == SamplingParams(temperature=0.7)
