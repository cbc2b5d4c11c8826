"""`sparkwire bench dspark-step-profile` (ops/bench/dspark_step_profile.py) on the CPU with the tiny
pair, so the GPU run cannot rot: both modes are profiled and the table's figures add up."""

from __future__ import annotations

import json

import pytest

from ops.bench.dspark_step_profile import busy_us
from tests.ops.bench.bench_cli import bench


def test_busy_time_is_the_union_of_intervals():
    assert busy_us([(0, 10), (5, 15), (20, 25)]) == 20  # overlap counted once, the gap not at all
    assert busy_us([(3, 4), (0, 10)]) == 10  # a kernel inside another's span adds nothing
    assert busy_us([]) == 0


@pytest.mark.timeout(300)
def test_both_modes_are_profiled_on_the_tiny_pair(tmp_path):
    out = tmp_path / "profile.json"
    assert bench("dspark-step-profile", "--tiny", "--device", "cpu", "--steps", 3, "--out", out) == 0
    result = json.loads(out.read_text())
    plain, dspark = result["modes"]["plain"], result["modes"]["dspark"]
    for row in (plain, dspark):
        assert row["steps"] == 3 and 0 < row["busy_ms"] <= row["wall_ms"]
        assert row["idle_ms"] == pytest.approx(row["wall_ms"] - row["busy_ms"])
        assert row["top"] and all(k["ms"] > 0 and k["per_step"] > 0 for k in row["top"])
    assert dspark["kernels"] > plain["kernels"]  # a DSpark step drafts and verifies: more work than a decode step
