"""Replicas (PRODUCT §6): two tokenizers and two detokenizers on one scheduler. Every request
gets exactly its own text, whichever replicas served it, and the same text as when run alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from e2e.stack import Service, Stack, generate_body, health_status, service_argv
from services.common.nats_server import free_port, start_nats_server

PROMPTS = ["def add(a, b):", "import os\n", "class Foo:", "for i in range(", "# the answer is", "x = [1, 2,",
           "while True:", "return None"]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, list[str]]]:
    log_dir = tmp_path_factory.mktemp("replica-logs")
    stack = Stack(start_nats_server(), log_dir)
    urls = []
    try:
        stack.start("scheduler")
        for index in range(2):
            port = free_port()
            for name, extra in (("detokenizer", ()), ("tokenizer", ("--port", str(port)))):
                argv = service_argv(name, stack.nats.url, *extra)
                stack.services[f"{name}-{index}"] = Service.start(f"{name}-{index}", argv, log_dir)
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            stack.port = int(url.rsplit(":", 1)[1])
            stack.wait_healthy()
        yield stack, urls
    finally:
        stack.stop()


async def generate_all(pairs: list[tuple[str, str]]) -> list[dict]:
    async with httpx.AsyncClient(timeout=60) as client:
        responses = await asyncio.gather(
            *(client.post(f"{url}/generate", json=generate_body(prompt, max_new_tokens=12)) for url, prompt in pairs)
        )
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


@pytest.mark.timeout(120)
async def test_every_request_gets_its_own_text_across_replicas(replicas):
    stack, urls = replicas
    assert all(health_status(url) == 200 for url in urls)
    alone = [(await generate_all([(urls[0], prompt)]))[0] for prompt in PROMPTS]
    # All at once, alternating tokenizers; detokenizers are picked by the queue group.
    together = await generate_all([(urls[i % 2], prompt) for i, prompt in enumerate(PROMPTS * 2)])
    for index, result in enumerate(together):
        solo = alone[index % len(PROMPTS)]
        assert (result["text"], result["output_ids"]) == (solo["text"], solo["output_ids"])
    stack.raise_if_dead()
