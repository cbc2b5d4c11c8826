"""`sparkwire bench gpu-peer` (ops/bench/gpu_peer_check.py) at toy size on CPU (the tiny model, fp32):
the core's rows, with and without logprobs and overlap, the HF `generate()` peer on the same shape,
and the roofline row, so the GPU run cannot rot."""

from __future__ import annotations

import json

from tests.ops.bench.bench_cli import bench


def test_cpu_tiny_run_times_the_core_the_peer_and_the_roofline(tmp_path, capsys) -> None:
    out = tmp_path / "peer.json"
    assert bench("gpu-peer", "--device", "cpu", "--tiny", "--batch-sizes", 1, 2, "--prompt-len", 8, "--new-tokens", 6,
                 "--compare-overlap", "--out", out) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert result["errors"] == {} and [r["batch"] for r in result["rows"]] == [1, 2]
    runs = ("sparkwire", "sparkwire_logprobs", "sparkwire_no_overlap", "sparkwire_no_overlap_logprobs")
    assert all(row[run]["tok_s"] > 0 and row[run]["steps"] > 0 for row in result["rows"] for run in runs)
    assert all(row["hf_generate"]["tok_s"] > 0 for row in result["rows"])  # the test extras install transformers
    (floor,) = result["roofline"]
    assert floor["model"] == "sparkwire-tiny" and floor["weight_gb"] > 0 and floor["batch1_ms_per_step"] > 0
    assert floor["floor_ms"] is None and floor["copy_gb_s"] == 0  # no HBM to measure on the CPU
    assert "| sparkwire-tiny | 2 | off |" in capsys.readouterr().out
