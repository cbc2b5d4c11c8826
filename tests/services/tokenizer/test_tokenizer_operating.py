"""Operating the tokenizer (issue 14): metrics after a known mix of requests, the request id in
and out, unexpected errors in the documented shape, and the API key on every route."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.lifecycle import wait_until
from services.common.logging import REQUEST_ID_HEADER
from services.tokenizer.api_types import ChatBody, CompletionBody, GenerateBody, SamplingParamsBody
from services.tokenizer.http_app import ROUTE_HANDLERS
from services.tokenizer.validation import choice_seed, unsupported_fields
from services.tokenizer.text_model import TextModel
from tests.services.tokenizer.conftest import base_url, wait_live
from tests.services.tokenizer.test_tokenizer_service import sse_payloads

pytestmark = pytest.mark.timeout(30)
MODEL = (("model_name", "sparkwire-tiny"),)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def generate(max_new_tokens: int, **extra) -> dict:
    return {"text": "hi", "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}, **extra}


async def leave_mid_stream(client: httpx.AsyncClient) -> None:
    async with client.stream("POST", "/generate", json=generate(64, stream=True)) as response:
        async for _line in response.aiter_lines():
            break


async def test_metrics_count_a_known_mix_of_requests(url, backend):
    backend.tokens_per_step = 2
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.post("/generate", json=generate(3))).status_code == 200
        streamed = await client.post("/generate", json=generate(4, stream=True))
        completion = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2})
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
        assert (await client.get("/nope/123")).status_code == 404
        backend.step_delay_s = 0.3
        await leave_mid_stream(client)
        assert await wait_until(lambda: len(backend.aborts) == 1, 3.0)
        await asyncio.sleep(0.05)
        page = (await client.get("/metrics")).text
    assert len(sse_payloads(streamed.text)) == 2 and completion.status_code == 200
    got = samples(page)
    finished = 3 + 4 + 2 * 2 + 2
    assert got[("sparkwire:tokenizer_requests_finished_total", (("finished_reason", "length"), *MODEL))] == 5
    assert got[("sparkwire:tokenizer_requests_finished_total", (("finished_reason", "abort"), *MODEL))] == 1
    assert got[("sparkwire:tokenizer_generation_tokens_total", MODEL)] == finished + 2  # the leaver got one step
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_placement_time_seconds"):
        assert got[(f"sparkwire:{histogram}_count", MODEL)] == 6, histogram
        assert got[(f"sparkwire:{histogram}_sum", MODEL)] > 0, histogram
    assert got[("sparkwire:inter_token_latency_seconds_count", MODEL)] == 1 + 1 + 0 + 0  # 2-token steps
    assert got[("sparkwire:http_requests_total", (("handler", "/generate"), ("method", "POST"), ("status", "200")))] == 3
    assert got[("sparkwire:http_requests_total", (("handler", "<unmatched>"), ("method", "GET"), ("status", "404")))] == 1
    assert "/nope/123" not in page  # raw paths never become labels


async def test_request_id_in_and_out(url, backend):
    async with httpx.AsyncClient(base_url=url) as client:
        given = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "trace-7"})
        made = await client.post("/generate", json=generate(2))
    assert given.headers["x-request-id"] == "trace-7"
    assert given.json()["id"] == "cmpl-trace-7"
    assert backend.requests[0].rid.startswith("trace-7-")
    assert backend.request_headers[0][REQUEST_ID_HEADER] == "trace-7"
    made_id = made.headers["x-request-id"]
    assert len(made_id) == 32 and made.json()["meta_info"]["id"] == made_id
    assert backend.request_headers[1][REQUEST_ID_HEADER] == made_id


async def test_same_client_rid_from_two_clients_never_mixes(url, backend):
    backend.step_delay_s = 0.05
    body = generate(6, rid="shared")
    async with httpx.AsyncClient(base_url=url) as one, httpx.AsyncClient(base_url=url) as two:
        first, second = await asyncio.gather(one.post("/generate", json=body), two.post("/generate", json=body))
    assert first.status_code == second.status_code == 200
    assert first.json()["meta_info"]["id"] == second.json()["meta_info"]["id"] == "shared"  # the client's label
    assert first.json()["output_ids"] == second.json()["output_ids"]
    assert len(first.json()["output_ids"]) == 6
    rids = [request.rid for request in backend.requests]
    assert len(set(rids)) == 2  # distinct on the wire


async def test_reused_rid_after_a_disconnect_is_not_hit_by_the_old_abort(url, backend):
    backend.step_delay_s = 0.2
    async with httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/generate", json=generate(64, stream=True, rid="again")) as response:
            async for _line in response.aiter_lines():
                break
        backend.step_delay_s = 0.0
        reused = await client.post("/generate", json=generate(3, rid="again"))
    assert reused.status_code == 200 and len(reused.json()["output_ids"]) == 3
    assert await wait_until(lambda: len(backend.aborts) == 1, 3.0)
    assert backend.aborts[0].rid == backend.requests[0].rid != backend.requests[1].rid


async def test_a_bad_x_request_id_is_a_400_naming_it(url):
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/generate", json=generate(2), headers={"X-Request-Id": "has space"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "X-Request-Id"


async def test_an_unexpected_error_is_a_logged_500_in_the_error_shape(url, monkeypatch, capsys):
    def broken(*_args, **_kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(TextModel, "encode", broken)
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/tokenize", json={"prompt": "x"}, headers={"X-Request-Id": "bug-1"})
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "internal_error" and response.json()["error"]["code"] == 500
    assert response.headers["x-request-id"] == "bug-1"
    out = capsys.readouterr()
    line = next(line for line in (out.out + out.err).splitlines() if "http.unexpected_error" in line)
    assert "bug-1" in line and "boom" in line


# ---- the API key ----

KEY = "sk-test-123"
BODIES = {
    "/generate": generate(2),
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "hi"},
    "/v1/tokenize": {"messages": [{"role": "user", "content": "hi"}]},
    "/detokenize": {"tokens": [5]},
    "/v1/detokenize": {"tokens": [5]},
    "/update_weights_from_disk": {"model_path": "/checkpoints/step-1"},
}


def all_routes() -> list[tuple[str, str]]:
    return sorted((method, path) for handler in ROUTE_HANDLERS for path in handler.paths for method in handler.http_methods)


PATH_PARAMS = {"{model_id:path}": "sparkwire-tiny"}  # the served model's name


async def call(client: httpx.AsyncClient, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    url = path
    for template, value in PATH_PARAMS.items():
        url = url.replace(template, value)
    return await client.request(method, url, json=BODIES.get(path), headers=headers)


async def test_api_key_guards_every_route_but_health_and_metrics(start_tokenizer, backend):
    routes = all_routes()
    assert len(routes) >= 9
    async with start_tokenizer(api_key=KEY) as frontend, httpx.AsyncClient(base_url=base_url(frontend)) as client:
        await wait_live(frontend)
        for method, path in routes:
            missing = await call(client, method, path, {})
            wrong = await call(client, method, path, {"Authorization": "Bearer nope"})
            right = await call(client, method, path, {"Authorization": f"Bearer {KEY}"})
            if path in ("/health", "/metrics"):
                assert missing.status_code == 200, path
                continue
            assert missing.status_code == wrong.status_code == 401, path
            assert missing.json()["error"]["code"] == "invalid_api_key" and missing.headers["www-authenticate"] == "Bearer"
            assert right.status_code == 200, (path, right.text)


async def test_metrics_can_require_the_key_too(start_tokenizer, backend):
    async with start_tokenizer(api_key=KEY, metrics_require_api_key=True) as frontend:
        await wait_live(frontend)
        async with httpx.AsyncClient(base_url=base_url(frontend)) as client:
            assert (await client.get("/metrics")).status_code == 401
            assert (await client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})).status_code == 200
            assert (await client.get("/health")).status_code == 200



# ---- no silent ignoring ----

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


def unsupported_cases() -> list[tuple[str, dict, str]]:
    """(path, body, param the 400 must name) for every declared unsupported field."""
    cases = [("/generate", generate(2) | {name: True}, name) for name in unsupported_fields(GenerateBody)]
    for name in unsupported_fields(SamplingParamsBody):
        body = generate(2)
        body["sampling_params"][name] = {"x": 1}
        cases.append(("/generate", body, f"sampling_params.{name}"))
    cases += [("/v1/completions", COMPLETION | {name: {"x": 1}}, name) for name in unsupported_fields(CompletionBody)]
    cases += [("/v1/chat/completions", CHAT | {name: {"x": 1}}, name) for name in unsupported_fields(ChatBody)]
    return cases


async def test_every_unsupported_result_changing_parameter_is_a_400_naming_it(url, backend):
    cases = unsupported_cases()
    assert {"guided_json", "functions", "stop_regex", "structural_tag"} <= {param.split(".")[-1] for _, _, param in cases}
    async with httpx.AsyncClient(base_url=url) as client:
        for path, body, param in cases:
            response = await client.post(path, json=body)
            assert response.status_code == 400, (path, param, response.text)
            assert response.json()["error"]["param"] == param, (path, param)
    assert backend.requests == []  # none of them reached a scheduler


async def test_neutral_values_of_unsupported_fields_are_accepted(url, backend):
    neutral = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "best_of": 1}
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/chat/completions", json=CHAT | neutral)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
async def test_an_unknown_model_is_a_404_in_openai_shape(url, path):
    body = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/tokenize": {"prompt": "hi"}}[path]
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post(path, json=body | {"model": "gpt-17"})
        served = await client.post(path, json=body | {"model": "sparkwire-tiny"})
    assert response.status_code == 404 and served.status_code == 200
    assert response.json()["error"] == {
        "message": "The model `gpt-17` does not exist.", "type": "invalid_request_error", "param": "model",
        "code": "model_not_found",
    }  # fmt: skip


async def test_penalties_logit_bias_and_min_tokens_reach_the_scheduler(url, backend):
    native = generate(4)
    native["sampling_params"] |= {"frequency_penalty": 0.5, "presence_penalty": -0.25, "repetition_penalty": 1.2,
                                  "min_new_tokens": 2, "logit_bias": {"7": 5.0, "3": -100}}  # fmt: skip
    openai_body = COMPLETION | {"frequency_penalty": 0.5, "presence_penalty": -0.25, "repetition_penalty": 1.2,
                                "min_tokens": 2, "logit_bias": {"7": 5.0, "3": -100}}  # fmt: skip
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.post("/generate", json=native)).status_code == 200
        assert (await client.post("/v1/completions", json=openai_body)).status_code == 200
        assert (await client.post("/v1/chat/completions", json=CHAT | openai_body)).status_code == 200
    for request in backend.requests:
        sampling = request.sampling
        assert (sampling.frequency_penalty, sampling.presence_penalty, sampling.repetition_penalty) == (0.5, -0.25, 1.2)
        assert sampling.min_new_tokens == 2 and sampling.logit_bias == ((3, -100.0), (7, 5.0))


async def test_min_tokens_with_stop_strings_reaches_the_detokenizer(url, backend):
    native = generate(4)
    native["sampling_params"] |= {"min_new_tokens": 3, "stop": ["x"]}
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.post("/generate", json=native)).status_code == 200
        assert (await client.post("/v1/completions", json=COMPLETION | {"min_tokens": 2, "stop": "x"})).status_code == 200
        assert (await client.post("/v1/chat/completions", json=CHAT | {"min_tokens": 1, "stop": ["x"]})).status_code == 200
    assert [(r.params.min_tokens, r.params.stop) for r in backend.registrations] == [(3, ("x",)), (2, ("x",)), (1, ("x",))]
    assert [r.sampling.min_new_tokens for r in backend.requests] == [3, 2, 1]  # stop ids and EOS: the scheduler


@pytest.mark.parametrize(
    ("field", "value"),
    [("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0), ("min_tokens", 99),
     ("logit_bias", {"abc": 1}), ("logit_bias", {"999999": 1}), ("logit_bias", {"5": 101})],
)  # fmt: skip
async def test_out_of_range_penalties_are_400s(url, field, value):
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/completions", json=COMPLETION | {field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field


async def test_n_choices_get_distinct_seeds_derived_from_the_call_seed(url, backend):
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/completions", json=COMPLETION | {"n": 3, "seed": 11, "temperature": 1.0})
    assert [c["index"] for c in response.json()["choices"]] == [0, 1, 2]
    seeds = [request.sampling.seed for request in backend.requests]
    assert seeds == [11, choice_seed(11, 1), choice_seed(11, 2)] and len(set(seeds)) == 3
