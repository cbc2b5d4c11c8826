"""`sparkwire bench dspark-accept` (ops/bench/dspark_context_accept.py) at a small size on the CPU: the bundled pair through the core,
with and without the drafter's configured context window."""

from __future__ import annotations

import json

from tests.ops.bench.bench_cli import bench


def test_small_run_serves_both_windows_and_the_window_only_matters_past_its_length(tmp_path, capsys) -> None:
    out = tmp_path / "accept.json"
    argv = ["--prompt-lens", "32", "400", "--windows", "0", "config", "--temperatures", "0", "--num-prompts", "2",
            "--new-tokens", "16", "--out", str(out)]  # fmt: skip
    assert bench("dspark-accept", *argv) == 0
    result = json.loads(out.read_text())
    rows = {(row["prompt_len"], row["window"]): row for row in result["rows"]}
    assert set(rows) == {(32, "0"), (32, "config"), (400, "0"), (400, "config")} and result["configured_window"] == 256
    assert rows[(400, "0")]["window_served"] is None and rows[(400, "config")]["window_served"] == 256
    assert all(1.0 <= row["accept_length"] <= 8.0 and row["verify_forwards"] > 0 and row["propose_ms"] > 0 for row in rows.values())
    # 32 + 16 tokens never reach back 256 positions: the same drafts, so the same verify count
    assert rows[(32, "0")]["verify_forwards"] == rows[(32, "config")]["verify_forwards"]
    assert "| 400 | 0 |" in capsys.readouterr().out
