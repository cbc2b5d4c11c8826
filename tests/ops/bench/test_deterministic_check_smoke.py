"""`sparkwire bench deterministic` (ops/bench/deterministic_check.py) at toy size on CPU (`--tiny`):
every axis runs in both modes, the mode on is bitwise on each, and the cost rows come back. A
subprocess: the run leaves torch threads and caches behind that the other tests need not share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
AXES = ["batch", "chunked_16", "chunked_61", "chunked_128", "preempted", "dspark_static", "dspark_compact", "forks",
        "seeded_t1", "seeded_t1_dspark"]  # fmt: skip


def test_deterministic_check_runs_on_cpu_and_the_mode_is_bitwise_on_every_axis(tmp_path):
    out = tmp_path / "det.json"
    command = [sys.executable, "-m", "ops.bench", "deterministic", "--device", "cpu", "--tiny", "--prompts", "4",
               "--new-tokens", "3", "--batches", "1", "--cost-new-tokens", "6", "--simulate-accept-len", "3", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    on, off = result["axes_micro_on"], result["axes_micro_off"]
    assert [r["axis"] for r in on] == AXES and [r["axis"] for r in off] == AXES, (on, off)
    assert all(r["bitwise"] and r["identical_outputs"] == r["requests"] for r in on)
    assert next(r for r in on if r["axis"] == "preempted")["preemptions"] >= 0  # forced at full size (tests/services/scheduler/test_deterministic.py)
    [row] = result["cost"]
    assert row["batch"] == 1 and row["tok_s_on"] > 0 and row["simulated_accept_len"] == 3
    assert "bitwise True" in done.stdout and "cost batch   1" in done.stdout
