"""`sparkwire bench two-gpu-serve` (ops/bench/two_gpu_serve.py) at toy size on CPU, so the two-GPU
script cannot rot: every phase, the dspark ones included (their schedulers are restarts, appending
to the same logs), serves."""

from __future__ import annotations

import json

import pytest

from ops.bench.common import REPO
from tests.ops.bench.bench_cli import bench


@pytest.mark.timeout(300)
def test_every_phase_serves_at_toy_size(tmp_path):
    out = tmp_path / "two.json"
    code = bench("two-gpu-serve", "--model-config", REPO / "ops/models/sparkwire-micro", "--draft-model", REPO / "ops/models/sparkwire-micro-dspark",
                 "--device", "cpu", "--concurrency", 2, "--prompts-per-scheduler", 3, "--input-len", 8, "--output-len", 4,
                 "--num-warmups", 1, "--stop-after-s", 0.5, "--no-progress", "--out", out)  # fmt: skip
    result = json.loads(out.read_text())
    assert "error" not in result and code == 0, result.get("error")
    for phase, count in (("one_scheduler", 3), ("all_schedulers", 6), ("dspark_one_scheduler", 3), ("dspark_all_schedulers", 6)):
        assert (result[phase]["completed"], result[phase]["failed"]) == (count, 0), (phase, result[phase]["errors"])
        assert sum(result[phase]["requests_per_scheduler"].values()) == count + 1, phase  # + the warm-up
    stopping = result["one_stops_mid_run"]
    assert stopping["exit_code"] == 0 and stopping["after"]["failed"] == 0
    assert stopping["during"]["completed"] + stopping["during"]["failed"] == 6
