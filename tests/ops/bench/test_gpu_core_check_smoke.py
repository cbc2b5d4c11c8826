"""`sparkwire bench gpu-core` (ops/bench/gpu_core_check.py) at toy size on CPU (tiny target, a dummy
drafter for it: `--tiny`): it cannot rot. A subprocess each: the run leaves torch threads and
caches behind that the other tests need not share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_gpu_core_check_runs_on_cpu_and_reports_the_simulated_accept_length(tmp_path):
    out = tmp_path / "core.json"
    command = [sys.executable, "-m", "ops.bench", "gpu-core", "--device", "cpu", "--tiny",
               "--batches", "1", "2", "--prompt-len", "8", "--new-tokens", "30", "--simulate-accept-len", "3", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    runs = ("plain", "top20", "top20_graphs")
    assert [(r["batch"], r["logprobs"]) for r in result["core"]] == [(b, name) for b in (1, 2) for name in runs]
    assert [(r["batch"], r["logprobs"]) for r in result["dspark"]] == [(b, name) for b in (1, 2) for name in runs]
    for row in result["dspark"]:
        # 30 tokens each: 1 from prefill, then every verify keeps 2 drafts + 1 token, whatever the target says;
        # 3 warm-up verifies (9 tokens) come before the timed steps, which make the other 20: 7 steps
        assert row["simulated_accept_len"] == 3 and row["gamma"] == 3
        assert row["tokens"] == row["batch"] * 20 and row["steps"] == 7
        assert sorted(r["place"] for r in row["rounds"]) == [0, 1, 2]  # rotated like the core's
    assert all(r["tok_s"] > 0 for r in result["core"])
    for row in result["core"]:  # three rounds, the run timed first, second and third once each; the median kept
        assert sorted(r["place"] for r in row["rounds"]) == [0, 1, 2]
        assert row["tok_s"] == sorted(r["tok_s"] for r in row["rounds"])[1]
    assert [(r["step"], r["batch"], r["logprob_graphs"]) for r in result["top20_cost"]] == [
        (step, b, graphs) for step in ("plain", "dspark") for b in (1, 2) for graphs in (False, True)]
    assert [(r["batch"], r["rows_per_request"]) for r in result["logprob_path"]] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert all(r["top_k_variants_agree"] for r in result["logprob_path"])
    assert all(r["graphs_agree_raw"] and r["graphs_agree_processed"] for r in result["logprob_path"])


def test_gpu_core_check_logprob_cost_runs_only_what_the_top20_cost_needs(tmp_path):
    out = tmp_path / "core.json"
    command = [sys.executable, "-m", "ops.bench", "gpu-core", "--device", "cpu", "--tiny",
               "--batches", "1", "--prompt-len", "8", "--new-tokens", "30", "--logprob-cost", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert "graph" not in result and "kernels" not in result and result["before"] is None
    assert len(result["top20_cost"]) == 4 and len(result["logprob_path"]) == 2
    assert "top-20 cost, dspark" in done.stdout

