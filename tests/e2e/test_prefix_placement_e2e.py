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


FEWSHOT = "".join(f"Question: what is {a} plus {b}?\nAnswer: {a + b}\n\n" for a, b in ((2, 3), (7, 1), (4, 4), (9, 6), (5, 8)))
ITEMS = [(f"Question: what is {a} plus {b}?\nAnswer:", [f" {a + b + d}" for d in (-1, 0, 1, 2)]) for a, b in ((3, 3), (6, 2), (8, 7))]


async def loglikelihood(client: httpx.AsyncClient, url: str, context: str, continuation: str) -> tuple[float, int]:
    """What lm-evaluation-harness's local-completions asks: the prompt echoed with its logprobs;
    the continuation's tokens' sum, and the prompt tokens found cached."""
    body = {"prompt": context + continuation, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    response = await client.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    logprobs = answer["choices"][0]["logprobs"]
    picked = [value for value, offset in zip(logprobs["token_logprobs"], logprobs["text_offset"]) if offset >= len(context)]
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return sum(picked[:-1]), cached  # the last is the generated token's


@pytest.mark.timeout(150)
async def test_multiple_choice_scores_are_the_same_cached_and_cold(two_schedulers):
    """A few-shot multiple-choice task scored the harness's way: with the cache (the shared context
    computed once a scheduler) and cold (every cache flushed before each request), the same scores."""
    _stack, url = two_schedulers
    pairs = [(FEWSHOT + question, choice) for question, choices in ITEMS for choice in choices]
    async with httpx.AsyncClient(timeout=60) as client:
        cold = []
        for context, choice in pairs:
            assert (await client.post(f"{url}/flush_cache")).status_code == 200
            await asyncio.sleep(0.2)
            cold.append(await loglikelihood(client, url, context, choice))
        await asyncio.sleep(1.0)  # summaries of what the last cold request left
        cached = [await loglikelihood(client, url, context, choice) for context, choice in pairs]
    assert sum(hit for _, hit in cached) > 0
    assert [score for score, _ in cached] == pytest.approx([score for score, _ in cold], abs=1e-4)
    per_item = [[score for score, _ in cached[i * 4 : i * 4 + 4]] for i in range(len(ITEMS))]
    assert [max(range(4), key=scores.__getitem__) for scores in per_item] == [
        max(range(4), key=[score for score, _ in cold[i * 4 : i * 4 + 4]].__getitem__) for i in range(len(ITEMS))]
