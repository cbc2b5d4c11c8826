"""`sparkwire bench gpu-kernels logprobs` (ops/bench/gpu_logprob_kernel_check.py) in its CPU smoke mode (V=1000): without Triton's interpreter the
torch path alone; in it (skipped without Triton; the test extras install it) the kernels too, compared, so every
branch the GPU run takes, capture, CUDA events and memory peaks aside, has run before the GPU call."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from ops.bench import gpu_logprob_kernel_check
from tests.ops.bench.bench_cli import bench
from tests.services.scheduler.model.triton_interpreter import run_script_interpreted

REPO = Path(__file__).resolve().parents[3]
SMOKE = ["--device", "cpu", "--tiny", "--repeats", "1", "--prompt-repeats", "1"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreted run is the test below")
def test_cpu_tiny_run_without_the_kernels_times_the_torch_path(tmp_path, capsys) -> None:
    out = tmp_path / "lpk.json"
    assert bench("gpu-kernels", "logprobs", *SMOKE, "--out", out) == 0
    result = json.loads(out.read_text())
    assert result["paths"] == ["torch"]
    assert [row["rows"] for row in result["rows"]] == [1, 3] and all(row["torch_ms"] > 0 for row in result["rows"])
    assert "kernel_ms" not in result["prompt_chunk"] and result["prompt_32k"]["torch_extra_bytes"] is None
    assert "greedy" not in result  # the kernels' own comparison: only where they run
    assert "| prompt 40 rows k=2 via LM head |" in capsys.readouterr().out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the kernels are faked here")
def test_ids_that_differ_fail_the_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gpu_logprob_kernel_check, "paths_here", lambda device: ("torch", "kernel"))
    monkeypatch.setattr(gpu_logprob_kernel_check, "PATHS", {"torch": False, "kernel": False})  # the torch path twice
    monkeypatch.setattr(gpu_logprob_kernel_check, "agreement", lambda want, got: {"max_abs_diff": 0.0, "ids_equal": False})
    assert bench("gpu-kernels", "logprobs", *SMOKE, "--out", tmp_path / "lpk.json") == 1


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton's interpreter")
def test_cpu_tiny_run_in_the_triton_interpreter_compares_both_paths(tmp_path) -> None:
    from services.scheduler import triton_logprobs

    out = tmp_path / "lpk.json"
    run_script_interpreted("ops/bench/gpu_logprob_kernel_check.py", [*SMOKE, "--sweep", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["paths"] == ["torch", "kernel"]
    rows = [*result["rows"], result["prompt_chunk"], result["prompt_32k"], *result["layouts"]]
    assert all(row["ids_equal"] is True and row["max_abs_diff"] < 2e-6 and row["kernel_ms"] > 0 for row in rows)
    # two prompt-row counts (bf16) and each output-row count (f32) at every layout, the default first
    assert len(result["layouts"]) == (2 + len(result["rows"])) * (1 + len(gpu_logprob_kernel_check.OTHER_LAYOUTS))
    assert (result["layouts"][0]["block"], result["layouts"][0]["target_programs"]) == (triton_logprobs.BLOCK, triton_logprobs.TARGET_PROGRAMS)
    assert {(row["dtype"], row["rows"]) for row in result["layouts"]} == {("bfloat16", 4), ("float32", 1), ("float32", 3)}
    # a greedy step's rows: the argmax as its own kernel against the kernels taking it, same tokens and columns
    assert [row["rows"] for row in result["greedy"]] == [1, 3]
    assert all(row["tokens_equal"] and row["ids_equal"] and row["max_abs_diff"] == 0 and row["after_ms"] > 0 for row in result["greedy"])
