"""Issue 14 end to end: every service's /metrics after a known mix of requests (plain, streamed,
preempted, aborted, speculative), and one request id followed through the JSON logs of all three
services.

Its own stack: JSON logs, metrics ports, DSpark speculative decoding (a one-layer drafter with
dummy weights, so drafts are proposed and some accepted) and a KV cache small enough that four
long requests at once must preempt.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e.stack import Service, Stack, generate_body, service_argv
from services.common.nats_server import free_port, start_nats_server
from services.models import BUNDLED_MODEL
from services.scheduler.model.config import ModelConfig
from services.scheduler.spec.dspark_config import draft_config_for_target

pytestmark = pytest.mark.timeout(120)

MODEL = (("model_name", BUNDLED_MODEL.name),)  # the stack serves the default model
NUM_PARALLEL, PARALLEL_TOKENS = 4, 60  # 4 x (prompt + 60) tokens > the 12 x 16 KV slots
FOLLOWED_ID = "follow-me-42"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


class OperatedStack(Stack):
    metrics_ports: dict[str, int]


def dummy_drafter(directory: Path) -> Path:
    """A DSpark draft config for the bundled target (weights: `--load-format dummy`)."""
    target = ModelConfig.from_pretrained(BUNDLED_MODEL)
    config = draft_config_for_target(target, num_draft_layers=1, mask_token_id=2047, block_size=4, markov_rank=4)
    (directory / "config.json").write_text(json.dumps(config.to_dict()))
    return directory


@pytest.fixture(scope="module")
def operated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatedStack]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPARKWIRE_LOG_FORMAT", "json")
        stack = OperatedStack(start_nats_server(), tmp_path_factory.mktemp("operating-logs"))
        stack.metrics_ports = {"scheduler": free_port(), "detokenizer": free_port()}
        draft = dummy_drafter(tmp_path_factory.mktemp("drafter"))
        extra = {
            "scheduler": ["--num-kv-blocks", "12", "--kv-block-size", "16", "--speculative-algorithm", "dspark",
                          "--draft-model", str(draft), "--load-format", "dummy"],  # fmt: skip
            "detokenizer": [],
            "tokenizer": ["--port", str(stack.port)],
        }
        try:
            for name in ("scheduler", "detokenizer", "tokenizer"):
                metrics = ["--metrics-port", str(stack.metrics_ports[name])] if name in stack.metrics_ports else []
                argv = service_argv(name, stack.nats.url, *extra[name], *metrics)
                stack.services[name] = Service.start(name, argv, stack.log_dir)
            stack.wait_healthy()
        except BaseException:
            stack.stop()
            raise
    yield stack
    stack.stop()


def post_generate(stack: Stack, max_new_tokens: int, **extra: object) -> httpx.Response:
    body = generate_body(max_new_tokens=max_new_tokens, **extra)
    body["sampling_params"]["ignore_eos"] = True
    return httpx.post(f"{stack.base_url}/generate", json=body, timeout=60)


def leave_mid_stream(stack: Stack) -> None:
    body = generate_body(max_new_tokens=150, stream=True)
    body["sampling_params"]["ignore_eos"] = True
    with httpx.stream("POST", f"{stack.base_url}/generate", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break


def scrape(stack: OperatedStack) -> dict[str, dict]:
    urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in stack.metrics_ports.items()}
    urls["tokenizer"] = f"{stack.base_url}/metrics"
    return {name: samples(httpx.get(url, timeout=5).text) for name, url in urls.items()}


def wait_for(condition, timeout_s: float = 10.0) -> None:
    """Until `condition()` or the deadline; the assertions after it say what is missing."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


def aborts_counted(got: dict[str, dict]) -> list[float | None]:
    """Aborted requests as scheduler, detokenizer and tokenizer counted them: the abort's finish
    passes them in that order, so the later ones count it a little later."""
    abort = ("sparkwire:request_success_total", (("finished_reason", "abort"), *MODEL))
    detokenizer_abort = ("sparkwire:detokenizer_requests_finished_total", (("finished_reason", "abort"),))
    tokenizer_abort = ("sparkwire:tokenizer_requests_finished_total", (("finished_reason", "abort"), *MODEL))
    return [got["scheduler"].get(abort), got["detokenizer"].get(detokenizer_abort), got["tokenizer"].get(tokenizer_abort)]


