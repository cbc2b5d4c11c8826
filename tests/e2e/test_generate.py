"""POST /generate through the whole stack on the bundled model."""

from __future__ import annotations

import json

import httpx
import pytest

from e2e.stack import Stack, generate_body

pytestmark = pytest.mark.timeout(60)


def generate(stack: Stack, **body: object) -> dict:
    response = httpx.post(f"{stack.base_url}/generate", json=generate_body(**body), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_generate_returns_text_and_meta_info(stack):
    result = generate(stack)
    meta = result["meta_info"]
    assert isinstance(result["text"], str) and result["text"]
    assert meta["prompt_tokens"] > 0
    assert 0 < meta["completion_tokens"] <= 16
    assert meta["completion_tokens"] == len(result["output_ids"])
    assert meta["finish_reason"]["type"] in ("stop", "length")
    if meta["finish_reason"]["type"] == "length":
        assert meta["completion_tokens"] == 16


def test_greedy_output_is_identical_across_requests(stack):
    first, second = generate(stack), generate(stack)
    assert (first["text"], first["output_ids"]) == (second["text"], second["output_ids"])


def sse_events(stack: Stack, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{stack.base_url}/generate", json=body, timeout=30) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                payload = line.removeprefix("data:").strip()
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_stream_text_adds_up_to_the_non_stream_text(stack):
    full = generate(stack)
    events = sse_events(stack, generate_body(stream=True))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks, "no SSE data events before [DONE]"
    # PRODUCT §3: `text` and `output_ids` in each event are cumulative so far.
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]


def test_bad_input_is_a_400_naming_the_field(stack):
    response = httpx.post(f"{stack.base_url}/generate", json={"text": "x", "sampling_params": {"max_new_tokens": -1}}, timeout=10)
    assert response.status_code == 400
    assert "max_new_tokens" in response.text
    assert generate(stack)["meta_info"]["completion_tokens"] > 0  # the stack is still fine
