"""`sparkwire bench gpu-kernels prefill-attention` (ops/bench/gpu_prefill_attention_check.py) in its CPU smoke mode (tiny shape): every candidate that
runs off CUDA (the varlen twin, the dense path's variants through `varlen_attention`, math SDPA)
has a row, agrees with the varlen twin, and the table is printed."""

from __future__ import annotations

import json
import os

import pytest

from tests.ops.bench.bench_cli import bench

DENSE = {f"dense_chunks{chunk}_{mask}" for chunk in (32, 128) for mask in ("merge", "merge_flash", "merge_expanded", "lower_right")}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the CPU twin's run, not the interpreter's")
def test_cpu_tiny_run_fills_every_cpu_row(tmp_path, capsys) -> None:
    out = tmp_path / "prefill_attention.json"
    assert bench("gpu-kernels", "prefill-attention", "--device", "cpu", "--tiny", "--repeats", "1", "--out", out) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"varlen_chunks", "varlen_whole", "sdpa_math_gqa", *DENSE}
    assert all("ms" in row and row["max_abs_diff"] < 1e-5 for row in rows.values()), rows
    assert "dense_chunks32_merge " in capsys.readouterr().out