def test_every_service_exports_metrics_of_a_known_mix(operated: OperatedStack) -> None:
    with concurrent.futures.ThreadPoolExecutor(NUM_PARALLEL) as pool:
        parallel = list(pool.map(lambda _: post_generate(operated, PARALLEL_TOKENS), range(NUM_PARALLEL)))
    streamed = httpx.post(f"{operated.base_url}/generate", json=generate_body(max_new_tokens=8, stream=True), timeout=30)
    leave_mid_stream(operated)
    assert all(r.status_code == 200 for r in parallel) and streamed.status_code == 200, operated.logs()
    finished_tokens = sum(r.json()["meta_info"]["completion_tokens"] for r in parallel)
    streamed_tokens = json.loads(streamed.text.split("data: ")[-2])["meta_info"]["completion_tokens"]
    wait_for(lambda: aborts_counted(scrape(operated)) == [1, 1, 1])
    got = scrape(operated)
    scheduler, detokenizer, tokenizer = got["scheduler"], got["detokenizer"], got["tokenizer"]
    assert aborts_counted(got) == [1, 1, 1]
    assert finished_tokens == NUM_PARALLEL * PARALLEL_TOKENS

    length = lambda reason: ("sparkwire:request_success_total", (("finished_reason", reason), *MODEL))  # noqa: E731
    assert scheduler[length("length")] == NUM_PARALLEL + (1 if streamed_tokens == 8 else 0)
    assert scheduler[("sparkwire:num_preemptions_total", MODEL)] > 0
    assert scheduler[("sparkwire:prefix_cache_queries_total", MODEL)] > 0  # no n > 1, prompts under a block: no hits
    assert scheduler[("sparkwire:prefix_cache_hits_total", MODEL)] == 0
    assert scheduler[("sparkwire:generation_tokens_total", MODEL)] > finished_tokens + streamed_tokens
    assert scheduler[("sparkwire:iteration_tokens_total_count", MODEL)] > 0
    assert scheduler[("sparkwire:request_queue_time_seconds_count", MODEL)] == NUM_PARALLEL + 2  # once each
    assert scheduler[("sparkwire:request_queue_time_seconds_sum", MODEL)] > 0
    assert ("sparkwire:request_queue_time_seconds_count", MODEL) not in tokenizer  # the front end's is placement
    assert scheduler[("sparkwire:num_requests_running", MODEL)] == 0
    assert scheduler[("sparkwire:num_requests_waiting", MODEL)] == 0
    assert scheduler[("sparkwire:kv_cache_usage_perc", MODEL)] == 0  # everything finished: all blocks free
    drafted = scheduler[("sparkwire:spec_decode_num_draft_tokens_total", MODEL)]
    assert drafted > 0 and 0 <= scheduler[("sparkwire:spec_decode_num_accepted_tokens_total", MODEL)] <= drafted

    assert detokenizer[("sparkwire:detokenizer_registrations_total", ())] == NUM_PARALLEL + 2
    assert detokenizer[("sparkwire:detokenizer_tokens_total", ())] == scheduler[("sparkwire:generation_tokens_total", MODEL)]

    assert tokenizer[("sparkwire:tokenizer_requests_finished_total", (("finished_reason", "length"), *MODEL))] >= NUM_PARALLEL
    assert ("sparkwire:request_success_total", (("finished_reason", "length"), *MODEL)) not in tokenizer  # the scheduler's
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_placement_time_seconds"):
        assert tokenizer[(f"sparkwire:{histogram}_count", MODEL)] == NUM_PARALLEL + 2, histogram
        assert tokenizer[(f"sparkwire:{histogram}_sum", MODEL)] > 0, histogram
    gaps = tokenizer[("sparkwire:inter_token_latency_seconds_count", MODEL)]  # one per delivery after the first
    assert NUM_PARALLEL <= gaps <= NUM_PARALLEL * (PARALLEL_TOKENS - 1) + streamed_tokens + 150  # spec: several tokens each
    for name, page in got.items():  # every service's NATS traffic, in messages, chunks and bytes
        for direction in ("sent", "received"):
            label = (("direction", direction),)
            messages, chunks = page[("sparkwire:nats_messages_total", label)], page[("sparkwire:nats_chunks_total", label)]
            assert 0 < messages <= chunks < page[("sparkwire:nats_bytes_total", label)], (name, direction)
    generate_200 = ("sparkwire:http_requests_total", (("handler", "/generate"), ("method", "POST"), ("status", "200")))
    assert tokenizer[generate_200] == NUM_PARALLEL + 2  # streamed ones included


# Each process's own NATS traffic, by direction: summed over every service kind they count each
# message once per sender and once per receiver, never one event twice, as process_* metrics do.
PER_PROCESS_TRANSPORT = {"sparkwire:nats_messages", "sparkwire:nats_chunks", "sparkwire:nats_bytes"}


def family_names(stack: OperatedStack) -> dict[str, set[str]]:
    urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in stack.metrics_ports.items()}
    urls["tokenizer"] = f"{stack.base_url}/metrics"
    return {kind: {f.name for f in text_string_to_metric_families(httpx.get(url, timeout=5).text)} for kind, url in urls.items()}


