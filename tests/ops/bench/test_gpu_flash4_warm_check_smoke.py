"""ops/bench/gpu_flash4_warm_check.py off the GPU: it runs, and its JSON says why FA4 cannot."""

from __future__ import annotations

import json

from ops.bench.gpu_flash4_warm_check import main


def test_on_cpu_the_check_records_why_flash4_cannot_run(tmp_path) -> None:
    out = tmp_path / "warm.json"
    assert main(["--device", "cpu", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == {"unavailable": "flash4 needs CUDA, not cpu"}
