"""`sparkwire bench gpu-kernels gemv` (ops/bench/gpu_gemv_check.py) in its CPU smoke mode, in Triton's interpreter (skipped without Triton;
the test extras install it): every op it times on the H200 runs at `gemv_tiles`' own tiles and the two
tiny settings and matches what served before to fp32 rounding, and the batch-1 step with the GEMVs (own
tiles, and each op's fastest) gives the step's token without them. The kernels' masks and odd tiles are
test_fused_kernels.py's, against their twins."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.services.scheduler.model.triton_interpreter import run_script_interpreted


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton's interpreter")
def test_cpu_tiny_run_in_the_triton_interpreter(tmp_path) -> None:
    out = tmp_path / "gemv.json"
    run_script_interpreted("ops/bench/gpu_gemv_check.py", ["--device", "cpu", "--tiny", "--repeats", "1", "--calls", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    gemvs = [r for r in result["kernels"] if r["path"] == "gemv"]
    assert {r["op"] for r in gemvs} == {"norm_qkv", "norm_gate_up", "silu_down", "o_proj"}
    assert all(r["rel_diff"] < 1e-5 and r["us"] > 0 for r in gemvs)
    assert sum(r["default"] for r in gemvs) == 4  # one of each op's rows is gemv_tiles' own
    assert [(r["setting"], r["token_agrees"]) for r in result["steps"]] == [("off", True), ("on", True), ("tuned", True)]
