"""Cache-aware placement (real processes, real NATS): two schedulers behind one tokenizer. Requests
of 8 prefix groups land on the scheduler that caches their prefix (seen in `meta_info.cached_tokens`),
and POST /flush_cache empties every scheduler's cache."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from e2e.stack import Stack, generate_body, start_replicas

GROUPS = [f"Group {g}: " + " ".join(f"fact {g}.{i} is {i * g % 7}." for i in range(14)) for g in range(8)]


@pytest.fixture(scope="module")
def two_schedulers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    stack, urls = start_replicas(tmp_path_factory.mktemp("placement-logs"), count=1, schedulers=2)
    yield stack, urls[0]
    stack.stop()


async def generate_all(url: str, texts: list[str]) -> list[dict]:
    async with httpx.AsyncClient(timeout=60) as client:
        responses = await asyncio.gather(*(client.post(f"{url}/generate", json=generate_body(t, max_new_tokens=4)) for t in texts))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


@pytest.mark.timeout(150)
async def test_requests_land_on_the_scheduler_holding_their_prefix(two_schedulers):
    stack, url = two_schedulers
    seeds = await generate_all(url, [group + " Q: seed?" for group in GROUPS])  # each group cached on one scheduler
    prefix_tokens = min(s["meta_info"]["prompt_tokens"] for s in seeds) // 16 * 16 - 16
    await asyncio.sleep(1.5)  # the summaries (every 0.5 s) name the holders
    texts = [group + f" Q: number {i}?" for i in range(3) for group in GROUPS]
    results = await generate_all(url, texts)
    on_holder = sum(r["meta_info"]["cached_tokens"] >= prefix_tokens for r in results)
    assert on_holder >= 0.9 * len(results), [r["meta_info"]["cached_tokens"] for r in results]

    async with httpx.AsyncClient(timeout=30) as client:
        flushed = await client.post(f"{url}/flush_cache")
    assert flushed.status_code == 200
    time.sleep(0.5)
    again = await generate_all(url, [GROUPS[0] + " Q: seed?"])
    assert again[0]["meta_info"]["cached_tokens"] == 0  # nothing was cached on either scheduler any more
    stack.raise_if_dead()
