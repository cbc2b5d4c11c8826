"""`sparkwire bench gpu-kernels attention` (ops/bench/gpu_attention_check.py) in its CPU smoke mode (tiny shape, the kernel's torch twin): it cannot rot."""

from __future__ import annotations

import json

from ops.bench import gpu_attention_check
from tests.ops.bench.bench_cli import bench


def test_cpu_tiny_run_fills_every_section_it_can_and_prints_the_table(tmp_path, capsys) -> None:
    out = tmp_path / "attention.json"
    assert bench("gpu-kernels", "attention", "--device", "cpu", "--tiny", "--repeats", "1", "--out", out) == 0
    result = json.loads(out.read_text())
    assert [r["mix"] for r in result["kernels"]] == ["mixed", "prefills", "long"]
    assert all(r["max_abs_err"] < 1e-4 and r["sdpa_ms"] > 0 and r["kernel_ms"] > 0 for r in result["kernels"])
    assert result["kernels"][2]["steps"] == 256 // 64  # the long prompt in the policy's chunks
    assert "sweep" not in result and not result["kernel"]  # no Triton kernel on CPU
    assert result["mixed_step"]["mixed_sdpa_ms"] > 0 and "mixed_kernel_ms" not in result["mixed_step"]
    graph = result["ragged_graph"]  # the padded twin, eagerly: nothing captured on CPU
    assert graph["mixed_argmax_agreement"] == graph["verify_argmax_agreement"] == 1.0 and graph["captured"] == []
    assert graph["mixed_vs_padded_max_abs_diff"] == graph["verify_vs_padded_max_abs_diff"] == 0.0  # no graphs: the same path
    assert graph["mixed_hidden_max_abs_diff_relative"] < 1e-5 and graph["verify_worst_row_rel_diff"] < 1e-5 and graph["verify_tokens"] == 1 + 2 + 3 + 4  # 4 decodes, queries 1..4
    rows = {(r["path"], r["logprobs"]): r for r in result["prefill_32k"]}
    assert rows[("sdpa", "top2")]["prompt_logprob_rows"] == 256 and rows[("sdpa", "plain")]["prompt_logprob_rows"] == 0
    assert "| layer, long (256 tok, 4 steps) |" in capsys.readouterr().out


def test_a_failing_section_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch) -> None:
    def broken(*args):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(gpu_attention_check, "kernel_rows", broken)
    out = tmp_path / "attention.json"
    assert bench("gpu-kernels", "attention", "--device", "cpu", "--tiny", "--repeats", "1", "--out", out) == 1
    result = json.loads(out.read_text())
    assert "no kernel today" in result["kernels"]["error"]
    assert result["mixed_step"]["mixed_sdpa_ms"] > 0 and len(result["prefill_32k"]) == 2
