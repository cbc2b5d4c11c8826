"""ops/bench/gpu_mixed_step.py at toy size on CPU: both attention plans run and give the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_gpu_mixed_step_runs_on_cpu_and_both_plans_agree(tmp_path):
    out = tmp_path / "mixed.json"
    command = [sys.executable, "ops/bench/gpu_mixed_step.py", "--device", "cpu", "--target", "ops/models/sparkwire-tiny",
               "--batch", "4", "--context", "24", "--prefill", "20", "--repeats", "2", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["paged_query_lens"] == [1] and result["next_token_agreement"] == 1.0
    assert all(result[key] > 0 for key in ("mixed_sdpa_ms", "mixed_paged_ms", "decode_alone_ms", "prefill_alone_ms"))
