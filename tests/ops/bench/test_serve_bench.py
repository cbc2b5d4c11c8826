"""`sparkwire bench serve` at a tiny size against the real stack (bundled model, CPU), so the
benchmark cannot rot: the figures in its JSON must agree with what was asked and with each other."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ops.bench.serve import ServeConfig, run_serve_benchmark
from ops.bench.serve_launch import launched_stack
from services.common.nats_server import free_port

ROOT = Path(__file__).resolve().parents[3]
LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms")


def assert_consistent(results: dict[str, Any], num: int, input_len: int | None, output_len: int) -> None:
    """Counts and token totals as asked (ignore_eos), per-request times ordered, summary = rows."""
    rows = results["requests"]
    assert (results["completed"], results["failed"], len(rows)) == (num, 0, num), results["errors"]
    assert results["total_output_tokens"] == num * output_len and results["output_len_mismatches"] == 0
    if input_len is not None:
        assert results["total_input_tokens"] == num * input_len
    assert results["total_input_tokens"] == sum(row["prompt_tokens"] for row in rows)
    for row in rows:
        assert row["output_tokens"] == row["asked_output_tokens"] == output_len
        assert 0 < row["ttft_s"] <= row["last_token_s"] <= row["e2e_s"] <= results["duration_s"]
        assert row["itl_sum_s"] == pytest.approx(row["last_token_s"] - row["ttft_s"], abs=1e-9)
    for name in LATENCIES:
        figures = results[name]
        assert figures["min"] <= figures["p50"] <= figures["p90"] <= figures["p99"] <= figures["max"], (name, figures)
        assert figures["min"] <= figures["mean"] <= figures["max"], (name, figures)
    assert results["ttft_ms"]["max"] <= results["e2el_ms"]["max"] and results["ttft_ms"]["mean"] <= results["e2el_ms"]["mean"]
    assert results["e2el_ms"]["max"] == pytest.approx(1000 * max(row["e2e_s"] for row in rows))
    assert results["output_throughput"] == pytest.approx(results["total_output_tokens"] / results["duration_s"])
    assert results["request_throughput"] == pytest.approx(num / results["duration_s"])


@pytest.mark.timeout(90)
def test_cli_launches_the_stack_and_writes_consistent_figures(tmp_path):
    out = tmp_path / "serve.json"
    command = [sys.executable, "-m", "services.cli", "bench", "serve", "--launch", "--up-args=--device cpu",
               "--base-url", f"http://127.0.0.1:{free_port()}", "--up-log", str(tmp_path / "up.log"),
               "--num-prompts", "6", "--input-len", "12", "--output-len", "5", "--ignore-eos",
               "--request-rate", "60", "--burstiness", "0.5", "--max-concurrency", "3", "--out", str(out), "--no-progress"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stdout + done.stderr + (tmp_path / "up.log").read_text()[-3000:]
    results = json.loads(out.read_text())
    assert_consistent(results, num=6, input_len=12, output_len=5)
    assert results["launched"]["exit_code"] == 0 and results["launched"]["up_args"] == ["--device", "cpu"]
    assert "| output tok/s |" in done.stdout
    client_cpu_s = results["client_cpu_s"]
    assert client_cpu_s > 0 and results["client_cpu_fraction"] == pytest.approx(client_cpu_s / results["duration_s"])
    assert results["config"]["request_rate"] == 60 and results["config"]["max_concurrency"] == 3


@pytest.mark.timeout(90)
def test_openai_endpoint_with_logprobs_and_varied_lengths(tmp_path):
    config = ServeConfig(
        base_url=f"http://127.0.0.1:{free_port()}", endpoint="completions", num_prompts=5, input_len=10,
        output_len=4, ignore_eos=True, logprobs=2, num_warmups=1, max_concurrency=2, progress=False,
    )  # fmt: skip
    with launched_stack(["--device", "cpu"], config.base_url, tmp_path / "up.log") as stack:
        results = run_serve_benchmark(config)
        varied = run_serve_benchmark(dataclasses.replace(config, endpoint="generate", range_ratio=0.5, seed=3, prompt_logprobs=True))
    assert stack.exit_code == 0 and stack.ready_s > 0
    assert_consistent(results, num=5, input_len=10, output_len=4)
    assert "launched" not in results
    assert varied["completed"] == 5 and varied["failed"] == 0 and varied["output_len_mismatches"] == 0
    assert len({row["prompt_tokens"] for row in varied["requests"]}) > 1
    assert len({row["asked_output_tokens"] for row in varied["requests"]}) > 1


def test_the_consistency_check_can_fail():
    row = {"prompt_tokens": 2, "output_tokens": 3, "asked_output_tokens": 3, "ttft_s": 0.1, "last_token_s": 0.3,
           "e2e_s": 0.35, "itl_sum_s": 0.2}  # fmt: skip
    spread = {"mean": 2.0, "min": 1.0, "p50": 2.0, "p90": 3.0, "p99": 3.0, "max": 3.0}
    good = {"completed": 1, "failed": 0, "errors": [], "requests": [row], "duration_s": 0.5, "total_output_tokens": 3,
            "total_input_tokens": 2, "output_len_mismatches": 0, "output_throughput": 6.0, "request_throughput": 2.0,
            "ttft_ms": dict.fromkeys(spread, 100.0), "itl_ms": spread, "tpot_ms": spread,
            "e2el_ms": dict.fromkeys(spread, 350.0)}  # fmt: skip
    assert_consistent(good, num=1, input_len=2, output_len=3)
    for path, value in [(("requests", 0, "ttft_s"), 0.4), (("total_output_tokens",), 2), (("itl_ms", "p99"), 0.5)]:
        broken = copy.deepcopy(good)
        *parents, key = path
        target = broken
        for step in parents:
            target = target[step]
        target[key] = value
        with pytest.raises(AssertionError):
            assert_consistent(broken, num=1, input_len=2, output_len=3)
