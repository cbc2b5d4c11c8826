"""`sparkwire bench gpu-models` (ops/bench/gpu_models.py) in its CPU smoke mode, in Triton's interpreter
(skipped without Triton; the test extras install it): the fused MoE kernel matches its twin at the
tiny shape (on bf16 and FP8 stacks), every decode row of the MoE (bf16, FP8), bf16 and both FP8
layouts runs with its replay's tokens equal to eager, FP8's logprobs are compared (on the CPU both sides are the twin: 0), every FP8
projection of every layer is checked against its W8A8 reference (on the CPU the twin runs, which
does not quantize activations: a difference of FP8 activation rounding's size, which the check must
see), each layer's fused one-token FP8 GEMVs equal the unfused kernels bit for bit, each projection
shape is timed in every layout and, block-wise, under candidate decode tiles (the GEMV's at batch 1)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.services.scheduler.model.triton_interpreter import run_script_interpreted

FP8_LAYOUTS = ("bf16", "fp8-block", "fp8-channel")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton's interpreter")
def test_cpu_tiny_run_in_the_triton_interpreter(tmp_path) -> None:
    out = tmp_path / "models.json"
    run_script_interpreted("ops/bench/gpu_models.py", ["--device", "cpu", "--tiny", "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["tokens"] for r in result["moe_kernel"]] == [1, 5]
    assert all(r["rel_diff"] < 1e-5 and r["fp8_rel_diff"] < 1e-5 and r["fused_us"] > 0 for r in result["moe_kernel"])
    steps = result["moe_steps"] + result["fp8_steps"]
    assert [(r["model"], r["layout"], r["batch"]) for r in steps] == [
        (model, layout, batch) for model, layouts in (("Qwen3-30B-A3B", ("bf16", "fp8-block")), ("Qwen3-8B", FP8_LAYOUTS))
        for layout in layouts for batch in (1, 4)
    ]
    assert all(r["next_tokens_agree"] and r["step_ms"] > 0 and r["bytes_read_gb"] > 0 for r in steps)
    assert [r["layout"] for r in result["fp8_logprobs"]] == ["fp8-block", "fp8-channel"]
    assert all(r["max_abs_diff_all"] == 0.0 and r["greedy_agree"] == 1.0 for r in result["fp8_logprobs"])
    w8a8 = result["fp8_w8a8"]
    assert sorted({(r["layout"], r["step"], r["layer"]) for r in w8a8}) == sorted(
        (layout, step, layer) for layout in ("fp8-block", "fp8-channel")
        for step in ("decode 1", "decode 4", "prefill 4x20", "decode 1 fused") for layer in (0, 1)
    )
    assert all(r["path"] == "twin" and 1e-3 < r["max_rel"] < 0.1 for r in w8a8 if r["step"] != "decode 1 fused")
    # the fused FP8 GEMVs (the interpreter runs the W8A8 kernels) against the unfused kernels: the same bits
    assert all(r["path"] == "fp8 fused" and r["max_abs"] == 0.0 and r["ref_max"] > 0 and r["within_bound"]
               for r in w8a8 if r["step"] == "decode 1 fused")  # fmt: skip
    assert {(r["projection"], r["batch"], r["layout"]) for r in result["fp8_linear"]} == {
        (name, batch, layout) for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") for batch in (1, 4)
        for layout in ("bf16", "fp8-block", "fp8-channel")
    }
    # per projection: at batch 1 the tensor-core kernel's own tiling and 2 GEMV candidates, at 4 2 tensor-core candidates
    assert len(result["fp8_tiles"]) == 4 * (1 + 2 + 2) and all(r["us"] > 0 and r["splits"] >= 1 for r in result["fp8_tiles"])
    assert {(r["batch"], r["kernel"]) for r in result["fp8_tiles"]} == {(1, "tensor-core"), (1, "gemv"), (4, "tensor-core")}
