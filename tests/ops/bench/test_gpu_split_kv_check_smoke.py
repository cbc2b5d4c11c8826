"""`sparkwire bench gpu-kernels split-kv` (ops/bench/gpu_split_kv_check.py) in its CPU smoke mode (tiny model): without Triton's interpreter the
graph section alone (the attention section says why it did not run); in it (skipped without Triton;
the test extras install it) the kernel rows too, so every branch the GPU run takes, capture and CUDA events aside,
has run before the GPU call."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from ops.bench import gpu_split_kv_check
from tests.ops.bench.bench_cli import bench
from tests.services.scheduler.model.triton_interpreter import run_script_interpreted

REPO = Path(__file__).resolve().parents[3]
SMOKE = ["--device", "cpu", "--tiny", "--repeats", "1", "--budget-s", "600"]  # a loaded CI box must not skip sections
STEPS = {(setting, context, batch) for setting in ("off", "on") for context in (9, 20) for batch in (1, 3)}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreted run is the test below")
def test_cpu_tiny_run_fills_the_graph_rows_and_skips_the_kernel_rows(tmp_path, capsys) -> None:
    out = tmp_path / "split_kv.json"
    assert bench("gpu-kernels", "split-kv", *SMOKE, "--out", out) == 0
    result = json.loads(out.read_text())
    assert result["kernel"] is False and "needs the Triton kernel" in result["attention"]["skipped"]
    assert {(row["split"], row["context"], row["batch"]) for row in result["graph_decode"]} == STEPS
    assert all(row["tokens_agree_with_off"] == 1.0 and row["captured"] is False for row in result["graph_decode"])
    assert "| padded eager decode step ctx 20 b3 ms |" in capsys.readouterr().out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the switch must fail here, not in the interpreter")
def test_a_failing_on_setting_is_recorded_and_the_off_rows_kept(tmp_path, monkeypatch, capsys) -> None:
    def switch(runner, on: bool) -> None:
        if on:
            raise RuntimeError("no split today")

    monkeypatch.setattr(gpu_split_kv_check.ModelRunner, "split_kv_decode", property(lambda runner: False, switch))
    out = tmp_path / "split_kv.json"
    assert bench("gpu-kernels", "split-kv", *SMOKE, "--out", out) == 1
    rows = json.loads(out.read_text())["graph_decode"]
    assert [row["split"] for row in rows if "step_ms" in row] == ["off"] * 4 and "no split today" in rows[-1]["error"]
    assert "| graph decode, split on | | | | RuntimeError: no split today |" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton's interpreter")
def test_cpu_tiny_run_in_the_triton_interpreter_compares_the_kernels(tmp_path) -> None:
    out = tmp_path / "split_kv.json"
    done = run_script_interpreted("ops/bench/gpu_split_kv_check.py", [*SMOKE, "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["attention"]
    assert {(row["q"], row["context"], row["batch"]) for row in rows} == {(q, c, b) for q in (1, 8) for c in (9, 20) for b in (1, 3)}
    assert all(row["num_splits"] == 5 for row in rows)  # the 5-block table caps what 132 SMs would want
    diffs = ("on_vs_off_max_abs_diff", "off_vs_twin_max_abs_diff", "on_vs_twin_max_abs_diff")
    assert all(row[diff] < 1e-5 for row in rows for diff in diffs)
    assert {(row["split"], row["context"], row["batch"]) for row in result["graph_decode"]} == STEPS
    assert "| attention q8 ctx 20 b3 us |" in done.stdout
