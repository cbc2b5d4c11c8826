"""Replicas (PRODUCT §6): two tokenizers and two detokenizers on one scheduler. Every request
gets exactly its own text, whichever replicas served it, and the same text as when run alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from e2e.stack import Stack, generate_body, health_status, start_replicas

PROMPTS = ["def add(a, b):", "import os\n", "class Foo:", "for i in range(", "# the answer is", "x = [1, 2,",
           "while True:", "return None"]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, list[str]]]:
    stack, urls = start_replicas(tmp_path_factory.mktemp("replica-logs"))
    yield stack, urls
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
