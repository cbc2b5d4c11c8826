"""`sparkwire bench serve` piece by piece, without a server: workload, event parsing, figures."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ops.bench.serve import ServeConfig, TextProgress
from ops.bench.serve_client import CompletionsEndpoint, EventFigures, NativeEndpoint, RequestOptions, RequestRecord
from ops.bench.serve_launch import up_command
from ops.bench.serve_metrics import distribution, inter_token_latencies, summarize, time_per_output_token
from ops.bench.serve_workload import Prompt, arrival_offsets, jsonl_prompts, random_prompts, token_pool
from services.models import BUNDLED_MODEL


def record(times: list[float], tokens: list[int], e2e: float, asked: int | None = None, error: str = "") -> RequestRecord:
    prompt = Prompt((1, 2, 3), None, asked or sum(tokens) or 1)
    result = RequestRecord(prompt, prompt_tokens=3, error=error, e2e=e2e)
    for at, count in zip(times, tokens, strict=True):
        result.add(EventFigures(count), at)
    return result


def test_a_multi_token_event_counts_as_that_many_equal_gaps():
    one = record([0.1, 0.3, 0.6], [1, 1, 3], e2e=0.7)
    assert inter_token_latencies(one) == pytest.approx([0.2, 0.1, 0.1, 0.1])
    assert sum(inter_token_latencies(one)) == pytest.approx(0.6 - one.ttft)
    assert one.ttft == 0.1 and one.output_tokens == 5
    assert time_per_output_token(one) == pytest.approx((0.7 - 0.1) / 4)
    assert time_per_output_token(record([0.2], [1], e2e=0.3)) is None  # one token: no TPOT


def test_tokens_of_the_first_event_have_no_gap():
    assert inter_token_latencies(record([0.1, 0.4], [3, 1], e2e=0.5)) == pytest.approx([0.3])


def test_summary_leaves_failed_requests_out_of_latencies_and_totals():
    fast, slow = record([0.1, 0.2], [1, 1], e2e=0.25), record([0.3, 0.7], [1, 1], e2e=0.8)
    failed = record([], [], e2e=0.05, asked=2, error="HTTP 500")
    summary = summarize([fast, slow, failed], duration_s=2.0)
    assert (summary["completed"], summary["failed"], summary["errors"]) == (2, 1, ["HTTP 500"])
    assert summary["total_output_tokens"] == 4 and summary["total_input_tokens"] == 6
    assert summary["output_throughput"] == pytest.approx(2.0) and summary["request_throughput"] == pytest.approx(1.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0) and summary["ttft_ms"]["min"] == pytest.approx(100.0)
    assert summary["e2el_ms"]["max"] == pytest.approx(800.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(250.0)  # gaps 100 and 400 ms
    assert summary["mean_concurrency"] == pytest.approx(1.05 / 2.0)


def test_distribution_percentiles_are_ordered_and_in_milliseconds():
    figures = distribution(list(np.random.default_rng(3).exponential(0.05, size=500)))
    ordered = [figures[k] for k in ("min", "p50", "p90", "p99", "max")]
    assert ordered == sorted(ordered) and ordered[0] < ordered[-1]
    assert 40 < figures["mean"] < 60  # 0.05 s mean -> ~50 ms
    assert distribution([]) == dict.fromkeys(figures)


def test_poisson_arrivals_have_the_asked_rate_and_burstiness_spreads_them():
    assert not arrival_offsets(5, math.inf, 1.0, seed=0).any()  # a burst: all due at once
    poisson = np.diff(arrival_offsets(4001, 10.0, 1.0, seed=0))
    regular = np.diff(arrival_offsets(4001, 10.0, 4.0, seed=0))
    assert poisson.mean() == pytest.approx(0.1, rel=0.05) and regular.mean() == pytest.approx(0.1, rel=0.05)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.1)  # gamma CV = 1 / sqrt(shape)
    assert regular.std() / regular.mean() == pytest.approx(0.5, rel=0.1)
    assert arrival_offsets(10, 3.0, 1.0, seed=1).tolist() == arrival_offsets(10, 3.0, 1.0, seed=1).tolist()


def test_random_prompts_have_the_asked_lengths_and_no_special_tokens():
    pool = token_pool(BUNDLED_MODEL)
    assert not np.isin([0, 1, 2, 3], pool).any() and pool.max() < 4096  # the bundled tokenizer's specials
    exact = random_prompts(20, 16, 5, 0.0, pool, seed=0)
    assert {len(p.input_ids) for p in exact} == {16} and {p.output_len for p in exact} == {5}
    assert not set().union(*(p.input_ids for p in exact)) & {0, 1, 2, 3}
    spread = random_prompts(200, 16, 10, 0.5, pool, seed=0)
    assert {len(p.input_ids) for p in spread} <= set(range(8, 25)) and len({len(p.input_ids) for p in spread}) > 5
    assert random_prompts(3, 16, 5, 0.0, pool, seed=1) != random_prompts(3, 16, 5, 0.0, pool, seed=2)


def test_jsonl_prompts_take_text_or_ids_and_their_own_lengths(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "def f():"}\n\n{"input_ids": [5, 6], "output_len": 3}\n{"prompt": "x"}\n')
    first, second = jsonl_prompts(path, num=2, output_len=8)
    assert (first.text, first.input_ids, first.output_len) == ("def f():", None, 8)
    assert (second.text, second.input_ids, second.output_len) == (None, (5, 6), 3)
    path.write_text(json.dumps({"prompt": "a", "input_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        jsonl_prompts(path, num=1, output_len=8)


def test_native_events_count_new_ids_of_the_cumulative_output():
    endpoint = NativeEndpoint()
    body = endpoint.body(Prompt((7, 8), None, 4), RequestOptions(ignore_eos=True, logprobs=2))
    assert body["input_ids"] == [7, 8] and body["sampling_params"]["max_new_tokens"] == 4
    assert body["sampling_params"]["ignore_eos"] and body["top_logprobs_num"] == 2 and body["stream"]
    assert "logprob_start_len" not in body  # output logprobs only, the server's default
    prompt_too = endpoint.body(Prompt((7, 8), None, 4), RequestOptions(logprobs=2, prompt_logprobs=True))
    assert prompt_too["logprob_start_len"] == 0 and prompt_too["return_logprob"]
    event = {"text": "ab", "output_ids": [3, 4, 5], "meta_info": {"prompt_tokens": 2}}
    assert endpoint.read(event, tokens_so_far=1) == EventFigures(2, 2, 3)
    assert endpoint.read({"error": {"message": "boom"}}, 0).error == "boom"


def test_completions_events_count_logprob_tokens_and_read_usage():
    endpoint = CompletionsEndpoint()
    body = endpoint.body(Prompt(None, "hi", 4), RequestOptions(model_name="m"))
    assert body["prompt"] == "hi" and body["max_tokens"] == 4 and body["model"] == "m"
    assert body["stream_options"] == {"include_usage": True} and "ignore_eos" not in body and "logprobs" not in body
    with_logprobs = {"choices": [{"text": "a b", "logprobs": {"tokens": ["a", " b"]}}]}
    assert endpoint.read(with_logprobs, 0).new_tokens == 2
    assert endpoint.read({"choices": [{"text": ""}]}, 0).new_tokens == 1  # no logprobs: one token per event
    usage = endpoint.read({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}, 3)
    assert usage == EventFigures(0, 9, 4)


def test_settings_are_checked_and_recorded_without_the_api_key():
    with pytest.raises(ValueError, match="endpoint"):
        ServeConfig(endpoint="chat")
    with pytest.raises(ValueError, match="request_rate"):
        ServeConfig(request_rate=0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        ServeConfig(endpoint="completions", logprobs=2, prompt_logprobs=True)
    recorded = ServeConfig(api_key="secret").as_json()
    assert recorded["api_key"] == "(set)" and recorded["request_rate"] == "inf" and json.dumps(recorded)


def test_launch_takes_host_and_port_from_the_base_url():
    command = up_command(["--device", "cpu"], "http://127.0.0.1:8123")
    assert command[-6:] == ["--host", "127.0.0.1", "--port", "8123", "--device", "cpu"]
    with pytest.raises(ValueError, match="--port"):
        up_command(["--port=9"], "http://127.0.0.1:8123")
    with pytest.raises(ValueError, match="port"):
        up_command([], "http://127.0.0.1")


def test_the_plain_progress_line_counts_to_the_total(capsys):
    bar = TextProgress(total=4)
    for _ in range(4):
        bar.update(1)
    bar.close()
    last = capsys.readouterr().err.split("\r")[-1]
    assert last.strip() == f"[{'#' * TextProgress.WIDTH}] 4/4 requests"


class _Chunks:
    """A stand-in for aiohttp's StreamReader: `iter_any` yields the chunks given."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def iter_any(self):
        for chunk in self.chunks:
            yield chunk


async def test_sse_lines_joins_lines_split_across_chunks_of_any_length():
    from ops.bench.serve_client import sse_lines

    big = b"data: " + b"7" * (3 << 20)  # a 3 MiB event, in 1 KiB pieces
    pieces = [big[i : i + 1024] for i in range(0, len(big), 1024)]
    chunks = [b"data: {\"a\": 1}\n\nda", b"ta: 2\n", *pieces, b"\n\ndata: [DONE]"]
    lines = [line async for line in sse_lines(_Chunks(chunks))]
    assert lines == [b'data: {"a": 1}', b"", b"data: 2", big, b"", b"data: [DONE]"]
