"""ops/bench/gpu_step_profile.py on the CPU (tiny model): the four settings run and are recorded."""

from __future__ import annotations

import json

from ops.bench import gpu_step_profile


def test_step_profile_records_each_setting(tmp_path) -> None:
    out = tmp_path / "profile.json"
    assert gpu_step_profile.main(["--device", "cpu", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["logprobs"], r["overlap"]) for r in rows] == [(False, False), (False, True), (True, False), (True, True)]
    assert all(r["ms_per_step"] > 0 and r["steps"] > 0 and r["top_host_self_ms"] for r in rows)
