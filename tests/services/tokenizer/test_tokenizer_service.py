"""The tokenizer service alone over a real nats-server and its real HTTP port, against the
scripted stand-in scheduler/detokenizer of conftest.py."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest

from services.common.arrays import from_wire
from services.common.lifecycle import wait_until

pytestmark = pytest.mark.timeout(30)

REPLY = "Hello world, this is a reply."


def sse_payloads(body: str) -> list:
    lines = [line[len("data: ") :] for line in body.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def test_generate_non_stream(url, backend, text_model):
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/generate", json={"text": "Say hi", "sampling_params": {"max_new_tokens": 64, "temperature": 0}})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["text"] == REPLY
    assert body["output_ids"] == text_model.encode(REPLY)
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == len(text_model.encode("Say hi"))
    assert meta["completion_tokens"] == len(body["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "matched": None}
    assert "output_token_logprobs" not in meta
    sent = backend.requests[-1]
    assert from_wire(sent.input_ids).tolist() == text_model.encode("Say hi")
    assert sent.sampling.temperature == 0 and sent.detokenizer_id == "detok-1"


async def test_stream_concatenation_equals_non_stream(url):
    body = {"text": "Say hi", "sampling_params": {"max_new_tokens": 64}}
    async with httpx.AsyncClient(base_url=url) as client:
        plain = (await client.post("/generate", json=body)).json()
        response = await client.post("/generate", json=body | {"stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(response.text)
    assert len(events) > 1
    assert events[-1]["text"] == plain["text"]  # cumulative
    assert events[-1]["output_ids"] == plain["output_ids"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(events, events[1:]))
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert events[0]["meta_info"]["finish_reason"] is None


async def test_stream_logprobs_carry_only_new_entries(url):
    body = {"text": "Say hi", "stream": True, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    async with httpx.AsyncClient(base_url=url) as client:
        events = sse_payloads((await client.post("/generate", json=body)).text)
        plain = (await client.post("/generate", json=body | {"stream": False})).json()
    streamed = [t for e in events for t in e["meta_info"]["output_token_logprobs"]]
    assert streamed == plain["meta_info"]["output_token_logprobs"]
    assert len(streamed) == plain["meta_info"]["completion_tokens"]
    prompt = [t for e in events for t in e["meta_info"]["input_token_logprobs"]]
    assert prompt == plain["meta_info"]["input_token_logprobs"]


async def test_streamed_flat_arrays_ride_only_the_event_that_carries_them(url):
    body = {"text": "Say hi", "stream": True, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
            "return_flat_raw_top_logprobs": True}  # fmt: skip
    async with httpx.AsyncClient(base_url=url) as client:
        events = sse_payloads((await client.post("/generate", json=body)).text)
        plain = (await client.post("/generate", json=body | {"stream": False})).json()
    carrying = [e["meta_info"] for e in events if "input_top_logprobs_shape" in e["meta_info"]]
    assert len(events) > 1 and len(carrying) == 1
    assert all("input_top_logprobs_val_flat" not in e["meta_info"] for e in events if e["meta_info"] is not carrying[0])
    for key in ("input_top_logprobs_shape", "input_top_logprobs_null_prefix", "input_top_logprobs_val_flat"):
        assert carrying[0][key] == plain["meta_info"][key]


async def test_batch_text_returns_list(url):
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/generate", json={"text": ["a", "bb"], "sampling_params": {"max_new_tokens": 3}})
    bodies = response.json()
    assert isinstance(bodies, list) and len(bodies) == 2
    assert all(b["meta_info"]["completion_tokens"] == 3 for b in bodies)
    assert bodies[0]["meta_info"]["id"] != bodies[1]["meta_info"]["id"]


async def test_no_scheduler_gives_503_at_once(start_tokenizer):
    async with start_tokenizer() as frontend, httpx.AsyncClient(base_url=f"http://127.0.0.1:{frontend.config.port}") as client:
        began = time.monotonic()
        response = await client.post("/generate", json={"text": "hi"})
        health = await client.get("/health")
    assert response.status_code == 503
    assert time.monotonic() - began < 1.5
    assert "detokenizer" in response.json()["error"]["message"] or "scheduler" in response.json()["error"]["message"]
    assert health.status_code == 503


async def test_claim_refused_gives_400(url, backend):
    backend.claim_error = "prompt too long for this scheduler"
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/generate", json={"text": "hi"})
    assert response.status_code == 400
    assert "too long" in response.json()["error"]["message"]


@pytest.mark.parametrize("how", ["dead_sentinel", "silence"])
async def test_pending_request_fails_fast_when_scheduler_dies(url, backend, how):
    backend.hang = True
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        call = asyncio.create_task(client.post("/generate", json={"text": "hi"}))
        stream = asyncio.create_task(client.post("/generate", json={"text": "hi", "stream": True}))
        while len(backend.requests) < 2:
            await asyncio.sleep(0.01)
        began = time.monotonic()
        await (backend.die() if how == "dead_sentinel" else backend.go_silent())
        response, streamed = await call, await stream
    assert time.monotonic() - began < 5
    assert response.status_code == 503
    assert response.json()["error"]["message"].startswith("request failed")
    events = sse_payloads(streamed.text)
    assert "error" in events[-1]
    assert await wait_until(lambda: {a.rid for a in backend.aborts} >= {r.rid for r in backend.requests}, 3.0)


async def test_client_disconnect_mid_stream_aborts(url, backend):
    backend.step_delay_s = 0.3
    async with httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/generate", json={"text": "hi", "stream": True, "rid": "leaver"}) as response:
            async for _line in response.aiter_lines():
                break
    assert await wait_until(lambda: len(backend.aborts) > 0, 3.0)
    assert [a.rid for a in backend.aborts] == [backend.requests[-1].rid]


async def test_health_tokenize_detokenize_models_openapi_metrics(url, text_model):
    async with httpx.AsyncClient(base_url=url) as client:
        health = await client.get("/health")
        tokens = (await client.post("/tokenize", json={"prompt": "Hello world"})).json()
        text = (await client.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
        bad = await client.post("/detokenize", json={"tokens": [999999]})
        models = (await client.get("/v1/models")).json()
        one = await client.get("/v1/models/sparkwire-tiny")
        other = await client.get("/v1/models/gpt-4")
        schema = (await client.get("/openapi.json")).json()
        await client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        metrics = (await client.get("/metrics")).text
    assert health.status_code == 200 and health.json()["scheduler_id"] == "sched-1"
    assert tokens == {"tokens": text_model.encode("Hello world"), "count": len(tokens["tokens"]), "max_model_len": 32768}
    assert text == {"prompt": "Hello world"}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert models["data"][0]["id"] == "sparkwire-tiny"
    assert one.status_code == 200 and one.json() == models["data"][0]  # the OpenAI client's models.retrieve
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert "/generate" in schema["paths"] and "/v1/completions" in schema["paths"]
    assert 'sparkwire:http_requests_total{handler="/generate",method="POST",status="200"} 1.0' in metrics
    assert 'sparkwire:tokenizer_generation_tokens_total{model_name="sparkwire-tiny"} 2.0' in metrics


async def test_health_503_when_no_scheduler_answers_pings(start_tokenizer):
    async with start_tokenizer() as frontend, httpx.AsyncClient() as client:
        began = time.monotonic()
        response = await client.get(f"http://127.0.0.1:{frontend.config.port}/health")
    assert response.status_code == 503
    assert time.monotonic() - began < 2.5


async def test_logprob_arrays_reach_the_response(url, text_model):
    body = {"input_ids": [5, 6, 7, 8], "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2,
            "token_ids_logprob": [10, 11], "sampling_params": {"max_new_tokens": 4}}
    async with httpx.AsyncClient(base_url=url) as client:
        meta = (await client.post("/generate", json=body)).json()["meta_info"]
    assert meta["prompt_tokens"] == 1 + len(meta["input_token_logprobs"])
    assert [t[1] for t in meta["input_token_logprobs"]] == [6, 7, 8]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 4
    assert len(meta["input_top_logprobs"][0]) == 2 and meta["input_token_ids_logprobs"][0][1][1] == 11
    assert np.isclose(meta["input_token_logprobs"][0][0], -((1 * 7) % 97) / 10.0 - 0.05)


@pytest.mark.parametrize("b64", [False, True])
async def test_flat_raw_prompt_top_logprobs(url, backend, b64):
    import pybase64

    ids = [5, 6, 7, 8, 9]
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
            "return_flat_raw_top_logprobs": True, "return_flat_raw_top_logprobs_b64": b64, "sampling_params": {"max_new_tokens": 2}}
    async with httpx.AsyncClient(base_url=url) as client:
        meta = (await client.post("/generate", json=body)).json()["meta_info"]
        nested = (await client.post("/generate", json=body | {"return_flat_raw_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False})).json()["meta_info"]
    assert backend.requests[0].logprobs.flat_prompt_top_logprobs and not backend.requests[1].logprobs.flat_prompt_top_logprobs
    assert "input_top_logprobs" not in meta and len(meta["output_top_logprobs"]) == 2
    assert meta["input_top_logprobs_shape"] == [4, 3] and meta["input_top_logprobs_null_prefix"] == 1
    if b64:
        values = np.frombuffer(pybase64.b64decode(meta["input_top_logprobs_val_flat_b64"]), "<f4").tolist()
        idx = np.frombuffer(pybase64.b64decode(meta["input_top_logprobs_idx_flat_b64"]), "<i4").tolist()
    else:
        values, idx = meta["input_top_logprobs_val_flat"], meta["input_top_logprobs_idx_flat"]
    rows = nested["input_top_logprobs"]
    assert rows[0] is None
    assert idx == [t[1] for row in rows[1:] for t in row]
    assert np.allclose(values, [t[0] for row in rows[1:] for t in row])
