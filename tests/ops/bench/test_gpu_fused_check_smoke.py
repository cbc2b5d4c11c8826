"""`sparkwire bench gpu-kernels fused` (ops/bench/gpu_fused_check.py) in its CPU smoke mode (tiny model): without Triton's interpreter the
"off" setting alone; in it (skipped without Triton; the test extras install it) both, so every branch the GPU run
takes, capture and CUDA events aside, has run before the GPU call."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from ops.bench import gpu_fused_check
from tests.ops.bench.bench_cli import bench
from tests.services.scheduler.model.triton_interpreter import run_script_interpreted

REPO = Path(__file__).resolve().parents[3]
SMOKE = ["--device", "cpu", "--tiny", "--repeats", "1", "--top", "3"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreted run is the test below")
def test_cpu_tiny_run_without_the_kernels_fills_the_off_rows(tmp_path, capsys) -> None:
    out = tmp_path / "fused.json"
    assert bench("gpu-kernels", "fused", *SMOKE, "--out", out) == 0
    result = json.loads(out.read_text())
    assert result["settings"] == ["off"] and "argmax_agreement" not in result["prefill"]
    assert [row["batch"] for row in result["agreement"]] == [1, 3, "noise"]
    assert result["agreement"][-1]["off_seq0_smallest_vs_largest_batch_rel_diff"] < 1e-5  # fp32: same inputs, other shapes
    assert [(row["fused"], row["captured"], row["tokens_agree_with_eager"]) for row in result["graph_decode"]] == [("off", False, 1.0)] * 2
    assert result["profile"]["off_kernels_per_step"] > 0 and len(result["profile"]["off_top"]) == 3
    assert "| padded eager decode step b3 ms |" in capsys.readouterr().out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the kernels must fail: no interpreter, no GPU")
def test_a_failing_on_setting_is_recorded_and_the_off_baseline_kept(tmp_path, monkeypatch, capsys) -> None:
    def switch(runner, on: bool) -> None:
        if on:
            raise RuntimeError("no fused kernel today")

    monkeypatch.setattr(gpu_fused_check, "settings_here", lambda device: ("off", "on"))
    monkeypatch.setattr(gpu_fused_check.ModelRunner, "fused_kernels", property(lambda runner: False, switch))
    out = tmp_path / "fused.json"
    assert bench("gpu-kernels", "fused", *SMOKE, "--out", out) == 1
    result = json.loads(out.read_text())
    assert "no fused kernel today" in result["agreement"]["error"]
    assert [row["fused"] for row in result["graph_decode"] if "step_ms" in row] == ["off", "off"]
    assert "no fused kernel today" in result["graph_decode"][-1]["error"]
    assert result["profile"]["off_kernels_per_step"] > 0 and "no fused kernel today" in result["profile"]["on_error"]
    assert gpu_fused_check.failures(result) == ["prefill", "agreement", "graph_decode", "profile"]
    assert "| graph decode, fused on | | | | RuntimeError: no fused kernel today |" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton's interpreter")
def test_cpu_tiny_run_in_the_triton_interpreter_compares_both_settings(tmp_path) -> None:
    out = tmp_path / "fused.json"
    done = run_script_interpreted("ops/bench/gpu_fused_check.py", [*SMOKE, "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["settings"] == ["off", "on"]
    *decodes, noise = result["agreement"]
    rows = [result["prefill"], *decodes]
    assert all(row["argmax_agreement"] == 1.0 and row["hidden_rel_diff"] < 1e-5 and row["worst_row_rel_diff"] < 1e-5 for row in rows)
    assert all(row["kv_rel_diff"] < 1e-5 for row in decodes) and noise["on_seq0_smallest_vs_largest_batch_rel_diff"] < 1e-5
    assert {(row["fused"], row["batch"]) for row in result["graph_decode"]} == {("off", 1), ("off", 3), ("on", 1), ("on", 3)}
    assert all(row["tokens_agree_with_eager"] == 1.0 for row in result["graph_decode"])
    assert result["profile"]["on_kernels_per_step"] > 0
    assert "| eager decode b3 ctx 20 | | | 1.0 |" in done.stdout
