"""The NATS server restarting while streams are running (own stack: this test kills the server).

Core NATS loses what was in flight. Each stream must then either complete with exactly the
tokens a quiet run gives, or fail with a clear error: never end early looking complete.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from e2e.stack import generate_body
from services.common.nats_server import start_nats_server

NUM_STREAMS = 4
MAX_NEW_TOKENS = 200


def body() -> dict:
    request = generate_body(max_new_tokens=MAX_NEW_TOKENS, stream=True)
    request["sampling_params"]["ignore_eos"] = True
    return request


async def stream(client: httpx.AsyncClient, url: str, started: asyncio.Event) -> list:
    events: list = []
    async with client.stream("POST", f"{url}/generate", json=body()) as response:
        if response.status_code != 200:  # submitted while the server was down: 503 with an error body
            return [json.loads(await response.aread())]
        async for line in response.aiter_lines():
            if line.startswith("data:") and (payload := line.removeprefix("data:").strip()) != "[DONE]":
                events.append(json.loads(payload))
                started.set()
    return events


def outcome(events: list, reference: list[int]) -> str:
    """"complete" (all tokens, equal to the quiet run), "failed" (an error event or an abort with
    a message) or "short" (what must never happen: an early end that looks complete)."""
    last = events[-1] if events else {}
    finish = last.get("meta_info", {}).get("finish_reason") or {}
    if "error" in last or (finish.get("type") == "abort" and finish.get("message")):
        return "failed"
    return "complete" if last.get("output_ids") == reference else "short"


@pytest.mark.timeout(180)
async def test_streams_complete_or_fail_clearly_when_the_nats_server_restarts(stack):
    url = stack.base_url
    async with httpx.AsyncClient(timeout=90) as client:
        quiet = await client.post(f"{url}/generate", json=body() | {"stream": False})
        reference = quiet.json()["output_ids"]
        assert len(reference) == MAX_NEW_TOKENS
        started = asyncio.Event()
        streams = [asyncio.create_task(stream(client, url, started)) for _ in range(NUM_STREAMS)]
        await asyncio.wait_for(started.wait(), 30)
        port = stack.nats.port
        stack.nats.kill()
        stack.nats = start_nats_server(port=port)
        results = await asyncio.wait_for(asyncio.gather(*streams), 120)
    outcomes = [outcome(events, reference) for events in results]
    assert "short" not in outcomes, outcomes
    stack.raise_if_dead()
