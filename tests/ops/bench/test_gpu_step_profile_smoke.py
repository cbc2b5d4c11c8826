"""ops/bench/gpu_step_profile.py on the CPU (tiny model; the bundled pair for DSpark): every setting
runs through the core `build_core` makes and is recorded, Python profile included."""

from __future__ import annotations

import json

from ops.bench import gpu_step_profile


def test_step_profile_records_each_setting(tmp_path) -> None:
    out = tmp_path / "profile.json"
    assert gpu_step_profile.main(["--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["logprobs"], r["overlap"]) for r in rows] == [(False, False), (False, True), (True, False), (True, True)]
    assert all(r["ms_per_step"] > 0 and r["decode_ms_per_step"] > 0 and r["steps"] > 0 and r["top_host_self_ms"] and r["python_self_ms_per_step"] for r in rows)


def test_dspark_profile_runs_verify_steps_without_overlap(tmp_path) -> None:
    out = tmp_path / "profile.json"
    assert gpu_step_profile.main(["--device", "cpu", "--draft", "bundled", "--batch", "2", "--top-logprobs", "20", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["draft"].endswith("sparkwire-micro-dspark") and result["top_logprobs"] == 20
    assert [(r["logprobs"], r["overlap"]) for r in result["rows"]] == [(False, False), (True, False)]
    # one step per new token at most (the dummy drafter's drafts are rejected: about one a step)
    assert all(0 < r["steps"] <= 8 and r["python_self_ms_per_step"] for r in result["rows"])
