"""`n` > 1 on the tokenizer alone (scripted backend): one claim and one GenerateRequest carry a
prompt's choices to a scheduler that forks them; an older scheduler (no `forks` in its reply)
gets choice 0, the others as requests of their own. /v1 and /generate (`sampling_params.n`)."""

from __future__ import annotations

import httpx
import pytest

from services.tokenizer.validation import MAX_N, choice_seed
from tests.services.tokenizer.conftest import REPLY_TEXT
from tests.services.tokenizer.test_tokenizer_service import sse_payloads

pytestmark = pytest.mark.timeout(30)
COMPLETION = {"prompt": "hi", "max_tokens": 64, "n": 3, "seed": 11, "temperature": 1.0}
NATIVE = {"text": "hi", "sampling_params": {"max_new_tokens": 64, "n": 3, "seed": 11, "temperature": 1.0}}
SEEDS = [11, choice_seed(11, 1), choice_seed(11, 2)]


def _seeds(backend) -> list[int]:
    return [r.sampling.seed for r in backend.requests] + [c.seed for r in backend.requests for c in r.choices]


async def test_forking_scheduler_gets_one_claim_and_one_request_with_the_choices(url, backend):
    backend.forks = True
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/completions", json=COMPLETION | {"prompt": ["hi", "there"]})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6)) and all(c["text"] for c in choices)
    assert len(backend.claims) == 2 and [len(c.choices) for c in backend.claims] == [2, 2]  # one per prompt
    assert len(backend.requests) == 2 and all(len(r.choices) == 2 for r in backend.requests)
    assert [r.sampling.seed for r in backend.requests] == [11, 11]
    assert [[c.seed for c in r.choices] for r in backend.requests] == [SEEDS[1:], SEEDS[1:]]
    assert len({c.rid for r in backend.requests for c in r.choices} | {r.rid for r in backend.requests}) == 6
    assert len(backend.registrations) == 6  # every choice has its detokenizer state


async def test_an_older_scheduler_gets_the_choices_as_requests_of_their_own(url, backend):
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/completions", json=COMPLETION)
    assert [c["index"] for c in response.json()["choices"]] == [0, 1, 2]
    assert len(backend.requests) == 3 and all(r.choices == () for r in backend.requests)
    assert _seeds(backend) == SEEDS


@pytest.mark.parametrize("forks", [True, False])
async def test_generate_n_answers_a_list_of_n_outputs(url, backend, forks):
    backend.forks = forks
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/generate", json=NATIVE | {"rid": "mine"})
    assert response.status_code == 200, response.text
    outputs = response.json()
    assert isinstance(outputs, list) and len(outputs) == 3
    assert [o["meta_info"]["id"] for o in outputs] == ["mine-0", "mine-1", "mine-2"]
    assert all(o["text"] == REPLY_TEXT and o["meta_info"]["finish_reason"]["type"] == "length" for o in outputs)
    assert sorted(_seeds(backend)) == sorted(SEEDS)
    assert len(backend.requests) == (1 if forks else 3)


async def test_generate_n_1_keeps_one_object_and_a_batch_with_n_is_prompt_major(url, backend):
    backend.forks = True
    async with httpx.AsyncClient(base_url=url) as client:
        single = await client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "n": 1}})
        batch = await client.post("/generate", json={"text": ["a", "b"], "rid": ["x", "y"], "sampling_params": {"max_new_tokens": 2, "n": 2}})
    assert isinstance(single.json(), dict)
    assert [o["meta_info"]["id"] for o in batch.json()] == ["x-0", "x-1", "y-0", "y-1"]


async def test_generate_n_streamed_events_carry_their_index(url, backend):
    backend.forks = True
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/generate", json=NATIVE | {"stream": True})
    events = sse_payloads(response.text)
    assert {e["index"] for e in events} == {0, 1, 2}
    for index in range(3):
        mine = [e for e in events if e["index"] == index]
        assert mine[-1]["text"] == REPLY_TEXT and mine[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert all(len(a["output_ids"]) <= len(b["output_ids"]) for a, b in zip(mine, mine[1:]))  # cumulative


@pytest.mark.parametrize("n", [0, MAX_N + 1])
async def test_generate_n_out_of_range_is_a_400(url, backend, n):
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/generate", json={"text": "hi", "sampling_params": {"n": n}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "sampling_params.n"
    assert backend.requests == []


async def test_a_failed_claim_of_a_forked_call_leaves_nothing_behind(url, backend, tokenizer):
    backend.forks, backend.claim_error = True, "no room at all"
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 400
    assert len(tokenizer.service.pending) == 0 and backend.requests == []
