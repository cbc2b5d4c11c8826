"""The scheduler restarting and dying under the tokenizer's feet (own stack: these tests kill it)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from e2e.stack import generate, generate_body, health_status

FAIL_WITHIN_S = 5.0


@pytest.mark.timeout(120)
def test_greedy_output_survives_a_scheduler_restart(stack):
    before = generate(stack)
    stack.services["scheduler"].stop()
    stack.start("scheduler")
    stack.wait_healthy()
    after = generate(stack)
    assert (after["text"], after["output_ids"]) == (before["text"], before["output_ids"])


def long_body(stream: bool) -> dict:
    body = generate_body(max_new_tokens=4000, stream=stream)
    body["sampling_params"]["ignore_eos"] = True  # keep it running until the kill
    return body


async def stream_until_killed(client: httpx.AsyncClient, url: str, started: asyncio.Event) -> list:
    events: list = []
    async with client.stream("POST", f"{url}/generate", json=long_body(stream=True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                payload = line.removeprefix("data:").strip()
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                if len(events) >= 2:
                    started.set()
    return events


def failed_clearly(response: httpx.Response) -> bool:
    """An error status with a message, or a 200 whose finish reason says abort with a message."""
    if response.status_code >= 500:
        return bool(response.json().get("error") or response.json().get("message") or response.text)
    finish = response.json()["meta_info"]["finish_reason"]
    return finish["type"] == "abort"


@pytest.mark.timeout(120)
async def test_sigkill_of_the_scheduler_fails_requests_fast(stack):
    url = stack.base_url
    started = asyncio.Event()
    async with httpx.AsyncClient(timeout=60) as client:
        streaming = asyncio.create_task(stream_until_killed(client, url, started))
        blocking = asyncio.create_task(client.post(f"{url}/generate", json=long_body(stream=False)))
        await asyncio.wait_for(started.wait(), 30)  # both requests are being decoded now
        stack.services["scheduler"].kill()
        killed_at = time.monotonic()

        events, response = await asyncio.wait_for(asyncio.gather(streaming, blocking), FAIL_WITHIN_S + 1)
        assert time.monotonic() - killed_at < FAIL_WITHIN_S
        last = next(event for event in reversed(events) if event != "[DONE]")
        assert last.get("error") or last["meta_info"]["finish_reason"]["type"] == "abort", last
        assert last.get("error") or last["meta_info"]["completion_tokens"] < 4000
        assert failed_clearly(response), response.text

        asked_at = time.monotonic()
        fresh = await client.post(f"{url}/generate", json=generate_body(), timeout=FAIL_WITHIN_S + 1)
        assert time.monotonic() - asked_at < FAIL_WITHIN_S
        assert fresh.status_code == 503 and "scheduler" in fresh.text.lower(), fresh.text

    deadline = killed_at + FAIL_WITHIN_S
    while health_status(url) != 503 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert health_status(url) == 503
