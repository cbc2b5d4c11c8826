"""`ops/bench/two_gpu_serve.py` at toy size on CPU, so the two-GPU script cannot rot: every phase,
the dspark ones included (their schedulers are restarts, appending to the same logs), serves."""

from __future__ import annotations

import json

import pytest

from ops.bench.two_gpu_serve import REPO, TwoGpuConfig, run


@pytest.mark.timeout(300)
def test_every_phase_serves_at_toy_size(tmp_path):
    config = TwoGpuConfig(
        model_config=REPO / "ops/models/sparkwire-micro", draft_model=REPO / "ops/models/sparkwire-micro-dspark",
        device="cpu", concurrency=2, prompts_per_scheduler=3, input_len=8, output_len=4, num_warmups=1,
        stop_after_s=0.5, progress=False,
    )  # fmt: skip
    out = tmp_path / "two.json"
    run(config, out)
    result = json.loads(out.read_text())
    assert "error" not in result, result.get("error")
    for phase, count in (("one_scheduler", 3), ("all_schedulers", 6), ("dspark_one_scheduler", 3), ("dspark_all_schedulers", 6)):
        assert (result[phase]["completed"], result[phase]["failed"]) == (count, 0), (phase, result[phase]["errors"])
        assert sum(result[phase]["requests_per_scheduler"].values()) == count + 1, phase  # + the warm-up
    stopping = result["one_stops_mid_run"]
    assert stopping["exit_code"] == 0 and stopping["after"]["failed"] == 0
    assert stopping["during"]["completed"] + stopping["during"]["failed"] == 6
