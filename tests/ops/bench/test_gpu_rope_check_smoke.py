"""`sparkwire bench gpu-kernels rope` (ops/bench/gpu_rope_check.py) in its CPU smoke mode, in Triton's interpreter (skipped without Triton;
the test extras install it): every launch shape it times on the H200 runs, matches one head per program bit for
bit and the torch twin to fp32 rounding, before the GPU call."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.services.scheduler.model.triton_interpreter import run_script_interpreted


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton's interpreter")
def test_cpu_tiny_run_in_the_triton_interpreter(tmp_path) -> None:
    out = tmp_path / "rope.json"
    run_script_interpreted("ops/bench/gpu_rope_check.py", ["--device", "cpu", "--tiny", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    # 6 rotated heads of the tiny shape: from one a program to all in one masked program (8, 16)
    assert [(r["tokens"], r["heads_per_program"]) for r in rows] == [(t, h) for t in (1, 5) for h in (1, 2, 4, 8, 16)]
    assert all(r["identical_to_first"] and r["max_diff_vs_twin"] < 1e-5 and r["us"] > 0 for r in rows)
    assert [r["heads_per_program"] for r in rows if r["default"]] == [8, 8]
