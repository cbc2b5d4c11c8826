"""Replicas leaving (PRODUCT §6): a detokenizer, tokenizer or scheduler that gets SIGTERM while
requests are in flight finishes them before it exits, so no token or character is lost; new
requests go to the replicas that stay. (Own stack: these tests stop services.)"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import pytest

from e2e.stack import Stack, generate_body, start_replicas

PROMPTS = ["def add(a, b):", "import os\n", "class Foo:"]
NUM_TOKENS = 400
DRAIN_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, list[str]]]:
    # Two schedulers share 2 CPU cores here: give the drains room, so the tests check that they
    # finish what they hold, not how fast this machine is.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPARKWIRE_DRAIN_TIMEOUT_S", str(DRAIN_TIMEOUT_S))
        stack, urls = start_replicas(tmp_path_factory.mktemp("leave-logs"), schedulers=2)
    yield stack, urls
    stack.stop()


def long_body(prompt: str, stream: bool) -> dict:
    body = generate_body(prompt, max_new_tokens=NUM_TOKENS, stream=stream)
    body["sampling_params"]["ignore_eos"] = True
    return body


async def solo(client: httpx.AsyncClient, url: str, prompt: str) -> dict:
    response = await client.post(f"{url}/generate", json=long_body(prompt, stream=False))
    assert response.status_code == 200, response.text
    return response.json()


async def stream(client: httpx.AsyncClient, url: str, prompt: str, started: asyncio.Event) -> list:
    events: list = []
    async with client.stream("POST", f"{url}/generate", json=long_body(prompt, stream=True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                started.set()
    return events


async def streams_while(stack: Stack, url: str, leaving: str) -> tuple[list[list], list[dict]]:
    """Twelve concurrent streams through `url`; once they have all begun, SIGTERM `leaving`."""
    async with httpx.AsyncClient(timeout=120) as client:
        alone = [await solo(client, url, prompt) for prompt in PROMPTS]
        starts = [asyncio.Event() for _ in range(4 * len(PROMPTS))]
        tasks = [asyncio.create_task(stream(client, url, PROMPTS[i % len(PROMPTS)], started))
                 for i, started in enumerate(starts)]  # fmt: skip
        await asyncio.wait_for(asyncio.gather(*(started.wait() for started in starts)), 60)
        stopping = asyncio.create_task(asyncio.to_thread(stack.services[leaving].stop, DRAIN_TIMEOUT_S + 30))
        results = await asyncio.gather(*tasks)
        await stopping
    return results, alone


def assert_complete(results: list[list], alone: list[dict]) -> None:
    for index, events in enumerate(results):
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert "error" not in last, last
        expected = alone[index % len(PROMPTS)]
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        assert (last["text"], last["output_ids"]) == (expected["text"], expected["output_ids"])
        assert len(last["output_ids"]) == NUM_TOKENS


def assert_drained(stack: Stack, name: str, service: str) -> None:
    """The replica logged a drain that held requests, and finished before its drain timeout."""
    log = stack.services[name].log_path.read_text()
    held = re.search(rf"{service}.draining.*num_running=(\d+)", log)
    assert held is not None and f"{service}.drain_timeout" not in log
    # The queue group spreads the 12 requests; that none reached this replica has odds 1/4096.
    assert int(held.group(1)) > 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("service", ["detokenizer", "scheduler"])
async def test_a_replica_that_leaves_mid_stream_finishes_what_it_holds(replicas, service):
    """Its queue group sends new requests to the other replica; its own requests finish."""
    stack, urls = replicas
    leaving = f"{service}-0"
    results, alone = await streams_while(stack, urls[0], leaving=leaving)
    assert_complete(results, alone)
    assert stack.services[leaving].process.returncode == 0
    assert_drained(stack, leaving, service)
    async with httpx.AsyncClient(timeout=60) as client:  # the other replica takes everything now
        again = await solo(client, urls[0], PROMPTS[0])
    assert again["text"] == alone[0]["text"]


@pytest.mark.timeout(240)
async def test_a_tokenizer_that_leaves_mid_stream_finishes_its_streams(replicas):
    stack, urls = replicas
    results, alone = await streams_while(stack, urls[1], leaving="tokenizer-1")
    assert_complete(results, alone)
    assert stack.services["tokenizer-1"].process.returncode == 0
    with pytest.raises(httpx.ConnectError):  # gone: it takes no new connections
        httpx.get(f"{urls[1]}/health", timeout=2)
    async with httpx.AsyncClient(timeout=60) as client:  # the other tokenizer still serves
        again = await solo(client, urls[0], PROMPTS[1])
    assert again["text"] == alone[1]["text"]
