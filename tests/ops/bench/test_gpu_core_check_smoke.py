"""ops/bench/gpu_core_check.py at toy size on CPU (tiny target, a dummy drafter for it): it cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from services.scheduler.model.config import ModelConfig
from services.scheduler.spec.dspark_config import draft_config_for_target

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "ops/models/sparkwire-tiny"


def test_gpu_core_check_runs_on_cpu_and_reports_the_simulated_accept_length(tmp_path):
    draft = _draft(tmp_path)
    out = tmp_path / "core.json"
    command = [sys.executable, "ops/bench/gpu_core_check.py", "--device", "cpu", "--target", str(TINY), "--draft", str(draft),
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
    draft = _draft(tmp_path)
    out = tmp_path / "core.json"
    command = [sys.executable, "ops/bench/gpu_core_check.py", "--device", "cpu", "--target", str(TINY), "--draft", str(draft),
               "--batches", "1", "--prompt-len", "8", "--new-tokens", "30", "--logprob-cost", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert "graph" not in result and "kernels" not in result and result["before"] is None
    assert len(result["top20_cost"]) == 4 and len(result["logprob_path"]) == 2
    assert "top-20 cost, dspark" in done.stdout


def _draft(tmp_path: Path) -> Path:
    """A dummy drafter's config for the tiny target (block size 3)."""
    draft = tmp_path / "draft"
    draft.mkdir()
    config = draft_config_for_target(ModelConfig.from_pretrained(TINY), num_draft_layers=1, mask_token_id=5, block_size=3, markov_rank=4)
    (draft / "config.json").write_text(json.dumps(config.to_dict()))
    return draft