def test_no_metric_name_is_exported_by_two_service_kinds(operated: OperatedStack) -> None:
    """vLLM's engine counters (tokens, finished requests) are the scheduler's alone; the front end's
    own counts of the same requests carry `tokenizer_` names, the detokenizer's `detokenizer_`."""
    names = family_names(operated)
    shared = {name for kind in names for other in names if other < kind for name in names[kind] & names[other]}
    assert shared == PER_PROCESS_TRANSPORT, shared
    for vllm_engine_counter in ("sparkwire:prompt_tokens", "sparkwire:generation_tokens", "sparkwire:request_success"):
        assert [kind for kind in names if vllm_engine_counter in names[kind]] == ["scheduler"], vllm_engine_counter
    assert "sparkwire:tokenizer_requests_finished" in names["tokenizer"]


def json_lines(path: Path) -> list[dict]:
    """The JSON lines the service wrote so far; a line still being written (no newline yet) is left."""
    complete = path.read_text(errors="replace").split("\n")[:-1]
    return [json.loads(raw) for raw in complete if raw.startswith("{")]


FOLLOWED_EVENTS = {
    "scheduler": {"scheduler.request_added"},
    "detokenizer": {"detokenizer.registered", "detokenizer.finished"},
    "tokenizer": {"request.finished"},
}
ACCESS_LINE = "POST /generate"  # in the event of uvicorn's access line, as JSON


def missing_followed_events(stack: Stack) -> dict[str, set[str]]:
    """Per service, what no JSON log line with FOLLOWED_ID has (yet): FOLLOWED_EVENTS, the access line."""
    missing = {}
    for name, wanted in FOLLOWED_EVENTS.items():
        events = {line["event"] for line in json_lines(stack.services[name].log_path) if line.get("request_id") == FOLLOWED_ID}
        absent = wanted - events
        if name == "tokenizer" and not any(ACCESS_LINE in event for event in events):
            absent.add(ACCESS_LINE)
        if absent:
            missing[name] = absent
    return missing


def test_one_request_id_through_all_three_services_and_the_response(operated: OperatedStack) -> None:
    response = post_generate(operated, 5, **{})
    followed = httpx.post(
        f"{operated.base_url}/generate", json=generate_body(max_new_tokens=5), headers={"X-Request-Id": FOLLOWED_ID},
        timeout=30,
    )  # fmt: skip
    assert response.status_code == followed.status_code == 200
    assert followed.headers["x-request-id"] == FOLLOWED_ID and followed.json()["meta_info"]["id"] == FOLLOWED_ID
    # Some lines are written after the response went out (the detokenizer's finish, uvicorn's access
    # line) and can reach the log files after the client has its answer: wait for them.
    wait_for(lambda: not missing_followed_events(operated))
    for name, service in operated.services.items():
        assert json_lines(service.log_path), f"{name} wrote no JSON lines"
    assert missing_followed_events(operated) == {}


def completions(stack: Stack, **body: object) -> dict:
    response = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": "def add(a, b):", **body}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_n_samples_are_distinct_and_each_reproducible_with_its_seed(operated: OperatedStack) -> None:
    sampled = {"max_tokens": 8, "temperature": 1.0, "seed": 1234}
    first, again = completions(operated, n=3, **sampled), completions(operated, n=3, **sampled)
    texts = [choice["text"] for choice in first["choices"]]
    assert texts == [choice["text"] for choice in again["choices"]]  # reproducible
    assert len(set(texts)) == 3  # distinct
    alone = completions(operated, n=1, **sampled)["choices"][0]["text"]
    assert alone == texts[0]  # choice 0 is the n=1 answer of the same seed


def test_logit_bias_changes_the_output_through_the_stack(operated: OperatedStack) -> None:
    body = {"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "logit_bias": {"7": 100}}}
    forced = httpx.post(f"{operated.base_url}/generate", json=body, timeout=30).json()
    assert forced["output_ids"] == [7] * 6  # the penalties' exact effect is tested in the scheduler core


def test_min_tokens_holds_stop_strings_back_through_the_stack(operated: OperatedStack) -> None:
    """vLLM's min_tokens with a stop string, on the speculative stack (steps may bring several
    tokens): the stop inside the first min_tokens tokens is text, the first one after ends it."""
    from tokenizers import Tokenizer

    def sampled(**params: object) -> dict:
        body = generate_body(max_new_tokens=32)
        body["sampling_params"] |= {"ignore_eos": True, **params}
        response = httpx.post(f"{operated.base_url}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    free = sampled()
    min_tokens = 10
    protected = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json")).decode(free["output_ids"][:min_tokens])
    assert free["text"].startswith(protected)
    stop = next(c for c in protected if c in free["text"][len(protected) :])  # occurs before and after
    early = sampled(stop=[stop])
    held = sampled(stop=[stop], min_new_tokens=min_tokens)
    assert early["text"] == free["text"][: free["text"].index(stop)]
    assert held["text"] == free["text"][: free["text"].index(stop, len(protected))]
    assert held["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert min_tokens < held["meta_info"]["completion_tokens"] == len(held["output_ids"])
